"""Control-plane scaling: a broadcast no-op and a small shard call at 4, 8, 16, 32 ranks vs raw Ray, same actors.

    python -m bench.scaling [--ranks 4,8,16,32] [--iters 60]

Raw baseline (what verl's blocking controller does, ~1.05x of it here): a synchronous ``ray.get`` of N bare actor
calls (``Host.noop``, the same actors), with the same per-rank payload for the shard case (each rank's 4-row
shard passed by value). Orchestra: ``await g.noop()`` (broadcast) and ``await g.noop_shard(batch)`` with 4 rows per
rank (shard; the result is collected into one list), each also with per-ref reply completion (``*_per_ref``: one
event-loop wake-up per rank, as before batched completion) in the same run. Those are the general path (one Ray actor
task per rank): what every call with a DataFuture argument takes, and a repeated call until the fast path opens.
``*_fast``: the same repeated calls as a user gets them by default, over the fast path's channel (``_channel``),
on the same actors (the group's fast path is switched on for those samples only: raw calls on a rank's compute
lane would otherwise wait behind its channel loop). Workers reserve ``cpus_per_worker=0.01`` on
``orc.init(num_cpus=64)``.

Prints JSON: per size, medians and ratios, and the controller's CPU ms per call (``*_cpu_ms``: process time of
the driver, all threads; steadier than wall time on shared cores); and the per-rank marginal cost of each (least-squares slope of median
vs ranks) with its ratio to raw. Target (issue "core speed"): every ratio <= 1.15 and the shard call's marginal
cost <= 1.2x raw (``meets_target``: the default path, i.e. the fast path for these repeated calls;
``meets_target_general``: the general path).
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import _replies
from orchestra import dispatch as D

from ._common import emit


class Scaled(Worker):
    @endpoint(D.broadcast())
    def noop(self) -> None:
        return None

    @endpoint(D.shard())
    def noop_shard(self, batch: Batch) -> int:
        return len(batch)


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


async def _median_ms(fn, iters: int, is_async: bool, cpu: list[float] | None = None) -> float:
    """Median wall ms per call; appends the controller process's CPU ms per call (all its threads) to ``cpu``."""
    samples = []
    c0 = time.process_time()
    for _ in range(iters):
        t0 = time.perf_counter()
        if is_async:
            await fn()
        else:
            fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / iters * 1e3)
    return statistics.median(samples)


async def measure(n: int, iters: int) -> dict:
    async with WorkerGroup(ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01), Scaled,
                           group_name=f"scale{n}") as g:
        shared = g._shared
        actors = g.actors  # raw handles: the fast path is off, except while the *_fast samples run (below)
        batch = Batch.from_dict({"x": torch.arange(4 * n)})
        shards = batch.chunk(n)

        def raw_noop() -> None:
            ray.get([a.noop.remote() for a in actors])

        def raw_shard() -> None:
            ray.get([a.noop.remote(s) for a, s in zip(actors, shards)])

        async def ours_noop() -> None:
            await g.noop()

        async def ours_shard() -> None:
            await g.noop_shard(batch)

        def fast_path(on: bool) -> None:
            g.fast_path = on  # off: the ranks' loops return before any raw call reaches their lanes

        async def noop_fast() -> None:
            await g.noop()

        async def shard_fast() -> None:
            await g.noop_shard(batch)

        async def unbatched(fn) -> None:  # the same call with per-ref reply completion (the 0.1 path)
            least, _replies.MIN_BATCH = _replies.MIN_BATCH, n + 1
            try:
                await fn()
            finally:
                _replies.MIN_BATCH = least

        async def noop_per_ref() -> None:
            await unbatched(ours_noop)

        async def shard_per_ref() -> None:
            await unbatched(ours_shard)

        assert await g.noop_shard(batch) == [4] * n
        for fn, is_async in ((raw_noop, False), (ours_noop, True), (raw_shard, False), (ours_shard, True)):
            await _median_ms(fn, 5, is_async)  # warm up
        res: dict[str, list[float]] = {"raw_noop": [], "noop": [], "noop_per_ref": [], "noop_fast": [],
                                       "raw_shard": [], "shard": [], "shard_per_ref": [], "shard_fast": []}
        cpu: dict[str, list[float]] = {k: [] for k in res}
        fast_before = shared.fast_calls
        for _ in range(2):  # interleaved halves: drift on shared cores hits both sides alike
            fast_path(True)
            await _median_ms(noop_fast, 5, True)  # the channel opens on the 4th qualifying call in a row
            res["noop_fast"].append(await _median_ms(noop_fast, iters // 2, True, cpu["noop_fast"]))
            res["shard_fast"].append(await _median_ms(shard_fast, iters // 2, True, cpu["shard_fast"]))
            fast_path(False)
            res["raw_noop"].append(await _median_ms(raw_noop, iters // 2, False, cpu["raw_noop"]))
            res["noop"].append(await _median_ms(ours_noop, iters // 2, True, cpu["noop"]))
            res["noop_per_ref"].append(await _median_ms(noop_per_ref, iters // 2, True, cpu["noop_per_ref"]))
            res["raw_shard"].append(await _median_ms(raw_shard, iters // 2, False, cpu["raw_shard"]))
            res["shard"].append(await _median_ms(ours_shard, iters // 2, True, cpu["shard"]))
            res["shard_per_ref"].append(await _median_ms(shard_per_ref, iters // 2, True, cpu["shard_per_ref"]))
        fast_calls = shared.fast_calls - fast_before
        assert fast_calls >= 2 * iters, f"only {fast_calls} calls took the fast path"
        med = {k: round(statistics.fmean(v), 3) for k, v in res.items()}
        cpu_ms = {k: round(statistics.fmean(v), 3) for k, v in cpu.items()}
        # controller CPU per call (process time of the driver, every thread): what one controller spends per call,
        # steadier than wall time on a shared machine
        return {**{f"{k}_ms": v for k, v in med.items()},
                "noop_ratio": round(med["noop"] / med["raw_noop"], 3),
                "shard_ratio": round(med["shard"] / med["raw_shard"], 3),
                "noop_fast_ratio": round(med["noop_fast"] / med["raw_noop"], 3),
                "shard_fast_ratio": round(med["shard_fast"] / med["raw_shard"], 3),
                **{f"{k}_cpu_ms": v for k, v in cpu_ms.items()},
                "noop_cpu_ratio": round(cpu_ms["noop"] / cpu_ms["raw_noop"], 3),
                "shard_cpu_ratio": round(cpu_ms["shard"] / cpu_ms["raw_shard"], 3)}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="4,8,16,32")
    p.add_argument("--iters", type=int, default=60)
    a = p.parse_args()
    sizes = [int(x) for x in a.ranks.split(",")]
    orc.init(num_cpus=64)
    try:
        results = {n: await measure(n, a.iters) for n in sizes}
    finally:
        orc.shutdown()
    marginal = {}
    for k in ("noop", "shard", "noop_fast", "shard_fast"):
        base = k.removesuffix("_fast")
        ours = _slope(sizes, [results[n][f"{k}_ms"] for n in sizes]) if len(sizes) > 1 else None
        raw = _slope(sizes, [results[n][f"raw_{base}_ms"] for n in sizes]) if len(sizes) > 1 else None
        marginal[k] = {"orchestra_ms_per_rank": None if ours is None else round(ours, 4),
                       "raw_ms_per_rank": None if raw is None else round(raw, 4),
                       "ratio": None if raw is None or raw <= 0 else round(ours / raw, 3)}
    general = [r[f"{k}_ratio"] for r in results.values() for k in ("noop", "shard")]
    fast = [r[f"{k}_ratio"] for r in results.values() for k in ("noop_fast", "shard_fast")]
    emit({"bench": "scaling", "baseline": "sync ray.get of N bare actor calls (Host.noop) on the same actors",
          "results": {str(n): r for n, r in results.items()}, "marginal_cost": marginal,
          "target": "every ratio <= 1.15; shard marginal cost <= 1.2x raw",
          "meets_target": _meets(fast, marginal["shard_fast"]),
          "meets_target_general": _meets(general, marginal["shard"])})


def _meets(ratios: list[float], marginal: dict) -> bool | None:
    """Whether every ratio is <= 1.15x and the marginal cost per rank <= 1.2x raw; None when this run cannot say
    (one size only, or raw's cost did not grow with the ranks: no marginal cost to compare against)."""
    raw = marginal["raw_ms_per_rank"]
    if raw is None or raw <= 0:
        return None
    return all(x <= 1.15 for x in ratios) and marginal["orchestra_ms_per_rank"] / raw <= 1.2


if __name__ == "__main__":
    orc.run(main())
