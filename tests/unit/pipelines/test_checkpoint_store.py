"""Run checkpoints on disk (Ray-free): staged then renamed, manifest-verified, pruned, with a fallback to the
previous good checkpoint and errors that name the file."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest

from pipelines import checkpoint as ckpt
from pipelines.checkpoint import CheckpointError


def _write_checkpoint_files(d: Path, step: int) -> None:
    """What the workers and the runner write: nested shard files, worker JSON, runner.json."""
    from safetensors.numpy import save_file
    import numpy as np

    (d / "actor" / "actor").mkdir(parents=True)
    save_file({"w": np.full((4, 4), step, dtype=np.float32)}, str(d / "actor" / "actor" / "model.safetensors"))
    (d / "actor" / "actor" / "index.json").write_text(json.dumps({"step": step}))
    (d / "actor" / "actor_worker_rank0.json").write_text(json.dumps({"weights_version": step}))
    (d / "runner.json").write_text(json.dumps({"step": step, "rng": list(range(50))}))


def _save(root: Path, step: int, keep: int = 3) -> Path:
    d = ckpt.stage(root, step)
    _write_checkpoint_files(d, step)
    return ckpt.commit(d, keep=keep)


def test_commit_renames_into_place_and_points_latest_at_it(tmp_path):
    root = tmp_path / "checkpoints"
    final = _save(root, 1)
    assert final == root / "step_000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert (root / "latest").read_text() == "step_000001"
    manifest = json.loads((final / "manifest.json").read_text())
    assert [f["path"] for f in manifest["files"]] == ["runner.json", "actor/actor_worker_rank0.json",
                                                      "actor/actor/index.json", "actor/actor/model.safetensors"]
    assert all(f["bytes"] == (final / f["path"]).stat().st_size and len(f["sha256"]) == 64 for f in manifest["files"])
    assert ckpt.latest_good(root) == final


def test_crash_between_write_and_rename_leaves_latest_on_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    crashed = ckpt.stage(root, 3)  # the writers finished, the process died before commit()
    _write_checkpoint_files(crashed, 3)
    (root / "latest.tmp-0badf00d").write_text("step_000003")  # and a half-done pointer update
    assert (root / "latest").read_text() == "step_000001"
    assert ckpt.latest_good(root) == root / "step_000001"
    assert ckpt.prepare_output_dir(tmp_path, resume=True, overwrite=False) == root / "step_000001"
    # the next commit clears what the crash left behind
    _save(root, 3)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000003"]


def test_corrupt_bytes_are_caught_by_the_manifest_and_the_previous_checkpoint_is_used(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    newest = _save(root, 2)
    shard = newest / "actor" / "actor" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8:] = b"\xff" * 8  # weights overwritten, safetensors header intact, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its sha256"):
        ckpt.verify(newest)
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        assert ckpt.latest_good(root) == root / "step_000001"
    assert any("model.safetensors" in r.getMessage() and "step_000002" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("victim", ["runner.json", "actor/actor/index.json"])
def test_truncated_json_is_named(tmp_path, victim):
    d = _save(tmp_path / "checkpoints", 1)
    text = (d / victim).read_text()
    (d / victim).write_text(text[:-3])
    with pytest.raises(CheckpointError, match=rf"{victim}.*truncated"):
        ckpt.verify(d)


def test_truncated_manifest_is_named(tmp_path):
    d = _save(tmp_path / "checkpoints", 1)
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"manifest\.json is not valid JSON"):
        ckpt.verify(d)


def test_missing_file_is_named(tmp_path):
    d = _save(tmp_path / "checkpoints", 1)
    (d / "actor" / "actor_worker_rank0.json").unlink()
    with pytest.raises(CheckpointError, match=r"actor_worker_rank0\.json is missing"):
        ckpt.verify(d)


def test_no_good_checkpoint_is_a_clear_error(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        d = _save(root, step)
        (d / "runner.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="orchestra"), \
            pytest.raises(CheckpointError, match=r"no usable checkpoint(.|\n)*step_000002(.|\n)*step_000001"):
        ckpt.latest_good(root)
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        ckpt.latest_good(tmp_path / "elsewhere")


def test_planted_pickle_in_every_binary_file_is_refused_before_loading(tmp_path):
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w')",))

    d = _save(tmp_path / "checkpoints", 1)
    binaries = [p for p in d.rglob("*") if p.is_file() and p.suffix != ".json"]
    assert binaries
    for p in binaries:
        p.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"model\.safetensors has \d+ bytes, the manifest says"):
        ckpt.verify(d)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt.prepare_output_dir(tmp_path, resume=True, overwrite=False)
    assert not marker.exists()


def test_manifest_paths_cannot_leave_the_checkpoint(tmp_path):
    d = _save(tmp_path / "checkpoints", 1)
    (tmp_path / "outside.json").write_text("{}")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"].append({"path": "../../outside.json", "bytes": 2, "sha256": "0" * 64})
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a path inside the checkpoint"):
        ckpt.verify(d)


def test_pruning_keeps_the_newest_and_touches_nothing_else(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_best").mkdir(parents=True)  # a user's directory that only looks like ours
    (root / "notes.txt").write_text("mine")
    for step in range(5):
        _save(root, step, keep=3)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "notes.txt", "step_000002", "step_000003",
                                                      "step_000004", "step_best"]
    _save(root, 5, keep=0)  # 0 keeps everything
    assert len(ckpt.committed(root)) == 4


def test_resaving_a_step_replaces_a_stale_checkpoint_whole(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    stale = _save(root, 2)
    (stale / "extra.json").write_text("{}")  # a file the new checkpoint will not have
    (root / "latest").write_text("step_000001")  # as after resuming from step 1
    again = _save(root, 2)
    assert not (again / "extra.json").exists()
    assert ckpt.latest_good(root) == again


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(tmp_path):
    _save(tmp_path / "checkpoints", 1)
    with pytest.raises(CheckpointError, match=r"holds checkpoints of an earlier run.*--resume.*--overwrite"):
        ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()
    with pytest.raises(CheckpointError, match="pass one"):
        ckpt.prepare_output_dir(tmp_path, resume=True, overwrite=True)


def test_overwrite_removes_only_our_checkpoints_and_metrics(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    ckpt.stage(root, 2)
    (root / "notes.txt").write_text("mine")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "my_analysis.csv").write_text("a,b\n")
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "my_analysis.csv"]


def test_fresh_directory_needs_nothing(tmp_path):
    assert ckpt.prepare_output_dir(tmp_path / "new", resume=False, overwrite=False) is None
    assert ckpt.prepare_output_dir(tmp_path / "new", resume=False, overwrite=True) is None


def test_a_fresh_run_refuses_to_wipe_an_earlier_runs_metrics_unless_overwrite(tmp_path):
    """No checkpoints, but metrics.jsonl of an earlier run: a fresh run used to empty it without a word."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    with pytest.raises(CheckpointError, match="metrics.jsonl of an earlier run.*--overwrite"):
        ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text().count("step") == 2  # untouched
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "metrics.jsonl").write_text("")  # an empty one (a run that wrote nothing) is no earlier run
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=False) is None


# every way a checkpoint's JSON can fail is a CheckpointError naming the file, so --resume falls back
_MANIFEST_HEAD = '{"format": "orchestra.checkpoint-manifest/1", "files": [], '
_BAD_JSON = {
    "a 5000-digit number": _MANIFEST_HEAD + '"x": ' + "9" * 5000 + "}",  # int() refuses it: a ValueError
    "nesting 100000 deep": _MANIFEST_HEAD + '"x": ' + "[" * 100_000 + "]" * 100_000 + "}",  # a RecursionError
    "a list, not an object": "[]",
    "not UTF-8": '{"format": "\xff"}',
    "truncated": _MANIFEST_HEAD[:20],
}


@pytest.mark.parametrize("what", list(_BAD_JSON))
def test_a_manifest_that_fails_to_parse_is_named_and_the_previous_checkpoint_is_used(tmp_path, caplog, what):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    newest = _save(root, 2)
    (newest / "manifest.json").write_bytes(_BAD_JSON[what].encode("latin-1"))
    with pytest.raises(CheckpointError, match=r"step_000002/manifest\.json"):
        ckpt.verify(newest)
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        assert ckpt.latest_good(root) == root / "step_000001"
    assert any("step_000002" in r.getMessage() and "manifest.json" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("what", ["a 5000-digit number", "nesting 100000 deep", "a list, not an object"])
def test_read_json_refuses_what_does_not_parse_to_an_object(tmp_path, what):
    """runner.json and the workers' JSON are read with read_json too: the caller gets a CheckpointError naming
    the file, never a ValueError, RecursionError or a list it does not expect."""
    p = tmp_path / "runner.json"
    p.write_text(_BAD_JSON[what])
    with pytest.raises(CheckpointError, match=r"runner\.json.*(not valid JSON|not a JSON object)"):
        ckpt.read_json(p)


def test_read_json_accepts_the_non_finite_numbers_write_json_atomic_writes(tmp_path):
    """The format is Python's JSON: write_json_atomic writes inf and NaN (an engine config's grad_clip=inf, say) as
    Infinity and NaN, so read_json reads them back rather than refusing a checkpoint this code wrote."""
    ckpt.write_json_atomic(tmp_path / "s.json", {"a": float("inf"), "b": float("-inf")})
    assert ckpt.read_json(tmp_path / "s.json") == {"a": float("inf"), "b": float("-inf")}


def test_a_manifest_that_is_a_directory_is_named_and_the_previous_checkpoint_is_used(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    newest = _save(root, 2)
    (newest / "manifest.json").unlink()
    (newest / "manifest.json").mkdir()
    with pytest.raises(CheckpointError, match=r"step_000002/manifest\.json.*not a regular file"):
        ckpt.verify(newest)
    assert ckpt.latest_good(root) == root / "step_000001"


@pytest.mark.parametrize("name", ["step_000002/manifest.json", "latest"])
def test_a_fifo_for_manifest_or_latest_is_refused_without_waiting_for_a_writer(tmp_path, name):
    import os
    import threading

    root = tmp_path / "checkpoints"
    _save(root, 1)
    _save(root, 2)
    fifo = root / name
    fifo.unlink()
    os.mkfifo(fifo)
    result: list = []

    def run() -> None:
        try:
            result.append(ckpt.latest_good(root))
        except BaseException as e:  # reported below
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    if t.is_alive():  # blocked opening the FIFO: release it, then fail
        os.close(os.open(fifo, os.O_WRONLY))
        t.join()
        pytest.fail(f"latest_good() blocked opening a FIFO named {name}")
    assert result == [root / ("step_000001" if name != "latest" else "step_000002")]


@pytest.mark.parametrize("path", ["a\u0000b", "\ud800", "a" * 5000, "loop"])
def test_a_manifest_path_the_os_refuses_is_named_and_the_previous_checkpoint_is_used(tmp_path, path):
    """A NUL, a lone surrogate, a name too long, a symlink loop: errors of the OS or of the path code, which
    escaped as ValueError, UnicodeEncodeError, OSError or RuntimeError and stopped the fallback."""
    import os

    root = tmp_path / "checkpoints"
    _save(root, 1)
    newest = _save(root, 2)
    if path == "loop":
        os.symlink("loop2", newest / "loop")
        os.symlink("loop", newest / "loop2")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"].append({"path": path, "bytes": 1, "sha256": "0" * 64})
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"step_000002/manifest\.json"):
        ckpt.verify(newest)
    assert ckpt.latest_good(root) == root / "step_000001"


# a checkpoint directory that is a symlink (moved to another disk and linked back): used like any other; what
# removes it removes the link, never what it points to, and never stops a commit
def _link_elsewhere(root: Path, name: str, store: Path) -> Path:
    """Move ``root/name`` to ``store/name`` and link it back; returns where it now lies."""
    import os
    import shutil

    store.mkdir(exist_ok=True)
    target = Path(shutil.move(root / name, store / name))
    os.symlink(target, root / name)
    return target


def test_a_linked_checkpoint_is_verified_and_resumed_from(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    _link_elsewhere(root, "step_000001", tmp_path / "archive")
    (root / "latest").write_text("step_000001")
    assert ckpt.latest_good(root) == root / "step_000001"


def test_pruning_a_linked_checkpoint_removes_the_link_and_leaves_its_target(tmp_path, caplog):
    """The commit used to die on shutil.rmtree of the link (OSError), and so did every later one."""
    root = tmp_path / "checkpoints"
    _save(root, 1)
    _save(root, 2)
    target = _link_elsewhere(root, "step_000001", tmp_path / "archive")
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        assert _save(root, 3, keep=2) == root / "step_000003"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (target / "runner.json").is_file() and (target / "manifest.json").is_file()  # not ours to delete
    assert any("step_000001" in r.getMessage() and str(target) in r.getMessage() for r in caplog.records)
    _save(root, 4, keep=2)
    assert [p.name for _, p in ckpt.committed(root)] == ["step_000003", "step_000004"]


def test_resaving_a_step_whose_directory_is_a_link_replaces_the_link(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    _save(root, 2)
    target = _link_elsewhere(root, "step_000002", tmp_path / "archive")
    (root / "latest").write_text("step_000001")  # as after resuming from step 1
    again = _save(root, 2)
    assert again.is_dir() and not again.is_symlink() and ckpt.latest_good(root) == again
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]  # no .old- left
    assert (target / "runner.json").is_file()
    _save(root, 3)


def test_overwrite_removes_the_link_of_a_linked_checkpoint_and_leaves_its_target(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    _save(root, 2)
    target = _link_elsewhere(root, "step_000001", tmp_path / "archive")
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    assert not root.exists()
    assert (target / "runner.json").is_file()
