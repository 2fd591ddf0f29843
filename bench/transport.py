"""Data-plane transport: a DP-sharded round trip of a Batch through a 4-worker group vs raw Ray on the same actors.

    python -m bench.transport [--sizes 1,64,256] [--iters 7] [--warmup 2] [--workers 4]

Orchestra: ``await group.echo(batch)`` with ``@endpoint(D.shard())`` — the controller splits the batch and puts 4
shards, each rank reads its shard, returns it (stored as bounded-size parts), the controller fetches the parts and
concatenates them into one Batch (rows in input order).

Raw Ray floor (same actors, same Batch wire format): ``ray.put`` of the 4 shards, one bare Ray actor call per rank
(``__ray_call__`` of ``_raw_echo``: Ray resolves the ref, the function returns the shard, Ray stores the return
value; none of orchestra's call path runs on the rank, only Batch's own pickling, as on orchestra's side), and
``ray.get`` of the 4 results. ``raw_ray_concat`` adds the ``Batch.concat`` of the 4 shards so that both sides end
with one Batch in the controller. Prints JSON. Target: 64 MiB over 4 workers < 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

from ._common import emit

WIDTH = 1024  # float32 values per row: 4 KiB, plus an 8-byte int64 id column


class Echo(Worker):
    @endpoint(D.shard())
    def echo(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard(), zero_copy_inputs=True)
    def echo_zero_copy(self, batch: Batch) -> Batch:
        return batch



def _raw_echo(_host: object, batch: Batch) -> Batch:
    """The raw baseline's actor call (``actor.__ray_call__``: a plain Ray method call on the group's own actors, which
    runs none of orchestra's call path there): the shard Ray resolved, returned for Ray to store."""
    return batch


def make_batch(mib: int) -> Batch:
    rows = max(4, (mib << 20) // (WIDTH * 4))
    return Batch.from_dict({"x": torch.randn(rows, WIDTH), "idx": torch.arange(rows)})


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_ms": round(statistics.median(s), 2), "min_ms": round(s[0], 2), "max_ms": round(s[-1], 2)}


async def measure(g: WorkerGroup, mib: int, iters: int, warmup: int) -> dict:
    batch = make_batch(mib)
    nbytes = batch.nbytes
    actors = g.actors

    async def ours() -> Batch:
        return await g.echo(batch)

    async def ours_zero_copy() -> Batch:
        return await g.echo_zero_copy(batch)

    async def raw_ray(concat: bool):
        shards = batch.chunk(len(actors))
        refs = [ray.put(s) for s in shards]
        got = await asyncio.gather(*[a.__ray_call__.remote(_raw_echo, r) for a, r in zip(actors, refs)])
        assert all(isinstance(b, Batch) for b in got), "the raw echo returned something else than the shards"
        return Batch.concat(got) if concat else got

    # correctness once
    out = await ours()
    assert torch.equal(out["idx"], batch["idx"]) and torch.equal(out["x"], batch["x"])
    del out

    cases = {"orchestra": ours, **({"orchestra_zero_copy": ours_zero_copy} if hasattr(Echo, "echo_zero_copy") else {}),
             "raw_ray": lambda: raw_ray(False), "raw_ray_concat": lambda: raw_ray(True)}
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for k, fn in cases.items():
        for _ in range(warmup):
            await fn()
    orc.reset_controller_stats()
    for i in range(iters):  # interleaved so that load from other processes hits every case alike
        for k, fn in cases.items():
            t0 = time.perf_counter()
            r = await fn()
            samples[k].append((time.perf_counter() - t0) * 1e3)
            del r
            if k == "orchestra" and i == 0:
                cs = orc.controller_stats()
    res: dict = {"bytes": nbytes, "rows": len(batch)}
    for k, s in samples.items():
        st = _stats(s)
        st["MB_per_s"] = round(nbytes / 1e6 / (st["median_ms"] / 1e3), 1)
        res[k] = st
    res["ratio_vs_raw_ray"] = round(res["orchestra"]["median_ms"] / res["raw_ray"]["median_ms"], 3)
    res["ratio_vs_raw_ray_concat"] = round(res["orchestra"]["median_ms"] / res["raw_ray_concat"]["median_ms"], 3)
    res["controller_per_call"] = {"bytes_put": cs["bytes_put"], "bytes_materialized": cs["bytes_materialized"]}
    return res


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1,64,256", help="batch sizes in MiB")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    a = p.parse_args()
    torch.set_num_threads(1)
    orc.init(num_cpus=4)
    g = WorkerGroup(ResourcePool(process_on_nodes=[a.workers]), Echo)
    await g.ready()
    results = {}
    for mib in [int(x) for x in a.sizes.split(",")]:
        results[f"{mib}MiB"] = await measure(g, mib, a.iters, a.warmup)
    g.shutdown()
    target = results.get("64MiB", {}).get("orchestra", {}).get("median_ms")
    emit({
        "bench": "transport",
        "workers": a.workers,
        "baseline": "raw_ray: ray.put of the shards + one direct call per actor to a bare echo method (Ray resolves "
                    "the ref; the return value is stored by Ray) + ray.get of the shards, on the same actors; "
                    "raw_ray_concat also concatenates the shards into one Batch as orchestra's await does",
        "target": "64 MiB over 4 workers < 100 ms",
        "meets_target": None if target is None else target < 100,
        "results": results,
    })


if __name__ == "__main__":
    orc.run(main())
