"""Worker-to-worker forwarding, unions and streaming over Ray: large parts read from the object store, data that
never passes through the controller, streams over Ray actors (parts consumed while the producer runs, calls made
after a stream), on the session's shared Scorer groups.

Which parts a reader fetches for each split of producer and consumer, and a mesh reading a stream, are checked
in-process by tests/unit/core/test_group_semantics_local.py; forwarding, unions and streams on both backends by
tests/contract."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import orchestra as orc
from orchestra import Batch
from orchestra._wire import Span, reader_cuts


@pytest.fixture(scope="module")
async def groups(scorers):
    """The session's Scorer groups of 2, 3 and 4 ranks (conftest)."""
    return scorers


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


async def _stats(g, endpoint):
    return [s[endpoint] for s in await g.stats()]


async def test_large_parts_are_split_so_readers_fetch_their_share(groups):
    a, b = groups[2], groups[4]
    await b.reset_stats()
    # 64 rows x 320 kB = 20 MiB; each producer knows its rows are the first or second half of the batch and cuts its
    # 10 MiB where a reader of 4 (or of 3: the session has such a group too) starts: at row 16 (48), and 22 (43/44)
    rows, width = 64, 80_000
    data = Batch.from_dict({"x": torch.arange(rows), "w": torch.ones(rows, width)})
    up = a.echo(data)
    down = b.echo(up)
    await down.wait()
    st = await _stats(b, "echo")
    shard_bytes = data.nbytes / 4
    readers = a._shared.reader_sizes()
    assert {2, 3, 4} <= set(readers)
    # quarters [0,16) [16,32) [32,48) [48,64), each cut where another reader's share starts (a reader of 3: 22,
    # 43, 44): the parts a quarter reads are the producer's parts inside it, no more
    cuts = {h * 32 + c for h in (0, 1) for c in reader_cuts(Span(h * 32, 32, 64), readers)}
    assert [s["parts_in"] for s in st] == [1 + sum(q * 16 < c < q * 16 + 16 for c in cuts) for q in range(4)]
    assert [s["bytes_in"] for s in st] == [shard_bytes] * 4  # each reads exactly its rows
    out = await down
    assert torch.equal(out["x"], torch.arange(rows))


async def test_union_of_futures_stays_on_data_plane(groups):
    a, b = groups[4], groups[2]
    orc.reset_controller_stats()
    base = a.echo(xs(10))
    scores = a.score(base)
    plus = b.plus_one(base)
    joined = await (scores | plus)
    assert set(joined.keys()) == {"score", "rank", "y"}
    assert torch.equal(joined["y"], torch.arange(10) + 1)
    assert orc.controller_stats()["bytes_materialized"] == joined.nbytes
    # a union forwarded into another call: each rank unions its rows from both sources
    both = await b.echo(base | plus)
    assert torch.equal(both["x"] + 1, both["y"])
    # a concrete batch can join a future too
    extra = Batch.from_dict({"z": torch.arange(10) * 3})
    mixed = await b.echo(plus | extra)
    assert torch.equal(mixed["z"], torch.arange(10) * 3) and torch.equal(mixed["y"], torch.arange(10) + 1)


async def test_streaming_endpoint_yields_parts_in_order(groups):
    g = groups[2]
    fut = g.gen(xs(10), pieces=3)
    seen = []
    async for part in fut:
        seen.append((part.slot, part.seq, part.rows))
        assert part.keys == ("x",)
        b = await part.get()
        assert len(b) == part.rows
    assert sorted(seen) == [(0, 0, 2), (0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 1, 2), (1, 2, 1)]
    out = await fut
    assert torch.equal(out["x"], torch.arange(10) + 100)
    out = await g.agen(xs(6))
    assert torch.equal(out["x"], torch.arange(6) + 200)


async def test_streamed_parts_are_consumed_while_the_producer_still_runs(groups, orc_sequencer):
    prod, cons = groups[2], groups[4]
    # each producer rank yields its first part at once and its second only after the test's position 0
    fut = prod.gen_in_turn(xs(8), orc_sequencer, [1, 2])
    mapped = cons.per_part(fut)
    got = 0
    async for part in mapped:
        got += 1
        if got == 1:  # a mapped part exists while the producer cannot have finished: only now is it let on
            assert not fut.done()
            async with orc_sequencer(0):
                pass
    assert got == 4
    out = await mapped
    assert torch.equal(out["y"], (torch.arange(8) + 100) * 2)  # rows in input order
    assert torch.equal((await fut)["x"], torch.arange(8) + 100)


async def test_streaming_output_forwarded_into_a_plain_shard_call(groups):
    fut = groups[2].gen(xs(9), pieces=2)
    out = await groups[3].plus_one(fut)
    assert torch.equal(out["y"], torch.arange(9) + 101)


async def test_forwarded_future_never_materializes_in_controller(groups):
    a, b = groups[4], groups[2]
    orc.reset_controller_stats()
    data = Batch.from_dict({"x": torch.arange(64), "w": torch.ones(64, 4096)})
    fut = b.echo(a.echo(a.echo(data)))
    await fut.wait()
    assert orc.controller_stats()["bytes_materialized"] == 0


async def test_calls_made_after_a_stream_reach_every_rank_after_its_parts(groups, orc_sequencer):
    prod, cons = groups[2], groups[2]
    await cons.set_scale(1.0)
    fut = prod.gen_in_turn(xs(8), orc_sequencer, [1, 2], pieces=4)  # parts 2-4 after the test's position 0
    mapped = cons.log_part(fut)
    later = cons.set_scale(7.0)  # made while parts are still being produced: sent after the last one
    async with orc_sequencer(0):
        pass
    assert await later == [7.0, 7.0]
    seen = await cons.calls_seen()
    for calls in seen:
        tail = calls[-5:]
        assert tail[-1] == "set7.0" and all(c.startswith("part") for c in tail[:-1])
    assert torch.equal((await mapped)["x"], torch.arange(8) + 100)
    await cons.set_scale(1.0)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast path", "Ray calls"])
async def test_a_loop_feeding_each_result_to_the_next_call_keeps_only_the_last_call(groups, fast_path):
    """``x = g.echo(x)``: each finished call let its inputs go, so the loop keeps the last call alive, not every
    call before it with its rows (each call held its upstream until the chain's future was dropped: a long loop grew
    until it ran out of memory). The loop awaits another call each step, never the chain. Checked in process by
    tests/unit/core/test_call_memory.py."""
    g = groups[2]
    was, g.fast_path = g.fast_path, fast_path
    try:
        x = g.echo(Batch.from_dict({"x": torch.arange(8), "w": torch.ones(8, 40_000)}))  # 160 kB a rank
        early = []
        for _ in range(12):
            x = g.echo(x)
            early.append(weakref.ref(x._inv))
            assert len(await g.get_scale()) == 2  # each rank runs it after the chain's call
        gc.collect()
        assert [r() is None for r in early[:-2]] == [True] * (len(early) - 2)
        assert (await x)["x"].tolist() == list(range(8))
    finally:
        g.fast_path = was
