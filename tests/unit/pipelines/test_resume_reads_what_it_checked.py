"""A ``--resume`` checks the checkpoint against its manifest before the cluster starts, and the engines load it
minutes later. A shard replaced in between (same size, other bytes: another process writing into the directory, a
copy still being made) used to load as it was — the engines were told not to check again — and the run trained on
weights nobody had checked, with exit 0. Each rank now checks each file's sha256 on the bytes it loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from local_jobs import local_runner

from pipelines.checkpoint import CheckpointError
from pipelines.runner import Runner


@pytest.mark.slow  # two real (in-process) jobs, ~10 s
async def test_a_shard_replaced_after_the_manifest_check_is_refused_when_loaded(tmp_path, monkeypatch):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    await local_runner(whole, "runner.checkpoint_every=1", "runner.total_steps=1").run()
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000000", resumed / "checkpoints" / "step_000000")
    (resumed / "checkpoints" / "latest").write_text("step_000000")
    shards = sorted((resumed / "checkpoints" / "step_000000" / "actor").rglob("*.safetensors"))
    assert shards, "the actor's checkpoint has no safetensors shard"
    target: Path = max(shards, key=lambda p: p.stat().st_size)
    restore = Runner._restore

    async def replaced_then_restore(self: Runner, state: object = None) -> None:
        data = bytearray(target.read_bytes())  # the manifest was checked: now the file changes, size kept
        data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # the last weights' bytes, not the header
        target.write_bytes(bytes(data))
        await restore(self, state)

    monkeypatch.setattr(Runner, "_restore", replaced_then_restore)
    with pytest.raises(CheckpointError, match=target.name):
        await local_runner(resumed, "runner.checkpoint_every=1", "runner.total_steps=2", resume=True).run()
