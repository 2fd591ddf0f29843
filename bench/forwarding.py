"""Worker-to-worker forwarding: group A echo -> group B echo through a forwarded DataFuture, vs a naive raw Ray chain.

    python -m bench.forwarding [--sizes 64,256] [--unaligned 100] [--samples 4] [--iters 5] [--warmup 2]

For each direction (4 -> 2 and 2 -> 4 ranks) and size, the input is made on the producer's workers (so the controller
never holds payload), then the timed chain is ``up = A.echo(src); down = B.echo(up); await down.wait()`` — nothing
is materialized in the controller. Reported: wall time, bytes each consumer rank fetched over the bytes of its shard
(``group.stats()``: bytes_in / (rows_used * bytes_per_row)), controller RSS growth over the timed runs, and
``controller_stats()["bytes_materialized"]`` (must stay 0).

Raw Ray comparison (same actors, bare Ray calls through ``__ray_call__``: none of orchestra's call path runs on the
ranks, only the Batch code that Ray's unpickling and the functions below use): each
producer actor gets its input refs, returns its rows (Ray stores the return value); each consumer actor is passed
*every* producer ref, fetches them all, concatenates and keeps its chunk — what a naive chain (verl's
DataProtoFuture) does; the controller waits for the consumers' results without fetching them (``ray.wait``,
``fetch_local=False``), as ``down.wait()`` does. Targets: fetched/shard <= 1.25; controller RSS growth < 32 MiB.

A reader fetches whole parts (a producer stores its rows as parts of at most ORCHESTRA_PART_BYTES, 8 MiB), so a rank
whose rows start or end inside a part fetches the rest of that part too. At 64 and 256 MiB, 4 <-> 2, every part
boundary falls on a consumer boundary; the ``--unaligned`` sizes (default 100 MiB) show a case where they do not.

``--samples n`` (default 4; 0 skips it) adds the rollout shape at the first size: the producer's input is a batch of
prompts on the controller (split by the call; the raw chain puts the same chunks each time), and it returns each of
its rows ``n`` times (``rollout``: n samples a prompt), so its output has n times the rows of its input
(``results_samples``; the raw chain's producer repeats its rows the same way).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

from ._common import emit, rss_mib

WIDTH = 1024  # float32 values per row (4 KiB) plus an 8-byte int64 row id


class Stage(Worker):
    @endpoint(D.shard())
    def make(self, which: Batch, rows: int) -> Batch:
        """This rank's slice of the input, made on the worker: rows [rank*rows, (rank+1)*rows) (``which``: one row
        per rank, so that the result is one set of rows, in rank order)."""
        start = self.rank * rows
        return Batch.from_dict({"x": torch.randn(rows, WIDTH), "idx": torch.arange(start, start + rows)})

    @endpoint(D.shard())
    def echo(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def rollout(self, batch: Batch, n: int) -> Batch:
        return batch.repeat(n)


# The raw chain's actor calls: plain Ray method calls on the groups' own actors (``actor.__ray_call__``), which run none
# of orchestra's call path there (only Batch's own code); Ray resolves the refs passed as arguments and stores each
# return value as one object.
def _raw_rollout(_host: object, n: int, *parts: Batch) -> Batch:
    return Batch.concat(parts).repeat(n)


def _raw_echo(_host: object, *parts: Batch) -> Batch:
    return Batch.concat(parts)


def _raw_consume(_host: object, index: int, count: int, *upstream: Batch) -> Batch:
    """The naive consumer: every upstream object fetched and concatenated, then this rank's chunk kept."""
    return Batch.concat(upstream).chunk(count)[index]


def _one_row_per_rank(g: WorkerGroup) -> Batch:
    return Batch.from_dict({"rank": torch.arange(g.world_size)})


def _ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_ms": round(statistics.median(s), 1), "min_ms": round(s[0], 1), "max_ms": round(s[-1], 1)}


async def chain(prod: WorkerGroup, cons: WorkerGroup, mib: int, iters: int, warmup: int, samples: int = 0) -> dict:
    """``samples``: the producer returns each input row that many times (0: echo); ``mib`` is its output's size."""
    rows_per_rank = max(1, (mib << 20) // (WIDTH * 4 + 8) // prod.world_size // max(1, samples))
    src = prod.make(_one_row_per_rank(prod), rows_per_rank)
    await src.wait()
    src_outs = await src.outputs()
    src_refs = [[p.ref for o in outs for p in o.parts] for outs in src_outs]
    # the raw chain starts from the same stored rows: each part an object of Ray's store (a part kept inline in a
    # reply would make the raw producers read rows shipped from the controller instead)
    assert all(isinstance(r, ray.ObjectRef) for refs in src_refs for r in refs), "a source part is not a stored object"
    n_rows = sum(p.rows for outs in src_outs for o in outs for p in o.parts)
    n_bytes = sum(p.nbytes for outs in src_outs for o in outs for p in o.parts)
    bpr = n_bytes / n_rows
    raw_p = _raw_rollout if samples else _raw_echo
    raw_first = (samples,) if samples else ()
    prompts = None
    if samples:  # a rollout's input is the controller's batch of prompts, split by the call (the pipelines' shape)
        prompts = Batch.from_dict({"x": torch.randn(n_rows, WIDTH), "idx": torch.arange(n_rows)})

    async def ours() -> None:
        up = prod.rollout(prompts, samples) if samples else prod.echo(src)
        down = cons.echo(up)
        await down.wait()

    async def raw(check: bool = False) -> None:
        if samples:  # the same split and put per call, then each producer repeats its rows
            refs_now = [[ray.put(c)] for c in prompts.chunk(prod.world_size)]
        else:
            refs_now = src_refs
        up = [a.__ray_call__.remote(raw_p, *raw_first, *refs) for a, refs in zip(prod.actors, refs_now)]
        down = [a.__ray_call__.remote(_raw_consume, j, cons.world_size, *up) for j, a in enumerate(cons.actors)]
        if check:  # once, untimed: the consumers' rows, fetched here
            got = await asyncio.gather(*down)
            assert sum(len(b) for b in got) == n_rows * max(1, samples), "the raw chain lost or added rows"
        else:  # as ours: done, nothing fetched into the controller
            await asyncio.to_thread(ray.wait, down, num_returns=len(down), fetch_local=False)

    await raw(check=True)
    for _ in range(warmup):
        await ours()
        await raw()

    # fetched bytes per consumer rank, over one call
    await cons.reset_stats()
    await ours()
    st = [s["echo"] for s in await cons.stats()]
    fetched = [round(s["bytes_in"] / (s["rows_used"] * bpr), 3) for s in st]

    gc.collect()
    orc.reset_controller_stats()
    rss0 = rss_mib()
    rss_peak = rss0
    t_ours: list[float] = []
    t_raw: list[float] = []
    for _ in range(iters):  # interleaved so that load from other processes hits both alike
        t0 = time.perf_counter()
        await ours()
        t_ours.append((time.perf_counter() - t0) * 1e3)
        rss_peak = max(rss_peak, rss_mib())
        t0 = time.perf_counter()
        await raw()
        t_raw.append((time.perf_counter() - t0) * 1e3)
    cs = orc.controller_stats()
    ours_ms, raw_ms = _ms(t_ours), _ms(t_raw)
    out_bytes = n_bytes * max(1, samples)  # what the consumer group reads
    return {
        "bytes": out_bytes, "rows": n_rows * max(1, samples),
        "orchestra": {**ours_ms, "MB_per_s": round(out_bytes / 1e3 / ours_ms["median_ms"], 1)},
        "raw_ray_naive": {**raw_ms, "MB_per_s": round(out_bytes / 1e3 / raw_ms["median_ms"], 1)},
        "ratio_vs_raw_ray_naive": round(ours_ms["median_ms"] / raw_ms["median_ms"], 3),
        "fetched_over_shard_per_rank": fetched,
        "fetched_over_shard_raw_naive_by_construction": cons.world_size,  # each consumer fetches all N rows for its N/D
        "parts_in_per_rank": [int(s["parts_in"]) for s in st],
        "controller_rss_growth_mib": round(rss_peak - rss0, 1),
        "controller_bytes_materialized": cs["bytes_materialized"],
        "controller_bytes_put": cs["bytes_put"],
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="64,256", help="batch sizes in MiB")
    p.add_argument("--unaligned", default="100", help="extra sizes in MiB, reported apart from the targets")
    p.add_argument("--samples", type=int, default=4, help="rows a producer returns per input row (0: skip)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    orc.init(num_cpus=4)
    g4 = WorkerGroup(ResourcePool(process_on_nodes=[4]), Stage, group_name="A4")
    g2 = WorkerGroup(ResourcePool(process_on_nodes=[2]), Stage, group_name="B2")
    await asyncio.gather(g4.ready(), g2.ready())

    # correctness of the forwarded chain, once, small
    for prod, cons in ((g4, g2), (g2, g4)):
        src = prod.make(_one_row_per_rank(prod), 25)
        out = await cons.echo(prod.echo(src))
        assert torch.equal(out["idx"], torch.arange(25 * prod.world_size)), "forwarded rows out of order"

    results, unaligned = {}, {}
    for sizes, into in ((a.sizes, results), (a.unaligned, unaligned)):
        for mib in [int(x) for x in sizes.split(",") if x]:
            for prod, cons in ((g4, g2), (g2, g4)):
                key = f"{mib}MiB_{prod.world_size}to{cons.world_size}"
                into[key] = await chain(prod, cons, mib, a.iters, a.warmup)
    samples: dict = {}
    first = [int(x) for x in a.sizes.split(",") if x][:1]
    for mib in first if a.samples > 0 else []:
        for prod, cons in ((g4, g2), (g2, g4)):
            key = f"{mib}MiB_{prod.world_size}to{cons.world_size}_samples{a.samples}"
            samples[key] = await chain(prod, cons, mib, a.iters, a.warmup, a.samples)
    g4.shutdown()
    g2.shutdown()
    worst_fetch = max(max(r["fetched_over_shard_per_rank"]) for r in results.values())
    worst_rss = max(r["controller_rss_growth_mib"] for r in results.values())
    materialized = sum(r["controller_bytes_materialized"] for r in results.values())
    emit({
        "bench": "forwarding",
        "baseline": "raw_ray_naive: producer actors return their rows as Ray objects; every consumer actor is passed "
                    "all producer refs, fetches and concatenates them, and keeps its chunk (same actors)",
        "targets": {"fetched_over_shard": 1.25, "controller_rss_growth_mib": 32, "controller_bytes_materialized": 0},
        "worst_fetched_over_shard": worst_fetch,
        "worst_controller_rss_growth_mib": worst_rss,
        "meets_targets": worst_fetch <= 1.25 and worst_rss < 32 and materialized == 0,
        "results": results,
        "worst_fetched_over_shard_unaligned": max((max(r["fetched_over_shard_per_rank"]) for r in unaligned.values()),
                                                  default=None),
        "results_unaligned": unaligned,
        "worst_fetched_over_shard_samples": max((max(r["fetched_over_shard_per_rank"]) for r in samples.values()),
                                                default=None),
        "results_samples": samples,
    })


if __name__ == "__main__":
    orc.run(main())
