"""Shared helpers for the benchmarks: timing, a local cluster, JSON output."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def timed(fn: Callable[[], Awaitable[Any]], iters: int, warmup: int = 5) -> dict[str, float]:
    """Median / mean / p90 wall time of ``await fn()`` in milliseconds."""
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {"median_ms": round(statistics.median(samples), 4), "mean_ms": round(statistics.fmean(samples), 4),
            "p90_ms": round(samples[int(0.9 * (len(samples) - 1))], 4), "iters": iters}


def rss_mib() -> float:
    """This process's current resident set size in MiB (from /proc; falls back to the peak)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's JSON to stdout (one document)."""
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()
