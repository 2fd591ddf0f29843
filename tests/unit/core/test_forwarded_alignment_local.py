"""A shard call's data arguments are split alike, whether each is a Batch or a forwarded future: every rank reads the
same rows of each. Before, a forwarded future was read aligned (rank i: upstream rank i's rows) while the call's
other data argument was split balanced, so the ranks paired the rows of one with other rows of the other, without
an error (a loss of 4510 where the rows give 43210). And a balanced read of fewer rows than shards is refused by
every rank alike (ranks with rows had run while the others refused). In-process backend: no Ray."""

from __future__ import annotations

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

pytestmark = pytest.mark.usefixtures("no_ray")

W = torch.tensor([1.0, 10.0, 100.0, 1000.0, 10000.0])


class _Pairs(Worker):
    @endpoint(D.shard(pad=True))
    def logp(self, b: Batch) -> Batch:  # 5 rows over 4 ranks, padded: its ranks return 2, 2, 1, 0 rows
        return Batch.from_dict({"lp": b["id"].double()})

    @endpoint(D.shard())
    def adv(self, b: Batch) -> Batch:
        return Batch.from_dict({"id": b["id"], "w": W[b["id"]]})

    @endpoint(D.shard())
    def rows_seen(self, lp: Batch, adv: Batch) -> tuple[list[int], list[int]]:
        return lp["lp"].long().tolist(), adv["id"].tolist()

    @endpoint(D.shard() | D.metrics("sum"))
    def loss(self, lp: Batch, adv: Batch) -> dict:
        return {"loss": float((lp["lp"] * adv["w"]).sum())}

    @endpoint(D.shard())
    def count(self, b: Batch) -> int:
        self.ran += 1
        return len(b)

    @endpoint(D.shard())
    def head_twice(self, b: Batch) -> Batch:  # the rank that holds row 0 returns its rows twice
        ids = b["id"]
        return Batch.from_dict({"id": torch.cat([ids, ids]) if int(ids[0]) == 0 else ids})

    @endpoint(D.shard())
    def evens(self, b: Batch) -> Batch:
        return Batch.from_dict({"id": b["id"][b["id"] % 2 == 0]})

    @endpoint(D.broadcast())
    def runs(self) -> int:
        return self.ran

    def __init__(self) -> None:
        self.ran = 0


@pytest.fixture
async def g():
    async with WorkerGroup(ResourcePool(process_on_nodes=[4], cpus_per_worker=0.01, backend="local"), _Pairs) as g:
        yield g


async def test_a_forwarded_future_and_a_batch_of_its_rows_are_split_alike(g):
    ids = Batch.from_dict({"id": torch.arange(5)})
    adv = Batch.from_dict({"id": torch.arange(5), "w": W})
    want = [([0, 1], [0, 1]), ([2], [2]), ([3], [3]), ([4], [4])]
    assert await g.rows_seen(await g.logp(ids), adv) == want  # the awaited rows: the reference
    assert await g.rows_seen(g.logp(ids), adv) == want
    assert await g.rows_seen(g.logp(ids), g.adv(ids)) == want  # two futures, split differently by their producers
    assert await g.loss(g.logp(ids), adv) == {"loss": 43210.0} == await g.loss(await g.logp(ids), adv)


async def test_a_balanced_read_of_fewer_rows_than_shards_is_refused_by_every_rank():
    """3 ranks read the 2 rows 4 ranks made (a balanced read): ranks 0 and 1 ran their endpoint on a row each while
    rank 2 refused its empty share; now every rank refuses, as the controller refuses such a Batch."""
    def pool(n: int) -> ResourcePool:
        return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend="local")

    async with WorkerGroup(pool(4), _Pairs, group_name="four") as four, \
            WorkerGroup(pool(3), _Pairs, group_name="three") as three:
        with pytest.raises(orc.WorkerError, match="2 rows.*3 shards"):
            await three.count(four.evens(Batch.from_dict({"id": torch.arange(4)})))
        assert await three.runs() == [0, 0, 0]
        assert await three.count(four.evens(Batch.from_dict({"id": torch.arange(6)}))) == [1, 1, 1]


async def test_one_forwarded_future_alone_is_still_read_aligned(g):
    """The aligned read (each rank its upstream rank's rows, starting as soon as that rank is done) stays for a call
    that reads one future: its rows are not paired with another argument's. ``head_twice`` returns 4, 2, 2, 2 rows;
    a balanced read would give 3, 3, 2, 2."""
    ids = Batch.from_dict({"id": torch.arange(8)})
    assert await g.count(g.head_twice(ids)) == [4, 2, 2, 2]
    assert await g.count(await g.head_twice(ids)) == [3, 3, 2, 2]
