"""Integrity of a call: all or nothing, no reader sees another's writes, routing by real row counts."""

from __future__ import annotations

import threading

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orc_test_workers import Hazard


@pytest.fixture(scope="module")
async def h4():
    async with WorkerGroup(ResourcePool(process_on_nodes=[4], cpus_per_worker=0.1), Hazard, group_name="h4") as g:
        yield g


@pytest.fixture(scope="module")
async def h2():
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.1), Hazard, group_name="h2") as g:
        yield g


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


async def test_unserializable_rows_for_one_rank_run_on_no_rank(h4):
    before = await h4.seen_calls()
    objs: list = [1] * 8
    objs[7] = threading.Lock()  # rank 3's rows (6, 7) cannot be serialized
    bad = Batch.from_dict({"x": torch.arange(8), "obj": objs})
    with pytest.raises(orc.DispatchError) as info:
        await h4.count(bad)
    msg = str(info.value)
    assert "rank 3" in msg and "'obj'" in msg and "h4" in msg and "count" in msg
    assert await h4.seen_calls() == before  # no rank ran it
    # a collective endpoint after the rejected call still pairs up on every rank
    out = await h4.allreduce_rows.options(timeout=60)(xs(8))
    assert out["total"].tolist() == [8] * 8


async def test_unserializable_broadcast_argument_is_rejected_before_sending(h4):
    before = await h4.seen_calls()
    with pytest.raises(orc.DispatchError, match="argument 'tag'"):
        await h4.mark(tag=threading.Lock())
    assert await h4.seen_calls() == before


async def test_a_writing_reader_does_not_change_what_others_read(h4):
    big = xs(100_000)  # 800 KB: one part per rank, read zero-copy from shared memory
    up = h4.echo(big)
    await h4.mutate(up)
    assert torch.equal((await up)["x"], torch.arange(100_000))
    assert torch.equal((await h4.total(up))["t"][:1], torch.arange(100_000)[:25_000].sum().reshape(1))


async def test_controller_writes_into_an_awaited_result_stay_private(h2):
    fut = h2.echo_all(xs(50_000))  # broadcast: each rank's single part is the whole batch
    first = await fut
    first[0]["x"][:10] = -1
    again = await h2.total(h2.echo(xs(50_000)))
    assert int(again["t"][0]) == int(torch.arange(25_000).sum())
    assert int((await fut)[0]["x"][0]) == 0  # each await is a private copy: the edit stays in ``first``
    fresh = await h2.echo_all(fut)  # a later consumer reads the producer's bytes, not the controller's edit
    assert torch.equal(fresh[0]["x"][:50_000], torch.arange(50_000))


async def test_unions_of_differently_split_futures_forward_by_rows(h4):
    b10 = xs(10)
    out = await h4.echo(h4.add1(b10) | h4.score(b10))  # rows per rank 3,3,2,2 | 3,3,3,1
    assert out["a"].tolist() == list(range(1, 11))
    assert out["s"].tolist() == [2 * i for i in range(10)]
    direct = await (h4.add1(b10) | h4.score(b10))
    assert torch.equal(direct["a"], out["a"]) and torch.equal(direct["s"], out["s"])


async def test_row_counts_come_from_the_producer_not_the_input(h2, h4):
    up = h2.expand(xs(2), n=4)  # 2 rows in, 8 rows out
    out = await h4.echo(up)
    assert out["x"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert up.rows_if_known() == 8
