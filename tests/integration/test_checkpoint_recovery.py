"""Checkpoints of a real run on a local Ray cluster: what is on disk, a refused second run, a corrupt newest
checkpoint (the previous one is used and its next step equals the original), planted pickles that never run."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest

from pipelines.checkpoint import CheckpointError
from pipelines.config import load_config
from pipelines.runner import Runner

TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=1", "resources.actor_workers=2", "resources.rollout_workers=2",
        "task.params={format_bonus: 0.5}", "runner.checkpoint_every=1", "runner.keep_checkpoints=2"]
SKIP = ("time", "perf/")


async def _run(out: Path, steps: int, resume: bool = False) -> list[dict]:
    cfg = load_config(None, [*TINY, f"runner.total_steps={steps}", f"runner.output_dir={out}"])
    return await Runner(cfg, resume=resume, progress=False).run()


def _same(a: dict, b: dict) -> bool:
    keys = [k for k in a if not k.startswith(SKIP) and "seconds" not in k]
    return {k: a[k] for k in keys} == {k: b[k] for k in keys}


async def test_real_checkpoints_are_verified_pruned_and_never_unpickled(tmp_path, caplog):
    out = tmp_path / "run"
    first = await _run(out, 3)
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]  # keep_checkpoints=2
    newest = root / "step_000002"
    manifest = {f["path"] for f in json.loads((newest / "manifest.json").read_text())["files"]}
    on_disk = {p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file()} - {"manifest.json"}
    assert manifest == on_disk
    assert {p.suffix for p in newest.rglob("*") if p.is_file()} == {".json", ".safetensors"}
    assert {"actor/actor/model-rank00000-of-00002.safetensors", "actor/actor/optim-rank00001-of-00002.safetensors",
            "actor/actor/index.json", "actor/actor/engine_state.json", "runner.json"} <= manifest

    # a second run into the same output_dir is refused and deletes nothing
    with pytest.raises(CheckpointError, match="--resume.*--overwrite"):
        await _run(out, 3)
    assert newest.is_dir()

    # the newest checkpoint's weights are overwritten (header intact): resume uses step_000001 instead, and the
    # step it reruns equals the original step 2
    shard = newest / "actor" / "actor" / "model-rank00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-16:] = b"\x7f" * 16
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        resumed = await _run(out, 3, resume=True)
    assert any("step_000002" in r.getMessage() and "model-rank00001-of-00002.safetensors" in r.getMessage()
               for r in caplog.records)
    assert [r["step"] for r in resumed] == [2]
    assert _same(first[2], resumed[0])

    # a pickle payload in every binary file of every checkpoint: refused before anything is loaded, nothing runs
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w')",))

    for p in root.rglob("*.safetensors"):
        p.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        await _run(out, 4, resume=True)
    assert not marker.exists()
