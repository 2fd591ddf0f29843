"""Checkpoints a resumed run did not write (Ray-free).

A resume from a checkpoint older than other committed ones (``latest_good`` fell back past a corrupt newest one, or
``latest`` lagged behind a commit that crashed before updating it) abandons the newer ones: they are set aside as
``abandoned-step_XXXXXX-<hex>`` (never deleted, named in a warning), so ``keep_checkpoints`` never spends a slot on
them and a later fallback never jumps forward to them. Before, with keep=2 a corrupt ``step_000099`` displaced one of
the resumed run's good checkpoints, and a fallback could skip to the abandoned run's ``step_000099``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipelines import checkpoint as ckpt
from pipelines.checkpoint import CheckpointError


def _save(root: Path, step: int, keep: int) -> Path:
    """A committed checkpoint holding just a runner.json (no engine roles)."""
    d = ckpt.stage(root, step)
    (d / "runner.json").write_text(json.dumps({"step": step}))
    return ckpt.commit(d, keep=keep)


def _damage(d: Path) -> None:
    (d / "runner.json").write_text("garbage")  # bit rot: no longer matches the manifest


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _aside(root: Path, name: str) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(f"abandoned-{name}-")]


def test_keep_two_leaves_a_usable_fallback_after_resuming_past_a_corrupt_checkpoint(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _save(root, 49, keep=2)
    _damage(_save(root, 99, keep=2))
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        assert ckpt.latest_good(root).name == "step_000049"  # the resume falls back (as documented)
    [aside] = _aside(root, "step_000099")  # out of the way, not deleted
    assert (aside / "runner.json").read_text() == "garbage"
    assert (root / "latest").read_text() == "step_000049"
    assert any("step_000099" in r.getMessage() and aside.name in r.getMessage() for r in caplog.records)
    _save(root, 59, keep=2)  # the resumed run goes on checkpointing
    _damage(_save(root, 69, keep=2))  # now its newest one is damaged too
    assert [p.name for _, p in ckpt.committed(root)] == ["step_000059", "step_000069"]  # keep=2 of its own
    assert ckpt.latest_good(root).name == "step_000059"
    assert _aside(root, "step_000099") == [aside]


def test_a_fallback_never_jumps_forward_to_a_checkpoint_the_resumed_run_did_not_write(tmp_path, caplog):
    """commit() crashed between renaming step_000099 into place and rewriting ``latest`` (documented: latest keeps
    naming step_000049, and --resume uses it). The resumed run redoes 50.. and commits 59, 69; if 69 is damaged, the
    fallback is 59, not the abandoned run's step_000099 (which skipped 70-99 and left a hole in metrics.jsonl)."""
    root = tmp_path / "checkpoints"
    _save(root, 49, keep=3)
    _save(root, 99, keep=3)
    (root / "latest").write_text("step_000049")  # the crash before _write_latest
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        assert ckpt.latest_good(root).name == "step_000049"
    [aside] = _aside(root, "step_000099")
    assert ckpt.verify(aside)  # a good checkpoint of the abandoned trajectory, kept for the user
    assert any("step_000099" in r.getMessage() and "latest" in r.getMessage() for r in caplog.records)
    _save(root, 59, keep=3)
    _damage(_save(root, 69, keep=3))
    assert ckpt.latest_good(root).name == "step_000059"


def test_a_commit_sets_aside_newer_checkpoints_its_resume_did_not(tmp_path, caplog):
    """A run resumed from a checkpoint chosen without latest_good (``Runner(resume_from=...)``) commits a step below
    a committed one: that one is set aside then, before it can take a keep slot or a fallback."""
    root = tmp_path / "checkpoints"
    _save(root, 49, keep=2)
    _save(root, 99, keep=2)
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        _save(root, 59, keep=2)
    assert [p.name for _, p in ckpt.committed(root)] == ["step_000049", "step_000059"]
    assert len(_aside(root, "step_000099")) == 1
    assert any("step_000099" in r.getMessage() and "step_000059" in r.getMessage() for r in caplog.records)
    _damage(root / "step_000059")
    assert ckpt.latest_good(root).name == "step_000049"


def test_a_resume_from_the_newest_checkpoint_sets_nothing_aside(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1, keep=3)
    _save(root, 2, keep=3)
    (root / "latest").write_text("garbage")  # unreadable pointer: the newest good one is used, nothing moves
    assert ckpt.latest_good(root).name == "step_000002"
    assert _names(root) == ["latest", "step_000001", "step_000002"]


def test_a_step_abandoned_twice_is_kept_twice(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1, keep=0)
    for _ in range(2):
        _save(root, 2, keep=0)
        (root / "latest").write_text("step_000001")
        assert ckpt.latest_good(root).name == "step_000001"
    assert len(_aside(root, "step_000002")) == 2


def test_a_checkpoint_that_cannot_be_set_aside_stops_the_resume(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, 1, keep=3)
    _damage(_save(root, 2, keep=3))
    real = ckpt.os.replace

    def refuse(src, dst):
        if Path(dst).name.startswith("abandoned-"):
            raise PermissionError(13, "Permission denied")
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", refuse)
    with pytest.raises(CheckpointError, match=r"step_000002.*cannot be set aside.*Permission denied"):
        ckpt.latest_good(root)
    assert _names(root) == ["latest", "step_000001", "step_000002"]


def test_overwrite_removes_abandoned_checkpoints_and_nothing_else(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1, keep=3)
    _damage(_save(root, 2, keep=3))
    assert ckpt.prepare_output_dir(tmp_path, resume=True, overwrite=False) == root / "step_000001"
    assert len(_aside(root, "step_000002")) == 1
    (root / "notes.txt").write_text("mine")
    (root / "abandoned-mine").mkdir()  # only looks like ours
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    assert _names(root) == ["abandoned-mine", "notes.txt"]
