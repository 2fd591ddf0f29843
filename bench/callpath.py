"""The controller's own work per call: Python calls and event-loop thread CPU, against raw Ray on the same actors.

    python -m bench.callpath [--ranks 4] [--iters 300] [--rounds 6]

Wall time and even CPU time per call move 10-30 % between runs on these shared cores (and by more on a busy
machine), which hides changes to the call path of a few percent. This bench also counts what does not move: the
Python function calls (cProfile events, C functions included) the controller's thread makes per call. The count is
the same in every run of the same code, so it shows a change to the call path's work at once, while the wall and CPU
columns say what it is worth here.

Cases, on one group of ``--ranks`` ranks (``cpus_per_worker=0.01``):

- ``raw_noop`` / ``raw_shard``: a synchronous ``ray.get`` of N bare actor calls (``Host.noop``; the shard case
  passes each rank its 4-row piece of the batch): what a blocking controller such as verl's does;
- ``general_noop`` / ``general_shard``: ``await g.noop()`` (broadcast) and ``await g.noop_shard(batch)`` (4 rows per
  rank, collected into a list) as Ray actor tasks, the path of every call with a DataFuture argument;
- ``fast_noop`` / ``fast_shard``: the same calls over the fast path's channel (the default for a repeated call).

The cases run interleaved in ``--rounds`` rounds of ``iters / rounds`` calls. Prints JSON: per case the median wall
ms, the event-loop thread's CPU ms per call (``time.thread_time``: the controller's own thread, not Ray's nor the
reply lanes'), the controller process's CPU ms per call (every thread), and Python calls per call; and each
orchestra case's ratios to the raw case of its shape.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup

from ._common import emit
from .scaling import Scaled  # the same no-op and shard endpoints (workers import it: orc.init passes sys.path on)


async def _once(fn: Callable[[], Any], is_raw: bool) -> None:
    r = fn()
    if not is_raw:
        await r


async def measure(n: int, iters: int, rounds: int) -> dict[str, dict[str, float]]:
    async with WorkerGroup(ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01), Scaled,
                           group_name=f"callpath{n}") as g:
        actors = g.actors  # raw handles: the fast path is off except while the fast cases run (set below)
        batch = Batch.from_dict({"x": torch.arange(4 * n)})
        shards = batch.chunk(n)
        cases: dict[str, Callable[[], Any]] = {
            "raw_noop": lambda: ray.get([a.noop.remote() for a in actors]),
            "raw_shard": lambda: ray.get([a.noop.remote(s) for a, s in zip(actors, shards)]),
            "general_noop": g.noop, "general_shard": lambda: g.noop_shard(batch),
            "fast_noop": g.noop, "fast_shard": lambda: g.noop_shard(batch)}
        assert await g.noop_shard(batch) == [4] * n
        wall: dict[str, list[float]] = {k: [] for k in cases}
        main_cpu: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        calls: dict[str, float] = {}
        fast_before = g._shared.fast_calls
        per_round = max(1, iters // rounds)
        for r in range(rounds + 1):  # round 0 warms every case up (and opens the channel for the fast ones)
            for k, fn in cases.items():
                raw = k.startswith("raw")
                g.fast_path = k.startswith("fast")  # off: a raw call on a rank's compute lane never waits behind it
                for _ in range(6):
                    await _once(fn, raw)
                p0 = time.process_time()
                for _ in range(per_round if r else 0):
                    w0, c0 = time.perf_counter(), time.thread_time()
                    await _once(fn, raw)
                    main_cpu[k].append((time.thread_time() - c0) * 1e3)
                    wall[k].append((time.perf_counter() - w0) * 1e3)
                if r:
                    cpu[k].append((time.process_time() - p0) / per_round * 1e3)
        for k, fn in cases.items():  # counted apart: the profiler's own cost stays out of the timings above
            raw = k.startswith("raw")
            g.fast_path = k.startswith("fast")
            for _ in range(6):
                await _once(fn, raw)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                await _once(fn, raw)
            prof.disable()
            calls[k] = pstats.Stats(prof).total_calls / 100
        g.fast_path = False
        assert g._shared.fast_calls - fast_before >= 2 * (per_round * rounds + 106), "the fast cases missed the channel"
    out = {k: {"wall_ms": round(statistics.median(wall[k]), 3),
               "main_thread_cpu_ms": round(statistics.fmean(main_cpu[k]), 3),
               "process_cpu_ms": round(statistics.fmean(cpu[k]), 3),
               "python_calls": round(calls[k], 1)} for k in cases}
    for k in ("general_noop", "general_shard", "fast_noop", "fast_shard"):
        base = out["raw_" + k.split("_")[1]]
        out[k]["vs_raw"] = {m: round(out[k][m] / base[m], 3) for m in ("wall_ms", "main_thread_cpu_ms",
                                                                       "process_cpu_ms", "python_calls")}
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    orc.init(num_cpus=64)
    try:
        results = await measure(a.ranks, a.iters, a.rounds)
    finally:
        orc.shutdown()
    emit({"bench": "callpath", "ranks": a.ranks, "iters": a.iters,
          "baseline": "sync ray.get of N bare actor calls (Host.noop) on the same actors", "results": results})


if __name__ == "__main__":
    orc.run(main())
