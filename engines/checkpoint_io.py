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
from typing import Any

__all__ = ["CheckpointError", "read_json", "sha256_file", "write_json_atomic"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, not ours, or not matching the model."""


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON file; a missing, unreadable or truncated file raises :class:`CheckpointError` naming it."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{p} is missing; the checkpoint is incomplete or this is not a checkpoint "
                              f"directory") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p} is not valid JSON ({e}); the file is truncated or corrupt: use another "
                              f"checkpoint or restore the file") from e


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
    size, digest = sha256_file(path)
    if size != entry.get("bytes"):
        raise CheckpointError(f"{path} has {size} bytes, {listed_in} says {entry.get('bytes')} (size mismatch): the "
                              f"file was truncated or replaced after the checkpoint was written")
    if digest != entry.get("sha256"):
        raise CheckpointError(f"{path} does not match its sha256 in {listed_in}: the file changed after the "
                              f"checkpoint was written")
