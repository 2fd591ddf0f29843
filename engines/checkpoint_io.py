"""File helpers shared by engine checkpoints (``engines.checkpoint``) and run checkpoints
(``pipelines.checkpoint``): JSON read with errors that name the file, atomic JSON writes, sha256 of a file.

Standard library only, so that ``orchestra train`` can check an output directory and a checkpoint before it
imports torch or starts Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from typing import Any

__all__ = ["CheckpointError", "read_checked", "read_json", "read_regular_file", "sha256_file", "verify_file",
           "write_json_atomic"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, not ours, or not matching the model."""


def _open_regular(p: str) -> tuple[int, int]:
    """``(descriptor, size)`` of the regular file ``p``, opened for reading; :class:`CheckpointError` naming it
    when it is missing, not a regular file (a FIFO is refused without waiting for a writer) or cannot be opened."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO for reading would block until a writer came
    except FileNotFoundError:
        raise CheckpointError(f"{p} is missing; the checkpoint is incomplete or this is not a checkpoint "
                              f"directory") from None
    except (OSError, ValueError) as e:  # no permission, a symlink loop, a name too long; ValueError: a NUL
        raise CheckpointError(f"{p} cannot be opened ({type(e).__name__}: {e}); restore the file or use another "
                              f"checkpoint") from e
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise CheckpointError(f"{p} cannot be read ({type(e).__name__}: {e}); restore the file or use another "
                              f"checkpoint") from e
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{p} is not a regular file; a checkpoint holds only the regular files its writers "
                              f"made: restore the file or use another checkpoint")
    return fd, st.st_size


def _read_fd(fd: int, p: str, limit: int = -1) -> bytes:
    """Up to ``limit`` bytes (-1: all) from ``fd``; an I/O error is a :class:`CheckpointError` naming ``p``."""
    try:
        with open(fd, "rb", closefd=False) as f:
            return f.read(limit)
    except OSError as e:
        raise CheckpointError(f"{p} cannot be read ({type(e).__name__}: {e}); restore the file or use another "
                              f"checkpoint") from e


def read_regular_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a checkpoint's regular file. Missing, not a regular file (a directory; a FIFO is refused without
    waiting for a writer), or unreadable: :class:`CheckpointError` naming it."""
    p = os.fspath(path)
    fd, _ = _open_regular(p)
    try:
        return _read_fd(fd, p)
    finally:
        os.close(fd)


def read_checked(path: str | os.PathLike[str], entry: dict[str, Any], listed_in: str, *, verify: bool) -> bytes:
    """The bytes of ``path``, read once through one descriptor, refused (:class:`CheckpointError` naming it) unless
    it is a regular file of the size ``entry`` records (checked before reading) and, with ``verify``, of its
    sha256. The caller parses exactly the bytes checked, whatever happens to the file afterwards."""
    p = os.fspath(path)
    fd, size = _open_regular(p)
    try:
        _expect_entry(p, size, None, entry, listed_in)
        data = _read_fd(fd, p, size + 1)  # one byte more shows a file that grew since fstat
    finally:
        os.close(fd)
    if len(data) != size:
        raise CheckpointError(f"{p} changed size while it was read ({size} bytes, then {len(data)}): something is "
                              f"writing into the checkpoint; load it when nothing does")
    if verify:
        h = hashlib.sha256()
        h.update(data)
        _expect_entry(p, size, h.hexdigest(), entry, listed_in)
    return data


def _expect_entry(path: str | os.PathLike[str], size: int, digest: str | None, entry: dict[str, Any],
                  listed_in: str) -> None:
    """Raise CheckpointError naming ``path`` unless ``size`` and ``digest`` (None: not checked) are the ones
    ``entry`` records (``{"bytes": ..., "sha256": ...}`` from ``listed_in``, an index or a manifest)."""
    if size != entry.get("bytes"):
        raise CheckpointError(f"{path} has {size} bytes, {listed_in} says {entry.get('bytes')} (size mismatch): the "
                              f"file was truncated or replaced after the checkpoint was written")
    if digest is not None and digest != entry.get("sha256"):
        raise CheckpointError(f"{path} does not match its sha256 in {listed_in}: the file changed after the "
                              f"checkpoint was written")


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a checkpoint's JSON file, which holds an object. Every way it can fail is a :class:`CheckpointError`
    naming the file: missing, not a regular file, unreadable, not UTF-8, not JSON (truncated), a number of more
    digits than ``int()`` converts, nested deeper than the parser recurses, or not an object. NaN and Infinity are
    read: ``json.dump`` (:func:`write_json_atomic`) writes them."""
    p = os.fspath(path)
    data = read_regular_file(p)
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError, int() digit limit
        raise CheckpointError(f"{p} is not valid JSON ({type(e).__name__}: {e}); the file is truncated or corrupt: "
                              f"use another checkpoint or restore the file") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p} holds a JSON {type(obj).__name__}, not a JSON object; the file is corrupt or not "
                              f"one of a checkpoint's: use another checkpoint or restore the file")
    return obj


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, indent: int | None = None) -> None:
    """Write JSON to a temporary file beside ``path``, flush it to disk, then rename it over ``path``."""
    p = os.fspath(path)
    tmp = f"{p}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def sha256_file(path: str | os.PathLike[str], *, sync: bool = False) -> tuple[int, str]:
    """``(size in bytes, sha256 hex digest)`` of a file, read in 1 MiB blocks; ``sync`` also flushes the file to
    disk (a manifest must not vouch for bytes still in the page cache)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            n += len(block)
        if sync:
            os.fsync(f.fileno())
    return n, h.hexdigest()


def verify_file(path: str | os.PathLike[str], entry: dict[str, Any], listed_in: str) -> None:
    """Raise CheckpointError naming ``path`` unless its size and sha256 are the ones ``entry`` records
    (``{"bytes": ..., "sha256": ...}`` from ``listed_in``, an index or a manifest)."""
    try:
        size, digest = sha256_file(path)
    except OSError as e:  # no permission, an I/O error: this checkpoint cannot be used, another may
        raise CheckpointError(f"{path} (listed in {listed_in}) cannot be read ({type(e).__name__}: {e}); restore "
                              f"the file or use another checkpoint") from e
    _expect_entry(path, size, digest, entry, listed_in)
