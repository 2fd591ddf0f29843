"""What a group call means, checked on both backends (conftest's ``backend`` fixture): dispatch, forwarding,
streaming, results, errors, cancellation, deadlines, supervision, integrity, describe and stats."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import numpy as np
import pytest
import torch
from contract_workers import BadInit, Critic, Echo, ReversedMesh

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orchestra.testing import fail_rank, kill_rank


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


# -- dispatch and results ---------------------------------------------------------------------------------------------
async def test_shard_splits_rows_in_order_over_ranks(bed):
    g = bed["e3"]
    out = await g.scale_x(xs(7))
    assert out["y"].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 2, 2]
    padded = await g.padded(xs(7))
    assert len(padded) == 7 and padded["n"].tolist() == [3] * 7  # every rank got 3 rows (2 of them padding)


async def test_broadcast_and_async_endpoints_return_one_value_per_rank(bed):
    g = bed["e2"]
    assert await g.whoami() == [{"rank": 0, "world_size": 2, "role": "e2"}, {"rank": 1, "world_size": 2, "role": "e2"}]
    assert await g.set_scale(3.0) == [3.0, 3.0]
    try:
        assert await g.async_add(10) == [10, 11]
        assert (await g.scale_x(xs(2)))["y"].tolist() == [0, 3]
    finally:
        await g.set_scale(1.0)


async def test_mesh_ranks_of_one_replica_read_the_same_rows_and_one_reports(bed):
    out = await bed["mesh"].compute(xs(5))
    assert out["x"].tolist() == [0, 1, 2, 3, 4] and out["rank"].tolist() == [0] * 5


async def test_a_mesh_whose_replicas_are_not_in_rank_order_keeps_rows_in_input_order(make_group, bed):
    """Replica d is served by rank 2 - d: await and every reader of the future get the rows in input order (replica
    order), not in the order of the ranks that computed them."""
    g = await make_group(ReversedMesh, ranks=3)
    out = await g.compute(xs(7))
    assert out["x"].tolist() == list(range(7)) and out["rank"].tolist() == [2, 2, 2, 1, 1, 0, 0]
    assert (await g.compute_pad(xs(7)))["x"].tolist() == list(range(7))
    up = g.compute(xs(7))
    assert (await bed["e2"].echo(up))["x"].tolist() == list(range(7))  # read by rows (2 readers of 3 producers)
    again = await g.compute(up)  # read replica by replica (3 readers of 3 producers)
    assert again["x"].tolist() == list(range(7)) and again["rank"].tolist() == [2, 2, 2, 1, 1, 0, 0]
    assert sorted([(p.slot, p.rank) async for p in up]) == [(0, 2), (1, 1), (2, 0)]  # slot i: replica i's rows


async def test_colocated_roles_share_each_rank(backend):
    pool = ResourcePool(process_on_nodes=[2], cpus_per_worker=0.1, backend=backend)
    views = WorkerGroup.colocate(pool, {"actor": Echo, "critic": Critic}, actor={"scale": 2.0})
    try:
        actor, critic = views["actor"], views["critic"]
        assert await critic.whoami() == [{"rank": 0, "role": "critic"}, {"rank": 1, "role": "critic"}]
        assert (await actor.scale_x(xs(2)))["y"].tolist() == [0, 2]
        a, c = await actor.describe(), await critic.describe()
        assert [d["pid"] for d in a] == [d["pid"] for d in c]
        assert all(d["roles"] == ["actor", "critic"] for d in a)
    finally:
        await views["actor"].aclose()


# -- forwarding and streaming -----------------------------------------------------------------------------------------
async def test_forwarded_future_is_read_worker_to_worker_by_overlapping_parts(bed):
    a, b = bed["e3"], bed["e2"]
    await b.reset_stats()
    orc.reset_controller_stats()
    down = b.plus_one(a.echo(xs(10)))  # producer rows 4,3,3 -> consumer rows [0,5) and [5,10)
    out = await down
    assert out["z"].tolist() == list(range(1, 11))
    st = [s["plus_one"] for s in await b.stats()]
    assert [s["parts_in"] for s in st] == [2, 2]
    assert [s["rows_in"] for s in st] == [7, 6]
    assert [s["rows_used"] for s in st] == [5, 5]
    assert orc.controller_stats()["bytes_materialized"] == out.nbytes  # never the upstream payload


async def test_a_future_of_one_batch_per_rank_is_not_rows_to_shard_and_forwards_as_its_await(bed):
    """broadcast() results are one value per rank (await gives a list), not one row space: a shard call refuses
    such a future before sending (rather than reading every rank's copy as more rows), and a broadcast call gets
    exactly the list ``await`` gives."""
    g = bed["e2"]
    up = g.rows_each(4)
    with pytest.raises(orc.DispatchError, match=r"one value per rank") as info:
        g.echo(up)
    assert "rows_each" in str(info.value) and "from_rank" in str(info.value)
    with pytest.raises(orc.DispatchError, match=r"one value per rank"):
        g.echo(g.echo(xs(4)) | up)  # in a union too
    awaited = await up
    assert [b["x"].tolist() for b in awaited] == [[0, 1, 2, 3]] * 2
    got = await g.take_value(up)  # each rank gets the list of the two ranks' Batches
    assert [[b["x"].tolist() for b in per_rank] for per_rank in got] == [[[0, 1, 2, 3]] * 2] * 2


async def test_a_forwarded_value_is_what_await_gives_or_the_forward_is_refused(bed):
    g = bed["e2"]
    one = g.on_rank_one(3)  # one rank runs, yet await gives a list: so does forwarding
    assert await one == [3]
    assert await g.take_value(one) == [[3], [3]]
    assert await g.take_value(g.from_zero(7)) == [7, 7]  # from_rank: the kept rank's value itself
    mets = g.rank_metrics()
    with pytest.raises(orc.DispatchError, match=r"collected into one value by the controller.*Await it"):
        g.take_value(mets)  # the mean exists only in the controller: refused rather than the per-rank dicts
    assert await mets == {"a": 1.5}


async def test_scatter_then_shard_gives_each_rank_its_entry_and_its_rows(bed):
    g = bed["e2"]
    out = await g.offset_rows(xs(4), [10, 20])
    assert out["x"].tolist() == [10, 11, 22, 23]
    with pytest.raises(orc.DispatchError, match="3 entries but the group has 2 ranks"):
        g.offset_rows(xs(4), [1, 2, 3])


async def test_plain_values_of_a_shard_call_forward_as_their_await(bed):
    """A shard endpoint that returns plain values (not rows): a broadcast call that takes its future gets exactly
    what ``await`` gives — a list with one entry per collecting rank (its one value, or the list of the values it
    yielded) — whatever the number of collectors, as for every other future."""
    g, mesh = bed["e2"], bed["mesh"]
    one_collector = mesh.total(xs(4))  # DP=1 x TP=2: one collector
    assert await one_collector == [6]
    assert await mesh.take_value(one_collector) == [[6], [6]]
    two = g.total(xs(4))
    assert await two == [1, 5]
    assert await g.take_value(two) == [[1, 5], [1, 5]]
    several = g.totals(xs(8))  # two values per rank: rows 0-3 -> 0+1, 2+3; rows 4-7 -> 4+5, 6+7
    assert await several == [[1, 5], [9, 13]]
    assert await g.take_value(several) == [[[1, 5], [9, 13]]] * 2


def _paths(g: WorkerGroup) -> Iterator[str]:
    """Run the loop body on the general path (one Ray task per rank), then with the fast path allowed and a few
    repeated calls to open it (Ray; the in-process backend has one path); the group's switch is put back."""
    was = g.fast_path
    try:
        g.fast_path = False
        yield "general"
        g.fast_path = True
        for _ in range(5):
            yield "repeated"
    finally:
        g.fast_path = was


async def test_a_plain_endpoint_returning_a_generator_object_fails_on_every_path(bed):
    """Ray takes a returned generator object for several return values and kept the first one ([0]) on its
    general path, while the fast path and the in-process backend failed to pickle it. The call fails on every path,
    saying what to write instead."""
    g = bed["e2"]
    for path in _paths(g):
        with pytest.raises(orc.WorkerError, match=r"generator object.*yield") as info:
            await g.lazy_values()
        assert info.value.endpoint == "lazy_values", path


async def test_a_numpy_array_arrives_read_only_on_every_path(bed):
    """Ray hands numpy arrays over zero-copy, read-only (in results and in arguments, of any size); the fast path
    and the in-process backend gave writable copies, so a test that wrote into one passed in-process and failed on
    Ray, or changed behaviour once a repeated call took the fast path."""
    g = bed["e2"]
    for path in _paths(g):
        got = await g.np_ones(4)
        assert [v["a"].flags.writeable for v in got] == [False, False], path
        assert await g.np_writable(np.zeros(4)) == [False, False], path


async def test_a_result_that_cannot_be_unpickled_is_a_worker_error_on_every_path(bed):
    g = bed["e2"]
    for path in _paths(g):
        with pytest.raises(orc.WorkerError, match="cannot be rebuilt") as info:
            await g.unloadable()
        assert (info.value.group, info.value.endpoint) == ("e2", "unloadable"), path


async def test_union_of_futures_joins_columns_row_by_row(bed):
    a, b = bed["e2"], bed["e3"]
    base = a.echo(xs(5))
    joined = await (a.scale_x(base) | b.plus_one(base))
    assert set(joined.keys()) == {"y", "rank", "z"}
    assert joined["y"].tolist() == [0, 1, 2, 3, 4] and joined["z"].tolist() == [1, 2, 3, 4, 5]
    assert (await b.echo(base | a.plus_one(base)))["z"].tolist() == [1, 2, 3, 4, 5]  # a union read by another call


async def test_generator_parts_arrive_in_order_and_stream_into_the_next_call(bed):
    g = bed["e2"]
    fut = g.gen(xs(8), pieces=2)
    parts = [p async for p in fut]  # in arrival order: each rank's in the order it yielded them
    assert sorted((p.slot, p.seq, p.rank, p.rows) for p in parts) == [(0, 0, 0, 2), (0, 1, 0, 2), (1, 0, 1, 2),
                                                                       (1, 1, 1, 2)]
    assert [p.seq for p in parts if p.rank == 0] == [0, 1] and [p.seq for p in parts if p.rank == 1] == [0, 1]
    assert (await fut)["x"].tolist() == list(range(8))
    mapped = await g.plus_one.options(stream=True)(g.gen(xs(8), pieces=2))
    assert sorted(mapped["z"].tolist()) == list(range(1, 9))


async def test_a_streamed_call_names_the_ranks_that_ran_each_part(bed):
    """Three upstream parts mapped over a 2-rank group: the part of upstream slot i runs on rank i mod 2, and both
    its Part and an error it raises name that rank (a rank of this group), not the upstream's."""
    e2, e3 = bed["e2"], bed["e3"]
    mapped = e2.plus_one.options(stream=True)(e3.echo(xs(3)))
    parts = sorted([(p.slot, p.rank) async for p in mapped])
    assert parts == [(0, 0), (1, 1), (2, 0)]
    assert (await mapped)["z"].tolist() == [1, 2, 3]
    with pytest.raises(orc.WorkerError, match="refused row 2 on rank 0") as info:
        await e2.refuse_row.options(stream=True)(e3.echo(xs(3)), x=2)
    assert info.value.group == "e2" and info.value.rank == 0


# -- integrity -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [8, 40_000])  # inline in the call, and stored once for every reader
async def test_a_writing_reader_changes_nothing_another_reader_or_the_caller_sees(bed, n):
    g = bed["e2"]
    mine = xs(n)
    written = await g.write_in_place(mine)
    assert written["x"].tolist()[:3] == [1000, 1001, 1002]
    assert torch.equal(mine["x"], torch.arange(n))  # the caller's batch
    up = g.echo(xs(n))
    await g.write_in_place(up)
    assert torch.equal((await up)["x"], torch.arange(n))  # the producer's stored result
    assert sum(await g.total(up)) == sum(range(n))  # a later reader of the same parts


@pytest.mark.parametrize("n", [8, 20_000])
async def test_nested_meta_and_object_rows_written_by_a_reader_stay_its_own(bed, n):
    g = bed["e2"]
    data = Batch.from_dict({"x": torch.arange(n), "obj": [{"i": i} for i in range(n)]}, meta={"tags": ["orig"]})
    up = g.echo(data)
    assert sum(await g.scribble(up)) == n
    assert await g.marks(up) == [[["orig"], 0], [["orig"], 0]]  # a later reader of the same parts
    mine = await up
    assert mine.meta["tags"] == ["orig"] and not any("mark" in r for r in mine["obj"])
    mine.meta["tags"].append("caller")  # the caller writes into its awaited value ...
    mine["obj"][0]["mark"] = "caller"
    assert await g.marks(up) == [[["orig"], 0], [["orig"], 0]]  # ... and no reader sees it
    again = await up  # nor does a second await
    assert again.meta["tags"] == ["orig"] and "mark" not in again["obj"][0]
    assert data.meta["tags"] == ["orig"] and not any("mark" in r for r in data["obj"])


async def test_an_awaited_value_changed_by_the_caller_is_not_what_a_later_reader_gets(bed):
    g = bed["e2"]
    fut = g.make_value()
    values = await fut
    values[0]["k"] = "changed by the caller"
    values[0]["lst"].append(99)
    assert await g.take_value(fut) == [[{"k": "orig", "lst": [1]}] * 2] * 2
    assert (await fut)[0] == {"k": "orig", "lst": [1]}


async def test_a_bytes_value_comes_back_as_bytes(bed):
    """A reply that is a frame is bytes on the wire: a bytes value an endpoint returns still comes back as itself,
    awaited, awaited again and forwarded."""
    g = bed["e2"]
    value = b"\x00\x01 looks like a frame"
    fut = g.take_value(value)
    assert await fut == [value, value]
    assert await fut == [value, value]
    assert await g.take_value(fut) == [[value, value]] * 2


async def test_bytes_like_values_come_back_as_themselves(bed):
    """A reply frame is bytes on the wire: a bytes-like value (Ray hands a bytearray or a bytes subclass back as
    plain bytes) is never read as one, even when it holds what a frame would (it came back as ``{'evil': 1}``)."""
    import pickle

    import numpy as np

    g = bed["e2"]
    looks_like_a_frame = b"\x00" + pickle.dumps({"evil": 1})
    for value in (bytearray(looks_like_a_frame), np.bytes_(looks_like_a_frame), np.bytes_(b"abc")):
        fut = g.take_value(value)
        for got in (await fut, await fut, await g.take_value(fut)):
            flat = got if not isinstance(got[0], list) else [x for row in got for x in row]
            assert all(type(x) is type(value) and x == value for x in flat), (value, got)


async def test_writes_into_a_plain_value_from_outputs_reach_no_await(bed):
    """``outputs()`` hands out its own copy of a plain value, as of rows: a write into it changes neither the first
    await (which takes the reply as received) nor a later ``outputs()``; and a write into what the first await gave
    changes no ``outputs()``."""
    g = bed["e2"]
    fut = g.make_value()
    for outs in await fut.outputs():
        outs[0].value["k"] = "changed through outputs"
        outs[0].value["lst"].append(99)
    assert [o[0].value for o in await fut.outputs()] == [{"k": "orig", "lst": [1]}] * 2
    first = await fut
    assert first == [{"k": "orig", "lst": [1]}] * 2
    first[1]["lst"].append(7)
    assert [o[0].value for o in await fut.outputs()] == [{"k": "orig", "lst": [1]}] * 2


async def test_each_await_of_a_union_is_private_and_never_the_callers_batch(bed):
    """A union's await is a private copy, as a plain future's is: writing into one await changes neither a later
    await (of the same union object or a new one) nor a Batch of the caller's that the union joins."""
    g = bed["e2"]
    f1, f2 = g.echo(xs(4)), g.plus_one(xs(4))
    u = f1 | f2
    first = await u
    first["x"].add_(50)
    first["z"].add_(50)
    for again in (await u, await (f1 | f2)):
        assert again["x"].tolist() == [0, 1, 2, 3] and again["z"].tolist() == [1, 2, 3, 4]
    mine = Batch.from_dict({"w": torch.zeros(4)}, meta={"tags": ["orig"]})
    joined = await (mine | f2)
    joined["w"].add_(3)
    joined.meta["tags"].append("caller")
    assert mine["w"].tolist() == [0.0] * 4 and mine.meta["tags"] == ["orig"]


@pytest.mark.parametrize("awaited", [True, False], ids=["headers known", "upstream running"])
async def test_a_pad_read_over_rows_padded_on_their_own_runs_on_no_rank(bed, awaited):
    """5 rows, the last the upstream's own pad_to_multiple padding, read by a shard(pad=True) call over 3 ranks: pad()
    would pad them again and no piece could say which rows are whose. The controller refuses when it has the part
    headers; else every rank refuses alike (a rank whose share did not wrap around used to run)."""
    e2, e3 = bed["e2"], bed["e3"]
    fut = e2.echo(xs(4).pad_to_multiple(5))  # echo keeps the pad count: the result's last row is padding
    if awaited:
        await fut
    before = await e3.seen_calls()
    with pytest.raises((orc.DispatchError, orc.WorkerError), match=r"1 padding row\(s\) of their own") as info:
        await e3.padded(fut)
    if awaited:
        assert isinstance(info.value, orc.DispatchError)
    assert await e3.seen_calls() == before
    assert (await e3.padded(e2.echo(xs(4).pad_to_multiple(5).unpad())))["n"].tolist() == [2] * 4


@pytest.mark.parametrize("reader", ["e2", "e3"], ids=["rank i reads rank i", "rows split anew"])
async def test_a_future_whose_ranks_results_do_not_join_is_read_by_no_rank(bed, reader):
    """``await`` refuses a future whose ranks returned different columns; a call given it read it rank by rank (its
    rank 0 with column y, its rank 1 without). With the headers here, the controller refuses it before sending."""
    e2, g = bed["e2"], bed[reader]
    fut = e2.rank_one_without_y(xs(6))
    await fut.wait()
    before = await g.seen_calls()
    with pytest.raises(orc.DispatchError, match=r"'rank_one_without_y' is not one Batch.*rank 1.*rank 0.*columns"):
        await g.echo(fut)
    assert await g.seen_calls() == before
    if reader == "e3":  # sent at once: the controller refuses by the headers here, each reader alike by all
        with pytest.raises((orc.DispatchError, orc.WorkerError), match=r"not one Batch|do not join into one Batch"):
            await g.echo(e2.rank_one_without_y(xs(6)))
        assert await g.seen_calls() == before


async def test_a_value_the_wire_would_drop_fails_the_call_before_sending(bed):
    """A non-tensor value put into a Batch's TensorDict after it was made (``b.tensors[k] = ...``) was dropped on the
    wire without a word; now the call is refused naming it, on either backend, and runs on no rank."""
    e2 = bed["e2"]
    before = await e2.seen_calls()
    b = xs(4)
    b.tensors["s"] = "hello"
    with pytest.raises(orc.DispatchError, match=r"cannot travel.*'s'"):
        await e2.echo(b)
    assert await e2.seen_calls() == before


async def test_a_padded_endpoint_must_return_a_row_per_input_row(bed):
    with pytest.raises(orc.WorkerError, match="one row per input row") as info:
        await bed["e3"].padded_short(xs(7))
    assert info.value.endpoint == "padded_short"


async def test_a_future_of_an_in_process_group_is_refused_by_a_ray_group(bed, backend):
    if backend != "ray":
        pytest.skip("needs a Ray group to send to")
    async with WorkerGroup(ResourcePool([1], backend="local"), Echo, group_name="inproc") as local:
        fut = local.echo(xs(4))
        with pytest.raises(orc.DispatchError, match="in-process") as info:
            await bed["e2"].plus_one(fut)
        assert "e2" in str(info.value) and "plus_one" in str(info.value)
        await fut
    assert bed["e2"].calls_in_flight() == []


async def test_a_dispatch_whose_final_plan_loses_rows_or_values_is_refused_before_sending(bed):
    g = bed["e3"]
    before = await g.seen_calls()
    with pytest.raises(orc.DispatchError, match=r"rank\(s\) \[1\] would not run") as info:
        g.shard_even(xs(6))
    assert "'e3'" in str(info.value) and "shard_even" in str(info.value)
    with pytest.raises(orc.DispatchError, match=r"from_rank\(1\)"):
        g.only0_from1()
    assert await g.seen_calls() == before and g.calls_in_flight() == []


async def test_a_call_that_cannot_be_sent_to_one_rank_runs_on_none(bed):
    g = bed["e2"]
    before = await g.seen_calls()
    with pytest.raises(orc.DispatchError, match="argument 0"):
        await g.take(threading.Lock())
    objs: list = [1, 2, 3, threading.Lock()]  # rank 1's rows cannot be serialized
    with pytest.raises(orc.DispatchError, match="rank 1") as info:
        await g.echo(Batch.from_dict({"x": torch.arange(4), "obj": objs}))
    assert "'obj'" in str(info.value)
    assert await g.seen_calls() == before


# -- errors ----------------------------------------------------------------------------------------------------------
async def test_a_worker_error_names_group_rank_and_endpoint(bed):
    g = bed["e2"]
    with pytest.raises(orc.WorkerError) as info:
        await g.fail_here(1)
    e = info.value
    assert (e.group, e.rank, e.endpoint, e.exc_type) == ("e2", 1, "fail_here", "ValueError")
    assert "refused on rank 1" in str(e) and "fail_here" in e.remote_traceback
    assert await g.fail_here(5) == [0, 1]  # the group still works


async def test_an_upstream_failure_is_reported_as_the_upstreams_own(bed):
    a, b = bed["e3"], bed["e2"]
    with pytest.raises(orc.WorkerError) as info:
        await b.plus_one(a.fail_shard(xs(4)))
    assert info.value.group == "e3" and info.value.endpoint == "fail_shard"
    assert info.value.exc_type == "KeyError"


@pytest.mark.parametrize("fast", [True, False])
async def test_a_failure_on_a_rank_whose_value_is_not_kept_fails_the_readers_of_the_call(bed, fast):
    """from_rank(0) keeps rank 0's value, but rank 1 failing fails the call: a reader of its future fails with
    rank 1's own error instead of computing on rank 0's value (on Ray, the failing call rides the fast path)."""
    g = bed["e2"]
    was, g.fast_path = g.fast_path, fast
    try:
        for _ in range(5):  # repeated small calls: the group's fast path opens (Ray only)
            assert await g.from_zero(1) == 1
        await fail_rank(g, 1, "from_zero", "rank 1 refused")
        up = g.from_zero(5)
        with pytest.raises(orc.WorkerError) as info:
            await g.take_value(up)
        assert (info.value.group, info.value.rank, info.value.endpoint) == ("e2", 1, "from_zero")
        assert "rank 1 refused" in str(info.value)
        with pytest.raises(orc.WorkerError, match="rank 1 refused"):
            await up
    finally:
        g.fast_path = was


async def test_a_failure_on_a_mesh_rank_that_does_not_report_fails_the_readers_of_the_call(bed):
    """A TP peer that is not its replica's collector fails: the rows its collector reported are not a result, so
    a call reading the future fails with the peer's own error."""
    mesh, e2 = bed["mesh"], bed["e2"]
    await fail_rank(mesh, 1, "compute", "TP peer refused")
    up = mesh.compute(xs(4))
    with pytest.raises(orc.WorkerError) as info:
        await e2.echo(up)
    assert (info.value.group, info.value.rank, info.value.endpoint) == ("mesh", 1, "compute")
    with pytest.raises(orc.WorkerError, match="TP peer refused"):
        await up
    await fail_rank(mesh, 1, "compute", "TP peer refused")
    with pytest.raises(orc.WorkerError, match="TP peer refused") as info:  # mapped part by part, too
        await e2.echo.options(stream=True)(mesh.compute(xs(4)))
    assert (info.value.group, info.value.rank) == ("mesh", 1)


async def test_fail_rank_makes_one_ranks_next_call_fail(bed):
    g = bed["e2"]
    await fail_rank(g, 1, "scale_x", "injected here")
    with pytest.raises(orc.WorkerError) as info:
        await g.scale_x(xs(4))
    assert info.value.rank == 1 and info.value.exc_type == "InjectedFailure"
    assert (await g.scale_x(xs(4)))["y"].tolist() == [0, 1, 2, 3]


async def test_an_init_error_names_the_rank(backend):
    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.1, backend=backend), BadInit, 1)
    try:
        with pytest.raises(orc.WorkerError) as info:
            await g.ready()
        assert info.value.rank == 1 and info.value.endpoint == "__init__" and "cannot start" in str(info.value)
    finally:
        await g.aclose()


async def test_closing_a_group_twice_or_a_failed_start_leaves_a_shared_pools_other_group_running(backend):
    """Two groups share one slot (max_colocate_count=2). Closing one twice, and a third group whose start failed
    (closed by ``async with`` and again), give back only their own share of the pool: the other group's ranks
    keep running (on Ray its placement group stays) and the pool is released when that group closes."""
    pool = ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01, max_colocate_count=2, backend=backend)
    keep = WorkerGroup(pool, Echo, group_name="keep")
    try:
        other = WorkerGroup(pool, Echo, group_name="other")
        await other.ready()
        await other.aclose()
        other.shutdown()
        bad = WorkerGroup(pool, BadInit, 0, group_name="bad")
        with pytest.raises(orc.WorkerError, match="cannot start"):
            async with bad:
                pass
        await bad.aclose()
        assert pool.holds_refs()
        assert (await keep.whoami())[0]["rank"] == 0
        assert [h["alive"] for h in keep.health()] == [True]
    finally:
        await keep.aclose()
    assert not pool.holds_refs()


async def test_a_pool_that_cannot_fit_is_refused_with_what_it_needs(backend):
    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=10_000, backend=backend), Echo)
    try:
        with pytest.raises(orc.PlacementError, match="CPU: need 20000"):
            await g.ready()
    finally:
        await g.aclose()


# -- cancellation, deadlines, shutdown and death -------------------------------------------------------------------
async def test_cancel_ends_the_call_on_every_rank(bed, seq):
    g = bed["e2"]
    fut = g.hold_until_cancelled(seq)
    async with seq(2):  # ranks 0 and 1 passed positions 0 and 1: the call runs on both
        pass
    fut.cancel()
    with pytest.raises(orc.CallCancelledError):
        await fut
    assert await g.take_outcomes() == [["cancelled"], ["cancelled"]]
    assert g.calls_in_flight() == []


async def test_cancelling_a_streamed_call_skips_the_parts_still_queued_on_the_rank_that_runs_them(bed, seq):
    """Three upstream parts mapped over 2 ranks: parts 0 and 2 run on rank 0, one after the other. Cancelled while
    parts 0 and 1 run, the call ends both and part 2, queued on rank 0, never starts. (The upstream finishes first:
    stream() sends each part as it arrives, so an upstream slot 2 done before slot 0 would reach rank 0 first.)"""
    e2, e3 = bed["e2"], bed["e3"]
    up = e3.echo(xs(3))
    await up.wait()
    fut = e2.hold_part_until_cancelled.options(stream=True)(up, seq)
    async with seq(2):  # parts 0 and 1 passed positions 0 and 1: both run
        pass
    fut.cancel()
    with pytest.raises(orc.CallCancelledError):
        await fut
    assert await e2.take_outcomes() == [["part 0 started", "part 0 cancelled"], ["part 1 started", "part 1 cancelled"]]
    assert e2.calls_in_flight() == []


async def test_a_call_cancelled_while_it_waits_for_a_forwarded_input_never_runs_its_endpoint(bed, seq):
    """Both ranks of ``down`` started and wait for ``up``'s rows; cancelled then, ``down`` does not run its body
    once the rows arrive (a trainer would otherwise take an optimizer step the caller was told did not happen)."""
    e2, e3 = bed["e2"], bed["e3"]
    fast = e3.fast_path
    e3.fast_path = False  # up's result then stays on its ranks: down is sent at once and waits there for the rows
    try:
        up = e3.gate_rows(xs(3), seq)
        down = e2.mark_rows(up)
        with anyio.fail_after(60):  # bounded wait for a condition (not a result): both ranks entered the call
            while [s.get("mark_rows", {}).get("calls", 0) for s in await e2.stats()] != [1, 1]:
                await anyio.sleep(0.01)
        down.cancel()
        with pytest.raises(orc.CallCancelledError):
            await down
        async with seq(0):  # now up's ranks pass positions 1, 2, 3 and return
            pass
        assert (await up)["x"].tolist() == [0, 1, 2]
        assert await e2.take_outcomes() == [[], []]  # runs after down's calls on each rank's lane
    finally:
        e3.fast_path = fast
        await e2.reset_stats()
    assert e2.calls_in_flight() == []


async def test_an_aligned_reader_on_other_processes_starts_each_rank_when_its_upstream_rank_finished(bed, make_group,
                                                                                                     seq):
    """DP replica i of a shard call reads upstream rank i's rows: with the upstream on other processes the call is
    sent at once, and rank 0 runs while upstream rank 1 is still running (stages overlap rank by rank)."""
    e2 = bed["e2"]
    other = await make_group(Echo, ranks=2)
    up = e2.gate_rows(xs(4), seq)  # rank 0 (rows 0, 1) passes position 1; rank 1 (rows 2, 3) position 3
    down = other.mark_rows(up)
    async with seq(0):
        pass
    async with seq(2):  # upstream rank 0 returned; rank 1 waits for this block to end
        with anyio.fail_after(60):  # bounded wait for a condition (not a result): reader rank 0 ran its body
            while [s.get("mark_rows", {}).get("rows_out", 0) for s in await other.stats()] != [2, 0]:
                await anyio.sleep(0.01)
    assert (await down)["x"].tolist() == [0, 1, 2, 3]
    assert await other.take_outcomes() == [["ran on 2 rows"], ["ran on 2 rows"]]


async def test_a_reader_waiting_for_its_input_holds_back_no_call_to_other_ranks(bed, seq):
    """``down`` runs on rank 1 only and waits there for ``up``'s rows; a later call of the same group on rank 0 runs
    meanwhile. (A reading call that waited for its inputs in the controller held back every later call of its
    group until ``up`` finished: a deadlock when ``up`` waits for such a call.)"""
    e2, e3 = bed["e2"], bed["e3"]
    up = e3.gate_rows(xs(3), seq)
    down = e2.on_rank_one(up)
    with anyio.fail_after(60):  # bounded: a result, not a timing (it hangs while up blocks if the call is held)
        assert await e2.on_rank_zero() == [0]
    async with seq(0):  # now up's ranks pass positions 1, 2, 3 and return
        pass
    assert (await down)[0]["x"].tolist() == [0, 1, 2]


async def test_a_reader_of_a_cancelled_call_gets_its_error_not_its_result(bed, seq):
    """A call cancelled while it ran has no result: its endpoint returned (as cooperative cancellation asks), yet a
    later call that reads it fails with the cancelled call's own error instead of computing on its rows."""
    e2 = bed["e2"]
    fast = e2.fast_path
    e2.fast_path = False  # up's result stays on its ranks, where down, queued behind it, reads it
    try:
        up = e2.hold_part_until_cancelled(xs(2), seq)
        down = e2.echo(up)  # made while up runs: queued behind it on each rank, reads up's rows when it starts
        async with seq(2):  # parts 0 and 1 passed positions 0 and 1: both run
            pass
        up.cancel()
        with pytest.raises(orc.CallCancelledError):
            await up
        with pytest.raises(orc.CallCancelledError) as info:
            await down
        assert "hold_part_until_cancelled" in str(info.value)
        assert await e2.take_outcomes() == [["part 0 started", "part 0 cancelled"],
                                            ["part 1 started", "part 1 cancelled"]]
    finally:
        e2.fast_path = fast
    assert e2.calls_in_flight() == []


async def test_a_deadline_names_the_running_ranks_and_cancels_them(bed, seq):
    g = bed["e2"]
    with pytest.raises(orc.CallTimeoutError) as info:
        await g.hold_until_cancelled.options(timeout=0.5)(seq)
    assert list(info.value.pending_ranks) == [0, 1]
    assert await g.take_outcomes() == [["cancelled"], ["cancelled"]]


async def test_closing_a_group_fails_its_calls_in_flight(make_group, seq):
    g = await make_group(Echo, ranks=2)
    fut = g.hold_until_cancelled(seq)
    async with seq(2):
        pass
    await g.aclose()
    with pytest.raises(orc.GroupClosedError):
        await fut
    with pytest.raises(orc.GroupClosedError):
        g.whoami()


async def test_a_dead_rank_fails_calls_in_flight_and_refuses_new_ones(make_group, seq):
    g = await make_group(Echo, ranks=2)
    fut = g.hold_until_cancelled(seq)
    async with seq(2):
        pass
    err = await kill_rank(g, 1)
    assert isinstance(err, orc.WorkerDiedError) and err.rank == 1 and not err.declared
    with pytest.raises(orc.WorkerDiedError) as info:
        await fut
    assert info.value.rank == 1
    with pytest.raises(orc.WorkerDiedError):
        g.whoami()
    assert [h["alive"] for h in g.health()] == [True, False]


async def test_a_rank_that_declares_itself_dead_is_dead_to_the_group(make_group):
    """``Worker.declare_dead`` (a rank that aborted its process groups: its blocked peers are released only when its
    process ends): supervision reports the rank dead with the reason, later calls fail with WorkerDiedError, and the
    rank runs nothing more."""
    g = await make_group(Echo, ranks=2)
    told: list[orc.WorkerDiedError] = []
    seen = anyio.Event()
    g.on_death(lambda err: (told.append(err), seen.set()))
    declaring = g.declare_dead_on(1, "my device is lost")
    queued = g.total(Batch.from_dict({"x": torch.arange(4)}))  # behind it on rank 1: refused there, as by a dead rank
    try:  # the call itself ends as usual on every rank; the death may reach the controller before its reply
        assert await declaring == [0, 1]
    except orc.WorkerDiedError as e:
        assert e.rank == 1 and "my device is lost" in str(e), e
    with pytest.raises(orc.WorkerDiedError, match="my device is lost") as queued_info:  # was a WorkerError at times
        await queued
    assert queued_info.value.declared
    # a ping says so even before the supervision call's reply is in (the runner pings to find a death behind an error)
    with pytest.raises(orc.WorkerDiedError, match="my device is lost") as pinged:
        await g.ping()
    assert pinged.value.rank == 1 and seen.is_set()
    assert [e.rank for e in told] == [1] and told[0].declared  # a supervisor can tell it from a crash
    assert "rank 1 was declared dead by its worker (role 'Echo': my device is lost); recreate the group" in \
        str(told[0]), told[0]
    with pytest.raises(orc.WorkerDiedError, match="my device is lost") as info:
        await g.total(Batch.from_dict({"x": torch.arange(4)}))
    assert info.value.rank == 1 and info.value.declared
    with pytest.raises(orc.WorkerDiedError, match="my device is lost"):  # its process answers, but it is dead
        await g.describe()
    assert [h["alive"] for h in g.health()] == [True, False]


def test_declare_dead_outside_a_group_says_so():
    with pytest.raises(RuntimeError, match="Echo.declare_dead: this Worker was not started by a WorkerGroup"):
        Echo().declare_dead("x")


@pytest.mark.parametrize("how", ["await", "async for"])
async def test_a_death_fails_the_call_while_another_rank_still_blocks(make_group, seq, how):
    """Rank 1 has answered and then dies while rank 0 is stuck (a collective waiting for its dead peer never
    returns): the await (or ``async for part in fut``) fails with WorkerDiedError as soon as the death is seen
    instead of waiting for rank 0."""
    import anyio

    g = await make_group(Echo, ranks=2)
    fut = g.hold_like_a_collective(seq)
    outcome: list[BaseException] = []
    ended = anyio.Event()

    async def awaiter() -> None:  # already waiting when the death happens
        try:
            if how == "await":
                await fut
            else:
                async for _ in fut:
                    pass
        except orc.WorkerDiedError as e:
            outcome.append(e)
        finally:
            ended.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(awaiter)
            async with seq(2):  # both ranks are running; rank 1 has answered
                pass
            await kill_rank(g, 1)
            with anyio.fail_after(30):  # only a bound on a broken build: the await ends when the death is seen
                await ended.wait()
        assert len(outcome) == 1 and outcome[0].rank == 1
    finally:
        async with seq(3):  # lets rank 0 return
            pass


def test_a_group_used_from_a_later_event_loop_still_sees_a_death(backend):
    """A script may start a group in one ``asyncio.run`` and use it in the next: supervision follows the loop the
    group is used from (registering ``on_death`` there is enough), so a death there is reported and fails the
    group's calls."""
    import asyncio
    import os
    import signal

    import anyio

    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend=backend), Echo,
                    group_name="loops")

    async def first() -> list:
        await g.ready()
        return await g.describe()

    async def second(pid: int) -> None:
        try:
            died = anyio.Event()
            g.on_death(lambda err: died.set())  # the only use of the group on this loop before the death
            if g.pool.backend.own_process:
                os.kill(pid, signal.SIGKILL)
            else:
                g.pool.backend.kill(g.actors[1])
            with anyio.fail_after(20):  # a bound on a broken build only
                await died.wait()
            assert [h["alive"] for h in g.health()] == [True, False]
            with pytest.raises(orc.WorkerDiedError):
                g.whoami()
        finally:
            await g.aclose()

    info = asyncio.run(first())
    asyncio.run(second(int(info[1]["pid"])))


def test_a_death_between_two_event_loops_is_reported_in_the_next(backend):
    """A rank that died while no loop was running is reported in the next loop by ``health()`` and fails calls,
    without any call on the group there first; an ``on_death`` registered there is told of it (in-process at
    once, when it is registered; on Ray as soon as Ray hands the supervision call's failure to the new loop)."""
    import asyncio
    import os
    import signal

    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend=backend), Echo,
                    group_name="between")

    async def first() -> list:
        await g.ready()
        return await g.describe()

    async def second() -> None:
        import anyio

        try:
            died = anyio.Event()
            g.on_death(lambda err: died.set())  # moves supervision to this loop; the death is delivered here
            if not g.pool.backend.own_process:  # the failure is already in hand: told at registration
                assert died.is_set()
            with anyio.fail_after(30):  # a bound on a broken build only
                await died.wait()
            assert [h["alive"] for h in g.health()] == [True, False]
            with pytest.raises(orc.WorkerDiedError):
                g.whoami()
        finally:
            await g.aclose()

    info = asyncio.run(first())
    if g.pool.backend.own_process:
        os.kill(int(info[1]["pid"]), signal.SIGKILL)
    else:
        g.pool.backend.kill(g.actors[1])
    asyncio.run(second())


# -- introspection ---------------------------------------------------------------------------------------------------
async def test_describe_and_stats(bed):
    g = bed["e2"]
    info = await g.describe()
    assert [d["rank"] for d in info] == [0, 1] and all(d["roles"] == ["e2"] for d in info)
    assert all({"pid", "node_ip", "node_id", "device", "meshes"} <= set(d) for d in info)
    await g.reset_stats()
    await g.scale_x(xs(5))
    st = [s["scale_x"] for s in await g.stats()]
    assert [s["calls"] for s in st] == [1, 1] and [s["rows_out"] for s in st] == [3, 2]
    assert await g.ping() == [0, 1]


async def test_a_call_from_another_thread_while_the_groups_loop_runs_is_refused(bed):
    """A group's calls live on its event loop. A call made on another loop in another thread while that loop ran
    was accepted, and under load some such calls never completed and the ranks saw the two loops' calls in
    different orders; it is now refused before anything is sent, naming what to do instead."""
    import asyncio

    g = bed["e2"]
    before = await g.seen_calls()

    async def call() -> object:
        return await g.seen_calls()

    def from_another_thread() -> object:
        return asyncio.run(call())

    with pytest.raises(RuntimeError, match=r"group 'e2'.*endpoint 'seen_calls'.*another thread.*run_coroutine_threadsafe"):
        await anyio.to_thread.run_sync(from_another_thread)
    assert await g.seen_calls() == before  # the group works
    loop = asyncio.get_running_loop()
    got = await anyio.to_thread.run_sync(
        lambda: asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=60))
    assert got == before  # handed to the group's loop, as the message says
