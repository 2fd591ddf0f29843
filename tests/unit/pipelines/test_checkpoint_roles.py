"""A checkpoint is only committed with every engine role's weights in it, and the runner hands the workers absolute
paths: a worker whose working directory is not the driver's (Ray's ``working_dir`` copy on an attached cluster)
writes where the runner commits, not into its own copy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from local_jobs import local_runner

from pipelines import checkpoint as ckpt
from pipelines.checkpoint import CheckpointError


def _engine_dir(d: Path, files: dict[str, bytes]) -> None:
    """What an engine's save writes: shard files, engine_state.json and an index listing the shards."""
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "engine_state.json").write_text("{}")
    (d / "index.json").write_text(json.dumps({"format": "x", "files": {n: {} for n in files}, "tensors": {}}))


def _staged(tmp_path: Path) -> Path:
    d = ckpt.stage(tmp_path / "checkpoints", 3)
    (d / "runner.json").write_text(json.dumps({"step": 3}))
    return d


def test_commit_refuses_a_role_that_wrote_nothing(tmp_path):
    d = _staged(tmp_path)
    (d / "actor").mkdir()  # the worker wrote its shards somewhere else
    with pytest.raises(CheckpointError, match=r"'actor/actor'.*index\.json is missing"):
        ckpt.commit(d, keep=3, roles=("actor/actor",))
    assert not (tmp_path / "checkpoints" / "step_000003").exists()
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_commit_refuses_a_role_missing_a_shard_its_index_lists(tmp_path):
    d = _staged(tmp_path)
    _engine_dir(d / "actor" / "actor", {"model-rank00000-of-00001.safetensors": b"w"})
    _engine_dir(d / "critic" / "critic", {"model-rank00000-of-00001.safetensors": b"v"})
    (d / "critic" / "critic" / "model-rank00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"'critic/critic'.*model-rank00000-of-00001\.safetensors"):
        ckpt.commit(d, keep=3, roles=("actor/actor", "critic/critic"))


def test_a_complete_checkpoint_records_its_roles_and_verify_checks_them(tmp_path):
    d = _staged(tmp_path)
    _engine_dir(d / "actor" / "actor", {"model-rank00000-of-00001.safetensors": b"w"})
    final = ckpt.commit(d, keep=3, roles=("actor/actor",))
    manifest = ckpt.verify(final)
    assert manifest["roles"] == ["actor/actor"]
    assert "actor/actor/model-rank00000-of-00001.safetensors" in [f["path"] for f in manifest["files"]]
    # a manifest that names a role but not its shards (written by hand, or by a bug) is not a good checkpoint
    manifest["files"] = [f for f in manifest["files"] if not f["path"].startswith("actor/")]
    ckpt.write_json_atomic(final / ckpt.MANIFEST, manifest)
    with pytest.raises(CheckpointError, match="actor/actor"):
        ckpt.verify(final)


def test_the_runner_resolves_a_relative_output_dir_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    runner = local_runner(Path("runs/rel"))
    assert runner.out == tmp_path / "runs" / "rel" and runner.cfg.runner.output_dir == str(runner.out)
    assert local_runner(Path("~/x")).out == tmp_path / "home" / "x"


@pytest.mark.slow  # a real (in-process) job, ~3 s
async def test_workers_with_another_working_directory_write_into_the_checkpoint(tmp_path, monkeypatch):
    """Ray runs the workers of a job attached to a cluster in a copy of the driver's directory: a relative path
    given to a worker lands in that copy. Here the engine's save runs in another directory, as it would there."""
    from engines.fsdp import FSDPEngine

    worker_cwd = tmp_path / "worker_cwd"
    worker_cwd.mkdir()
    (tmp_path / "job").mkdir()
    save = FSDPEngine.save

    def save_in_another_cwd(self: FSDPEngine, directory: str) -> None:
        before = os.getcwd()
        os.chdir(worker_cwd)
        try:
            save(self, directory)
        finally:
            os.chdir(before)

    monkeypatch.setattr(FSDPEngine, "save", save_in_another_cwd)
    monkeypatch.chdir(tmp_path / "job")
    runner = local_runner(Path("outputs/rel"), "runner.total_steps=1", "runner.checkpoint_every=1")
    await runner.run()
    final = tmp_path / "job" / "outputs" / "rel" / "checkpoints" / "step_000000"
    listed = [f["path"] for f in ckpt.verify(final)["files"]]
    assert "actor/actor/index.json" in listed and any(p.endswith(".safetensors") for p in listed)
    assert not any(worker_cwd.rglob("*.safetensors"))
