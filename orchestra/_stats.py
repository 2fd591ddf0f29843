"""Controller-side accounting: how many payload bytes the controller itself materialized."""

from __future__ import annotations

import threading

__all__ = ["controller_stats", "reset_controller_stats", "add_materialized"]

_lock = threading.Lock()
_counts = {"bytes_materialized": 0, "bytes_put": 0, "calls": 0}


def add_materialized(nbytes: int) -> None:
    with _lock:
        _counts["bytes_materialized"] += int(nbytes)


def add_put(nbytes: int) -> None:
    with _lock:
        _counts["bytes_put"] += int(nbytes)


def add_call() -> None:
    with _lock:  # a call made from another thread's event loop, or a reset meanwhile, loses no count
        _counts["calls"] += 1


def controller_stats() -> dict[str, int]:
    """Counters of this controller process: ``bytes_materialized`` (payload bytes fetched by ``await``),
    ``bytes_put`` (bytes of Batches the controller put into the object store) and ``calls``."""
    with _lock:
        return dict(_counts)


def reset_controller_stats() -> None:
    """Zero the controller counters (e.g. between benchmark phases)."""
    with _lock:
        for k in _counts:
            _counts[k] = 0
