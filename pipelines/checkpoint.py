"""Run checkpoints on disk: atomic, verified, pruned, and never in the way of a user's earlier run.

Layout under ``<output_dir>/checkpoints``::

    step_000049/             a committed checkpoint (what the workers wrote + runner.json + manifest.json)
    step_000099/
    latest                   "step_000099": the newest committed checkpoint
    step_000149.tmp-1f2e3d4c one being written (or left by a crash: never used, removed by the next commit)

A checkpoint is written into a ``step_XXXXXX.tmp-<random>`` directory; when every file is there,
``manifest.json`` (relative path, size and sha256 of every other file) is written last, the directory is renamed
into place and ``latest`` is replaced atomically (temporary file + rename). A crash at any point leaves
``latest`` naming the previous complete checkpoint. A checkpoint is committed only with every engine role's weights
in it (``roles``: the index and every shard it lists), so a worker that wrote elsewhere fails the save instead of
committing a checkpoint without weights. Before anything is loaded the manifest is checked; a
checkpoint that fails (missing or changed file, truncated JSON) is reported with a warning naming the file and
the previous good one is used. Only directories named like ours are ever pruned or removed.

A resume from a checkpoint older than other committed ones (the newer ones failed their check, or ``latest`` lagged
behind a commit that crashed before updating it) abandons those newer ones: they are renamed to
``abandoned-step_XXXXXX-<hex>`` (never deleted; a warning names each), so that neither ``keep_checkpoints`` nor a
later fallback counts or uses a checkpoint the resumed run did not write (:func:`latest_good`, :func:`commit`).

A run holds its output_dir (:func:`lock_output_dir`: a ``flock`` on ``<output_dir>/.orchestra.lock``) from before
it checks anything there to the end of its cleanup, so a second run into the same directory fails at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.checkpoint_io import (CheckpointError, read_json, read_regular_file, sha256_file, verify_file,
                                   write_json_atomic)

__all__ = ["LATEST", "LOCK", "MANIFEST", "CheckpointError", "abort", "commit", "committed", "latest_good",
           "lock_output_dir", "newest_committed", "prepare_output_dir", "prune", "read_json", "resolve_output_dir",
           "stage", "verify", "write_json_atomic", "write_manifest"]

MANIFEST = "manifest.json"
LATEST = "latest"
MANIFEST_FORMAT = "orchestra.checkpoint-manifest/1"
_STEP = re.compile(r"^step_(\d{6,})$")
_STAGED = re.compile(r"^(step_\d{6,})\.(tmp|old)-[0-9a-f]{8}$")
_LATEST_TMP = re.compile(r"^latest\.tmp-[0-9a-f]{8}$")
# a committed checkpoint past the one a run resumed from, set aside (_set_aside): not a step_* name, so never counted
# by prune nor resumed from by latest_good; removed only by --overwrite
_ABANDONED = re.compile(r"^abandoned-step_\d{6,}-[0-9a-f]{8}$")
ENGINE_INDEX = "index.json"  # what an engine role's save writes last (engines.checkpoint): it lists the shard files
ENGINE_STATE = "engine_state.json"
LOCK = ".orchestra.lock"  # in runner.output_dir: flock'ed by the run that writes there (lock_output_dir)
# what a run of the runner writes into runner.output_dir besides checkpoints/ (--overwrite removes exactly these)
METRICS = "metrics.jsonl"
CONFIG = "config.json"
TENSORBOARD = "tensorboard"
_OUTPUT_FILES = ("reward.png", "trace.json")
_TRACE_BEFORE_RESTART = re.compile(r"^trace\.before-restart-\d+\.json$")
_TB_EVENTS = re.compile(r"^events\.out\.tfevents\.")

log = logging.getLogger("orchestra")


# ------------------------------------------------------------------------------------------------------------ manifest
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_output_dir(path: str | os.PathLike[str]) -> Path:
    """``runner.output_dir`` as the absolute path every process must write to: ``~`` expanded, a relative path taken
    from this (the driver's) working directory. Workers on Ray run in a copy of it, so they get only absolute paths."""
    return Path(os.path.expanduser(os.fspath(path))).absolute()


def _role_files(directory: Path, role: str) -> list[str]:
    """The files engine role ``role`` (a directory relative to the checkpoint, e.g. ``actor/actor``) must hold: its
    index, its engine state and every file the index lists, as paths relative to ``directory``. A role whose index
    is missing or lists no files is a :class:`CheckpointError`."""
    where = directory / role / ENGINE_INDEX
    if not where.is_file():
        raise CheckpointError(f"checkpoint {directory.name}: role {role!r} wrote no weights: {where} is missing, so "
                              f"its workers wrote their shards somewhere else (a path resolved in another working "
                              f"directory?); nothing was committed")
    index = read_json(where)
    listed = index.get("files") if isinstance(index, dict) else None
    if not isinstance(listed, dict) or not listed or not all(isinstance(n, str) and n for n in listed):
        raise CheckpointError(f"checkpoint {directory.name}: {where} lists no shard files; role {role!r} saved no "
                              f"weights, nothing was committed")
    return [f"{role}/{ENGINE_INDEX}", f"{role}/{ENGINE_STATE}", *(f"{role}/{name}" for name in sorted(listed))]


def _check_roles(directory: Path, roles: list[str], present: set[str], what: str) -> None:
    """Every file of every role in ``roles`` is in ``present`` (paths relative to ``directory``)."""
    for role in roles:
        missing = [rel for rel in _role_files(directory, role) if rel not in present]
        if missing:
            raise CheckpointError(f"checkpoint {directory.name}: role {role!r} is incomplete: {_short(missing)} "
                                  f"{'is' if len(missing) == 1 else 'are'} not {what}")


def write_manifest(directory: Path, roles: Sequence[str] = ()) -> dict[str, Any]:
    """Hash every file under ``directory`` (flushing each to disk) and write ``manifest.json``; returns it.
    ``roles``: engine checkpoint directories (relative, e.g. ``actor/actor``) that must each hold their index and
    every shard it lists, else :class:`CheckpointError` and no manifest; they are recorded in the manifest."""
    directory = Path(directory)
    roles = [str(r) for r in roles]
    files = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            p = Path(root) / name
            rel = p.relative_to(directory).as_posix()
            if rel == MANIFEST:
                continue
            if p.is_symlink() or not p.is_file():
                raise CheckpointError(f"{p} is not a regular file; a checkpoint holds only the files its writers made")
            size, digest = sha256_file(p, sync=True)
            files.append({"path": rel, "bytes": size, "sha256": digest})
        _fsync_dir(Path(root))
    _check_roles(directory, roles, {f["path"] for f in files}, "in the checkpoint")
    manifest = {"format": MANIFEST_FORMAT, "files": files, "roles": roles}
    write_json_atomic(directory / MANIFEST, manifest, indent=1)
    return manifest


def _short(v: Any, n: int = 120) -> str:
    """``repr(v)``, cut to about ``n`` characters (a manifest can list a path of any length)."""
    r = repr(v)
    return r if len(r) <= n else f"{r[:n]}... ({len(r)} characters)"


def verify(directory: Path) -> dict[str, Any]:
    """Check ``directory`` against its manifest: every listed file present, same size, same sha256, and every
    engine role it records (``roles``) with its index and each shard that index lists among them.

    Raises :class:`CheckpointError` naming the first file that is missing, changed or truncated (or the
    manifest itself when it is missing or not valid JSON). Returns the manifest.
    """
    directory = Path(directory)
    mpath = directory / MANIFEST
    manifest = read_json(mpath)
    if not (isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT
            and isinstance(manifest.get("files"), list)):
        raise CheckpointError(f"{mpath} is not an orchestra checkpoint manifest")
    root = directory.resolve()
    for entry in manifest["files"]:
        rel = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in Path(rel).parts:
            raise CheckpointError(f"{mpath} lists {_short(rel)}, which is not a path inside the checkpoint")
        p = directory / rel
        try:
            inside, regular = p.resolve().is_relative_to(root), p.is_file()
        except (OSError, ValueError, RuntimeError) as e:  # too long, a NUL, not encodable, a symlink loop
            raise CheckpointError(f"{mpath} lists {_short(rel)}, which cannot be looked up ({type(e).__name__}: "
                                  f"{_short(str(e))}); the manifest is corrupt: use another checkpoint") from e
        if not inside:
            raise CheckpointError(f"{mpath} lists {_short(rel)}, which leads outside the checkpoint")
        if not regular:
            raise CheckpointError(f"{p} is missing (listed in {mpath}); the checkpoint is incomplete")
        verify_file(p, entry, "the manifest")
    roles = manifest.get("roles", [])  # absent in manifests written before roles were recorded
    if not isinstance(roles, list) or not all(isinstance(r, str) and r and not r.startswith("/")
                                                   and ".." not in Path(r).parts for r in roles):
        raise CheckpointError(f"{mpath}: 'roles' is {_short(roles)}, not a list of role directories")
    _check_roles(directory, roles, {e["path"] for e in manifest["files"]}, f"listed in {mpath}")
    return manifest


# ------------------------------------------------------------------------------------------------------------ writing
def stage(root: Path, step: int) -> Path:
    """A fresh ``step_XXXXXX.tmp-<random>`` directory under ``root`` to write checkpoint ``step`` into."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    d = root / f"step_{step:06d}.tmp-{secrets.token_hex(4)}"
    d.mkdir()
    return d


def abort(staged: Path) -> None:
    """Remove a staged directory after its writers failed (the error being handled is the one that matters)."""
    if _STAGED.match(Path(staged).name) is None:
        raise ValueError(f"{staged} is not a staged checkpoint directory")
    try:
        shutil.rmtree(staged)
    except OSError as e:
        log.warning("could not remove the unfinished checkpoint %s (%s); the next checkpoint removes it", staged, e)


def _remove(p: Path) -> None:
    """Remove a checkpoint directory of ours. One that is a symlink (a checkpoint moved elsewhere and linked back)
    loses the link only: what it points to is not in the run's directory, and is left as it is."""
    if p.is_symlink():
        target = os.readlink(p)
        p.unlink()
        log.warning("removed %s, a link to %s; what it points to is left in place", p, target)
    else:
        shutil.rmtree(p)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def commit(staged: Path, *, keep: int, roles: Sequence[str] = ()) -> Path:
    """Finish a staged checkpoint: manifest, rename into place, point ``latest`` at it, prune to the newest
    ``keep`` (0 keeps all) and remove unfinished ones left by crashes. Returns the committed directory.
    ``roles``: the engine checkpoint directories that must be complete (see :func:`write_manifest`); if one is not,
    :class:`CheckpointError` and nothing is committed. Committed checkpoints of later steps are set aside first
    (:func:`_set_aside`: this run resumed before them and does not continue them); a failure to is a
    :class:`CheckpointError` too, before anything is committed."""
    staged = Path(staged)
    m = _STAGED.match(staged.name)
    if m is None or m.group(2) != "tmp":
        raise ValueError(f"{staged} is not a staged checkpoint directory (made by stage())")
    root = staged.parent
    final = root / m.group(1)
    write_manifest(staged, roles)
    step = _step(final)
    # a run that commits `step` is not on the path of a committed checkpoint past it (its resume abandoned that one;
    # latest_good sets such ones aside already, this catches a resume from a checkpoint chosen otherwise)
    later = [p for s, p in committed(root) if s > step]
    if later:
        _set_aside(root, later, f"committing {final.name} abandons the later {_plural(later)} "
                                f"{', '.join(p.name for p in later)} (this run resumed from an earlier checkpoint)")
    aside = None
    if final.exists():  # left by an earlier run past the step we resumed from: replaced, never mixed
        aside = root / f"{final.name}.old-{secrets.token_hex(4)}"
        os.replace(final, aside)
    os.replace(staged, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    if aside is not None:
        _remove(aside)
    for p in sorted(root.iterdir()):
        if p.is_dir() and _STAGED.match(p.name) or p.is_file() and _LATEST_TMP.match(p.name):
            log.warning("removing %s: an unfinished checkpoint left by an interrupted run", p)
            if p.is_dir():
                _remove(p)
            else:
                p.unlink()
    prune(root, keep, protect=final)
    return final


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under ``root`` as ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def _step(directory: Path) -> int:
    """The step of a committed checkpoint directory (named ``step_<digits>``)."""
    m = _STEP.match(directory.name)
    if m is None:
        raise ValueError(f"{directory} is not a committed checkpoint directory")
    return int(m.group(1))


def _plural(dirs: Sequence[Path]) -> str:
    """``checkpoint`` or ``checkpoints``, for a message naming ``dirs``."""
    return "checkpoint" if len(dirs) == 1 else "checkpoints"


def _set_aside(root: Path, dirs: Sequence[Path], why: str) -> list[Path]:
    """Rename committed checkpoints the run has abandoned to ``abandoned-<name>-<random>`` under ``root``: not named
    ``step_*``, so :func:`prune` never spends a ``keep`` slot on them and :func:`latest_good` never falls back (or
    forward) to them; nothing is deleted, and a warning names each (``why``: what abandoned them). A rename that fails
    is a :class:`CheckpointError` naming the directory (those renamed before it stay renamed, and are named)."""
    moved: list[tuple[Path, Path]] = []
    try:
        for p in dirs:
            aside = root / f"abandoned-{p.name}-{secrets.token_hex(4)}"
            try:
                os.replace(p, aside)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint {p.name} cannot be set aside: renaming it to {aside.name} failed ({e}); {why}, so it "
                    f"is not on this run's path and must not count as one of its checkpoints: move {p} out of {root} "
                    f"yourself (or make {root} writable) and retry") from e
            moved.append((p, aside))
    finally:
        if moved:
            _fsync_dir(root)
            it = "it" if len(moved) == 1 else "them"
            log.warning("%s: set aside %s, not deleted: runner.keep_checkpoints and --resume no longer count or "
                        "use %s (inspect or delete %s yourself; --overwrite removes %s)", why,
                        ", ".join(f"{p.name} as {a.name}" for p, a in moved), it, it, it)
    return [a for _, a in moved]


def prune(root: Path, keep: int, *, protect: Path | None = None) -> list[Path]:
    """Remove all but the newest ``keep`` committed checkpoints (0 keeps all); ``protect`` is never removed.
    Touches nothing that is not named ``step_<digits>``; of one that is a symlink, only the link. Returns what was
    removed."""
    if keep <= 0:
        return []
    dirs = [p for _, p in committed(root)]
    doomed = [p for p in dirs[:-keep] if protect is None or p.resolve() != Path(protect).resolve()]
    for p in doomed:
        _remove(p)
    return doomed


# ------------------------------------------------------------------------------------------------------------ reading
def _latest_pointer(root: Path) -> Path | None:
    pointer = root / LATEST
    if not pointer.exists():
        return None
    try:
        name = read_regular_file(pointer).decode("utf-8").strip()
    except (CheckpointError, UnicodeDecodeError) as e:
        log.warning("%s cannot be read (%s); looking for the newest good checkpoint instead", pointer, e)
        return None
    if _STEP.match(name) is None or not (root / name).is_dir():
        log.warning("%s names %r, which is not a checkpoint under %s; looking for the newest good checkpoint "
                    "instead", pointer, name, root)
        return None
    return root / name


def latest_good(root: Path) -> Path:
    """The checkpoint to resume from: the one ``latest`` names if its manifest checks out, else the newest
    committed one that does (with a warning naming what was wrong). Raises :class:`CheckpointError` when there
    is none, or none is good.

    The run resumed from it does not continue the committed checkpoints past it (ones that failed their check, or
    one whose commit crashed before ``latest`` named it): they are set aside (:func:`_set_aside`, logged) and
    ``latest`` names the chosen one, so that ``keep_checkpoints`` keeps the resumed run's own checkpoints and a later
    fallback never jumps forward to a step this run did not train. So call it holding the output_dir
    (:func:`lock_output_dir`), as the runner does."""
    root = Path(root)
    first = _latest_pointer(root)
    candidates = [first] if first is not None else []
    candidates += [p for _, p in reversed(committed(root)) if p != first]
    if not candidates:
        raise CheckpointError(f"--resume: no checkpoint under {root}; run without --resume to start, and set "
                              f"runner.checkpoint_every to write checkpoints")
    problems = []
    failed: set[Path] = set()
    for d in candidates:
        try:
            verify(d)
        except CheckpointError as e:
            log.warning("checkpoint %s cannot be used: %s", d.name, e)
            problems.append(f"{d.name}: {e}")
            failed.add(d)
            continue
        if problems:
            log.warning("resuming from %s, the newest checkpoint that checks out", d)
        _abandon_past(root, d, failed)
        return d
    raise CheckpointError(f"--resume: no usable checkpoint under {root}:\n  " + "\n  ".join(problems)
                          + "\nrestore the files from a copy, or start over with --overwrite")


def _abandon_past(root: Path, chosen: Path, failed: set[Path]) -> None:
    """Set aside the committed checkpoints past ``chosen``, the one a run resumes from (``failed``: those that did
    not check out), and point ``latest`` at ``chosen`` when anything was set aside."""
    step = _step(chosen)
    newer = [p for s, p in committed(root) if s > step]
    if not newer:
        return
    reasons = [f"{p.name} ({'failed its check' if p in failed else 'its commit stopped before latest named it'})"
               for p in newer]
    _set_aside(root, newer, f"resuming from {chosen.name} abandons the later {_plural(newer)} {', '.join(reasons)}")
    _write_latest(root, chosen.name)


def newest_committed(root: Path) -> Path | None:
    """The checkpoint ``--resume`` tries first: the one ``latest`` names, else the newest committed one; None when
    there is none. Not verified (that reads every file: :func:`latest_good` does it when the resume starts)."""
    root = Path(root)
    first = _latest_pointer(root)
    if first is not None:
        return first
    steps = committed(root)
    return steps[-1][1] if steps else None


def _check_output_dir(out: Path) -> None:
    """``out`` is a directory, or can be made one: :class:`~pipelines.config.ConfigError` naming
    ``runner.output_dir`` when it is a file, lies under a file, or its nearest existing parent is not writable."""
    from .config import ConfigError

    fix = "choose another runner.output_dir"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"runner.output_dir: {out} is a file, not a directory; {fix} (or move the file)",
                          "runner.output_dir")
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"runner.output_dir: {out} cannot be made: {parent} is a file, not a directory; {fix}",
                          "runner.output_dir")
    if not os.access(parent, os.W_OK | os.X_OK):
        what = "" if parent == out else f"cannot be made: {parent} "
        raise ConfigError(f"runner.output_dir: {out} {what}is not writable by this user; {fix}", "runner.output_dir")


def _earlier_outputs(out: Path) -> list[Path]:
    """The files an earlier run of the runner left in ``out`` besides its checkpoints: a non-empty ``metrics.jsonl``,
    TensorBoard event files in ``tensorboard/``, ``reward.png``, ``trace.json`` and ``trace.before-restart-N.json``.
    ``config.json`` is not one: every run rewrites it before anything else. A ``tensorboard`` that is a symlink is
    not looked into: the directory it names is the user's (perhaps shared by runs), not this run's."""
    if not out.is_dir():
        return []
    found = []
    metrics = out / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics)
    tb = out / TENSORBOARD
    if tb.is_dir() and not tb.is_symlink():  # a link to a directory of one's own (shared by runs) is not ours to clear
        found += sorted(p for p in tb.iterdir() if p.is_file() and _TB_EVENTS.match(p.name))
    found += [out / name for name in _OUTPUT_FILES if (out / name).is_file()]
    found += sorted(p for p in out.iterdir() if p.is_file() and _TRACE_BEFORE_RESTART.match(p.name))
    return found


def _listing(out: Path, paths: Sequence[Path | str], n: int = 4) -> str:
    """``a, b and c`` of ``paths`` relative to ``out``, the first ``n`` named and the rest counted."""
    names = [p if isinstance(p, str) else p.relative_to(out).as_posix() for p in paths]
    if len(names) > n:
        names = [*names[:n], f"{len(names) - n} more"]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def prepare_output_dir(out: Path, *, resume: bool, overwrite: bool) -> Path | None:
    """Check ``out`` before anything starts; returns the checkpoint to resume from (None for a fresh run). Call it
    holding ``out`` (:func:`lock_output_dir`): another run must not write there between the check and the run.

    - ``out`` must be a directory or one that can be made (``ConfigError`` naming ``runner.output_dir`` otherwise).
    - ``resume``: the newest good checkpoint (:func:`latest_good`), or :class:`CheckpointError`.
    - a fresh run into a directory that holds checkpoints or other outputs of an earlier run (a non-empty
      ``metrics.jsonl``, TensorBoard events, ``reward.png``, trace files): :class:`CheckpointError` unless
      ``overwrite``, which removes exactly what the runner writes (our checkpoints: ``step_*``, ``latest``,
      unfinished ones, ``abandoned-step_*`` ones a resume set aside; ``metrics.jsonl``, ``config.json``,
      ``reward.png``, ``trace.json``, ``trace.before-restart-N.json``, the event files in ``tensorboard/``), nothing
      else, and never the lock file.
    """
    out = Path(out)
    _check_output_dir(out)
    root = out / "checkpoints"
    if resume and overwrite:
        raise CheckpointError("--resume continues the run in runner.output_dir and --overwrite replaces it: pass one")
    if resume:
        return latest_good(root)
    steps = committed(root)
    earlier = _earlier_outputs(out)
    if not overwrite:
        if steps or (root / LATEST).exists():
            newest = steps[-1][1].name if steps else (root / LATEST)
            raise CheckpointError(f"{out} holds checkpoints of an earlier run (newest: {newest}); pass --resume to "
                                  f"continue it, --overwrite to replace it, or choose another runner.output_dir")
        if earlier:
            raise CheckpointError(f"{out} holds the {_listing(out, earlier)} of an earlier run (and no checkpoint to "
                                  f"resume from); pass --overwrite to replace it, or choose another runner.output_dir")
        return None
    removed: list[str] = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.is_dir() and (_STEP.match(p.name) or _STAGED.match(p.name) or _ABANDONED.match(p.name)):
                _remove(p)
            elif p.is_file() and (p.name == LATEST or _LATEST_TMP.match(p.name)):
                p.unlink()
            else:
                continue
            if not removed:
                removed.append("checkpoints")
        if not any(root.iterdir()):
            root.rmdir()
    for p in dict.fromkeys([*earlier, out / METRICS, out / CONFIG]):
        if p.is_file():
            p.unlink()
            removed.append(p.relative_to(out).as_posix())
    tb = out / TENSORBOARD
    if tb.is_dir() and not tb.is_symlink() and not any(tb.iterdir()):
        tb.rmdir()
    if removed:
        log.warning("--overwrite: removed the %s of the earlier run in %s (nothing else)", _listing(out, removed, 8),
                    out)
    return None


# ------------------------------------------------------------------------------------------------------- the run's lock
@dataclass
class _Hold:
    """This process's hold on one output_dir: the open lock file (flock'ed), how many blocks hold it, and whether a
    run (``lock_output_dir(run=True)``) is one of them."""

    fd: int
    lock: Path
    holds: int = 0
    running: bool = False


_holds: dict[tuple[int, int], _Hold] = {}  # (st_dev, st_ino) of an output_dir -> this process's hold on it
_holds_guard = threading.Lock()


def _holder(lock: Path) -> str:
    """Who holds ``lock``, as its holder recorded it when it took it: for the refusal message."""
    try:
        text = lock.read_text()
        rec = json.loads(text) if text.strip() else None
    except (OSError, ValueError) as e:
        return f"its record in {lock} cannot be read: {type(e).__name__}: {e}"
    if not isinstance(rec, dict):
        return f"a process that has not recorded itself in {lock} yet"
    return f"pid {rec.get('pid')} on host {rec.get('host')}, since {rec.get('started')}"


def _acquire(out: Path, lock: Path) -> int:
    """Open ``lock`` and take its exclusive flock without waiting; record this process in it. Returns the fd."""
    fix = "or choose another runner.output_dir"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise CheckpointError(f"runner.output_dir {out}: cannot open its lock file {lock} ({e}); remove what is there "
                              f"if it is not a file, {fix}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"runner.output_dir {out} is in use by another run ({_holder(lock)}): two runs "
                                  f"in one directory mix their metrics.jsonl and checkpoints; wait for it to finish, "
                                  f"{fix}") from None
        except OSError as e:  # ENOLCK: a file system without locks
            raise CheckpointError(f"runner.output_dir {out}: cannot lock {lock} ({e}), so another run could write "
                                  f"there at the same time; {fix} on a local or lock-capable file system") from e
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _release(hold: _Hold) -> None:
    """Clear the holder's record (it names live holders only), then close the file, which drops the flock."""
    try:
        os.ftruncate(hold.fd, 0)
    except OSError as e:  # the record is advice; the lock itself goes with the close below
        log.warning("could not clear %s (%s); the next run overwrites it", hold.lock, e)
    finally:
        os.close(hold.fd)


@contextlib.contextmanager
def lock_output_dir(out: Path, *, run: bool = False, resume: bool = False) -> Iterator[Path]:
    """Hold ``out`` (made if missing, unless ``resume``) until the block ends: an exclusive, non-blocking ``flock``
    on ``out/.orchestra.lock``, which the kernel drops when the process ends, however it ends. Held by another
    process: :class:`CheckpointError` naming the holder (pid, host). Within this process holds nest (the CLI holds
    ``out`` from before its checks and hands it to its Runner), but only one ``run=True`` block (a run) at a time.
    ``resume``: a missing ``out`` is a :class:`CheckpointError` (a mistyped path is not made, holding only a lock)."""
    out = Path(out)
    _check_output_dir(out)
    if resume and not out.is_dir():
        raise CheckpointError(f"--resume: runner.output_dir {out} does not exist, so there is no run to continue; "
                              f"check the path, or run without --resume to start a new run there")
    out.mkdir(parents=True, exist_ok=True)
    st = out.stat()
    key = (st.st_dev, st.st_ino)
    with _holds_guard:
        hold = _holds.get(key)
        if hold is None:
            hold = _Hold(_acquire(out, out / LOCK), out / LOCK)
            _holds[key] = hold
        elif run and hold.running:
            raise CheckpointError(f"runner.output_dir {out} is in use by another run in this process (pid "
                                  f"{os.getpid()}): two runs in one directory mix their metrics.jsonl and "
                                  f"checkpoints; wait for it to finish, or choose another runner.output_dir")
        hold.holds += 1
        hold.running = hold.running or run
    try:
        yield out
    finally:
        with _holds_guard:
            hold.holds -= 1
            if run:
                hold.running = False
            if hold.holds == 0:
                del _holds[key]
                _release(hold)
