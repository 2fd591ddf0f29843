"""With checkpointing on, the state after the last step is saved whatever runner.total_steps is (it was saved only
when checkpoint_every divided it, and never when checkpoint_every > total_steps); a --resume after it has no step
left and says so."""

from __future__ import annotations

import pytest
from local_jobs import local_runner

from pipelines import checkpoint as ckpt
from pipelines.checkpoint import CheckpointError


@pytest.mark.slow  # a real (in-process) job of 3 short steps
@pytest.mark.parametrize("every, saved", [(2, ["step_000001", "step_000002"]), (50, ["step_000002"])])
async def test_the_last_step_is_checkpointed(tmp_path, every, saved):
    await local_runner(tmp_path, "runner.total_steps=3", f"runner.checkpoint_every={every}").run()
    assert [p.name for _, p in ckpt.committed(tmp_path / "checkpoints")] == saved
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    resumed = local_runner(tmp_path, "runner.total_steps=3", f"runner.checkpoint_every={every}", resume=True)
    with pytest.raises(CheckpointError, match="after step 2, so runner.total_steps=3 leaves no step to run"):
        await resumed.run()


@pytest.mark.slow
async def test_no_checkpoint_without_checkpointing(tmp_path):
    await local_runner(tmp_path, "runner.total_steps=1", "runner.checkpoint_every=0").run()
    assert not (tmp_path / "checkpoints").exists()
