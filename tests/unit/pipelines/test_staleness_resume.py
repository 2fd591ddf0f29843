"""With ``runner.max_staleness=1`` the next step's prompts are drawn before a checkpoint is written. A resume from
that checkpoint trains each step on the prompts the uninterrupted run drew for it: before, the sampler state in
the checkpoint already counted the next batch, so a resume skipped one batch of prompts and every later step
trained on other data, silently."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from pipelines.config import load_config
from pipelines.runner import Runner

TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=1", "resources.backend=local", "resources.actor_workers=1",
        "resources.rollout_workers=1", "task.params={format_bonus: 0.5}", "runner.max_staleness=1",
        "runner.checkpoint_every=1", "runner.total_steps=3"]


@pytest.mark.slow  # two real (in-process) jobs, ~10 s
async def test_a_resume_trains_each_step_on_the_prompts_the_interrupted_run_drew(tmp_path, monkeypatch):
    drawn: dict[str, dict[int, Any]] = {}
    launch = Runner._launch

    def recording(self: Runner, step: int) -> Any:
        out = launch(self, step)
        drawn[self.out.name][step] = out.prompts["prompts"].tolist()
        return out

    monkeypatch.setattr(Runner, "_launch", recording)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    drawn["whole"], drawn["resumed"] = {}, {}
    await Runner(load_config(None, [*TINY, f"runner.output_dir={whole}"]), progress=False).run()
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000000", resumed / "checkpoints" / "step_000000")
    (resumed / "checkpoints" / "latest").write_text("step_000000")
    hist = await Runner(load_config(None, [*TINY, f"runner.output_dir={resumed}"]), resume=True,
                        progress=False).run()
    assert [h["step"] for h in hist] == [1, 2]
    assert sorted(drawn["whole"]) == [0, 1, 2] and sorted(drawn["resumed"]) == [1, 2]
    assert len({str(p) for p in drawn["whole"].values()}) == 3  # three different batches: equality means something
    for step in (1, 2):
        assert drawn["resumed"][step] == drawn["whole"][step], f"step {step} trained on other prompts"
