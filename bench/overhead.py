"""Call overhead: ``await group.noop()`` per dispatch transform vs ``asyncio.gather`` of raw calls on the same actors.

    python -m bench.overhead [--iters 300] [--sizes 1,2,4]

Prints JSON: per world size and transform, median/mean latency of orchestra and of raw Ray, and their ratio.
Target: ratio <= 1.15.
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
    actors = g.actors
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
        r1, o1 = await timed(raw, iters // 2), await timed(call_ours, iters // 2)
        r2, o2 = await timed(raw, iters // 2), await timed(call_ours, iters // 2)
        raw_med = (r1["median_ms"] + r2["median_ms"]) / 2
        our_med = (o1["median_ms"] + o2["median_ms"]) / 2
        out[name] = {"orchestra_median_ms": round(our_med, 4), "raw_ray_median_ms": round(raw_med, 4),
                     "orchestra_mean_ms": round((o1["mean_ms"] + o2["mean_ms"]) / 2, 4),
                     "raw_ray_mean_ms": round((r1["mean_ms"] + r2["mean_ms"]) / 2, 4),
                     "ratio": round(our_med / raw_med, 3)}
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
    emit({"bench": "overhead", "target_ratio": 1.15, "worst_ratio": worst, "meets_target": worst <= 1.15,
          "results": results})


if __name__ == "__main__":
    orc.run(main())
