"""Call overhead: ``await group.noop()`` per dispatch transform vs ``asyncio.gather`` of raw calls on the same actors.

    python -m bench.overhead [--iters 300] [--sizes 1,2,4]

Prints JSON: per world size and transform, median/mean latency of orchestra and of raw Ray, and their ratio.
``orchestra_*``/``ratio``: the general path (one Ray actor task per rank: a call with a DataFuture argument, or a
repeated call before the fast path opens). ``fast_*``/``fast_ratio``: the same repeated call as a user gets it by
default, over the fast path's channel (``orchestra/_channel.py``), on the same actors (the group's fast path is on
for those samples only: raw calls on a rank's compute lane would otherwise wait behind its channel loop).
Target: ratio <= 1.15 (``meets_target``: the default path; ``meets_target_general``: the general path).
"""

from __future__ import annotations

import argparse
import asyncio

import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

from ._common import emit, timed


class Noop(Worker):
    """Endpoints that do nothing, one per dispatch transform."""

    @endpoint(D.broadcast())
    def noop(self) -> None:
        return None

    @endpoint(D.scatter())
    def noop_scatter(self, x: list) -> None:
        return None

    @endpoint(D.shard())
    def noop_shard(self, batch: Batch) -> None:
        return None

    @endpoint(D.broadcast() | D.rank_zero())
    def noop_rank_zero(self) -> None:
        return None

    @endpoint(D.broadcast() | D.metrics())
    def noop_metrics(self) -> dict:
        return {"x": 1.0}


async def measure(world: int, iters: int) -> dict:
    pool = ResourcePool(process_on_nodes=[world])
    g = WorkerGroup(pool, Noop)
    await g.ready()
    shared = g._shared  # its fast_calls count checks that the fast samples took the fast path
    actors = g.actors  # raw handles: the fast path is off, except while the fast samples run (below)

    def fast_path(on: bool) -> None:
        g.fast_path = on  # off: the ranks' loops return before any raw call reaches their lanes
    batch = Batch.from_dict({"x": torch.arange(world * 2)})

    # The floor: a bare actor method (Host.noop) on the same actors, given what the transform would deliver.
    async def raw_all():
        await asyncio.gather(*[a.noop.remote() for a in actors])

    async def raw_scatter():
        xs = list(range(world))
        await asyncio.gather(*[a.noop.remote(xs[i]) for i, a in enumerate(actors)])

    async def raw_shard():
        shards = batch.chunk(world)
        await asyncio.gather(*[a.noop.remote(shards[i]) for i, a in enumerate(actors)])

    async def raw_one():
        await actors[0].noop.remote()

    cases = {
        "broadcast": (lambda: g.noop(), raw_all),
        "scatter": (lambda: g.noop_scatter(list(range(world))), raw_scatter),
        "shard": (lambda: g.noop_shard(batch), raw_shard),
        "rank_zero": (lambda: g.noop_rank_zero(), raw_one),
        "metrics": (lambda: g.noop_metrics(), raw_all),
    }
    out = {}
    for name, (ours, raw) in cases.items():
        async def call_ours(ours=ours):
            await ours()
        # interleave rounds so that drift on a shared machine hits both sides alike
        samples = {"raw": [], "ours": [], "fast": []}
        before = shared.fast_calls
        for _ in range(2):
            fast_path(True)  # timed's 5 warm-up calls open the channel (on the 4th qualifying call in a row)
            samples["fast"].append(await timed(call_ours, iters // 2))
            fast_path(False)
            samples["raw"].append(await timed(raw, iters // 2))
            samples["ours"].append(await timed(call_ours, iters // 2))
        assert shared.fast_calls - before >= iters, f"{name}: the fast samples did not take the fast path"
        med = {k: sum(x["median_ms"] for x in v) / 2 for k, v in samples.items()}
        mean = {k: sum(x["mean_ms"] for x in v) / 2 for k, v in samples.items()}
        out[name] = {"orchestra_median_ms": round(med["ours"], 4), "raw_ray_median_ms": round(med["raw"], 4),
                     "fast_median_ms": round(med["fast"], 4), "orchestra_mean_ms": round(mean["ours"], 4),
                     "raw_ray_mean_ms": round(mean["raw"], 4), "fast_mean_ms": round(mean["fast"], 4),
                     "ratio": round(med["ours"] / med["raw"], 3), "fast_ratio": round(med["fast"] / med["raw"], 3)}
    g.shutdown()
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--sizes", default="1,2,4")
    a = p.parse_args()
    orc.init(num_cpus=4)
    results = {}
    for w in [int(x) for x in a.sizes.split(",")]:
        results[f"workers_{w}"] = await measure(w, a.iters)
    worst = max(v["ratio"] for r in results.values() for v in r.values())
    worst_fast = max(v["fast_ratio"] for r in results.values() for v in r.values())
    emit({"bench": "overhead", "target_ratio": 1.15, "worst_ratio_fast": worst_fast, "worst_ratio_general": worst,
          "meets_target": worst_fast <= 1.15, "meets_target_general": worst <= 1.15, "results": results})


if __name__ == "__main__":
    orc.run(main())
