"""orchestra in one page: groups, dispatch transforms, awaitable futures, forwarding and streaming.

    python examples/quickstart.py

Starts a private local Ray cluster on loopback, puts a 4-rank and a 2-rank group on it, and prints what each
call returns. Nothing here needs a GPU.
"""

from __future__ import annotations

import time

import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D


class Scorer(Worker):
    """Scores rows; every rank holds a scale."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    @endpoint(D.shard())  # rows split over ranks; results concatenated in row order
    def score(self, batch: Batch) -> Batch:
        return Batch.from_dict({"score": batch["x"].float() * self.scale,
                                "by_rank": torch.full((len(batch),), self.rank)})

    @endpoint(D.shard())
    def extra(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x_squared": batch["x"] ** 2})

    @endpoint(D.broadcast())  # same arguments to every rank; result: list, one per rank
    def set_scale(self, s: float) -> float:
        self.scale = s
        return s

    @endpoint(D.broadcast() | D.rank_zero())  # runs on rank 0 only
    def save(self, path: str) -> str:
        return f"rank {self.rank} saved to {path}"

    @endpoint(D.shard())  # a generator endpoint streams its parts as they are made
    def generate(self, batch: Batch):
        for piece in batch.chunk(2):
            time.sleep(0.05)
            yield Batch.from_dict({"x": piece["x"] * 10})


async def main() -> None:
    orc.init()  # local Ray on loopback
    pool = ResourcePool(process_on_nodes=[4], use_gpu=False)
    group = WorkerGroup(pool, Scorer, 2.0)  # returns at once; actors start in the background
    other_group = WorkerGroup(ResourcePool(process_on_nodes=[2]), Scorer, 0.5, group_name="other")
    await group.ready()
    await other_group.ready()
    for r in await group.describe():
        print(f"rank {r['rank']}: pid {r['pid']} on {r['node_ip']} bundle {r['bundle_index']} {r['device']}")

    batch = Batch.from_dict({"x": torch.arange(10), "id": [f"row{i}" for i in range(10)]})
    out = await group.score(batch)  # a Batch, rows in input order (10 rows over 4 ranks: 3, 3, 2, 2)
    print("score:", out["score"].tolist(), "ranks:", out["by_rank"].tolist())
    print("set_scale:", await group.set_scale(3.0))
    print("save:", await group.save("/tmp/ckpt"))

    orc.reset_controller_stats()
    fut = group.score(batch)  # a DataFuture, returned at once
    out2 = await other_group.score(fut | batch)  # parts of fut go worker -> worker (4 ranks -> 2 ranks)
    print("forwarded 4 -> 2:", out2["score"].tolist())
    both = await (fut | group.extra(batch))  # row-aligned union of two futures' columns
    print("union columns:", sorted(both.keys()))
    for rank, s in enumerate(await other_group.stats()):
        print(f"other rank {rank} fetched {s['score']['parts_in']} parts, {s['score']['rows_in']} rows")
    print("controller materialized", orc.controller_stats()["bytes_materialized"], "bytes")

    stream = group.generate(batch)
    async for part in stream:  # parts arrive while the other ranks still generate
        print(f"part from rank {part.rank} #{part.seq}: {part.rows} rows")
    print("streamed:", (await stream)["x"].tolist())
    orc.shutdown()


if __name__ == "__main__":
    orc.run(main())
