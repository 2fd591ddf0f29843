"""Integrity of a call on Ray: a call rejected for one rank leaves the ranks' collectives paired, and the
controller's writes into an awaited result (read from the object store) stay its own. On the session's shared
Scorer groups.

Writing readers, unions split differently, row counts from the producer and unserializable arguments are checked
in-process by tests/unit/core/test_group_semantics_local.py and on both backends by tests/contract."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import orchestra as orc
from orchestra import Batch
from orchestra import _wire as orc_wire

from orc_test_workers import Counted, Pinger, Secret, redact, unredact


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


@contextlib.asynccontextmanager
async def _on_path(g: orc.WorkerGroup, fast: bool) -> AsyncIterator[None]:
    """``g``'s calls on the fast path (its channel opened by repeated small calls) or the general path, for the
    block; the group's setting as it was after."""
    on = g.fast_path
    g.fast_path = fast
    try:
        for _ in range(6 if fast else 0):
            await g.rank_and(0)
        yield
    finally:
        g.fast_path = on


async def test_unserializable_rows_for_one_rank_run_on_no_rank(scorers):
    g4 = scorers[4]
    before = await g4.seen_calls()
    objs: list = [1] * 8
    objs[7] = threading.Lock()  # rank 3's rows (6, 7) cannot be serialized
    bad = Batch.from_dict({"x": torch.arange(8), "obj": objs})
    with pytest.raises(orc.DispatchError) as info:
        await g4.count_rows(bad)
    msg = str(info.value)
    assert "rank 3" in msg and "'obj'" in msg and g4.name in msg and "count_rows" in msg
    assert await g4.seen_calls() == before  # no rank ran it
    # a collective endpoint after the rejected call still pairs up on every rank
    out = await g4.allreduce_rows.options(timeout=60)(xs(8))
    assert out["total"].tolist() == [8] * 8


async def test_a_calls_arguments_are_pickled_once_for_the_check_and_the_send(scorers):
    """The bytes checked before any rank is sent anything are the bytes the ranks unpickle: one pickle of an argument
    that every rank is given, and one per rank when each rank's call differs (it reads its own parts), plus one when
    the call is made for a call sent later (its arguments as they were then: ``_held``)."""
    g4 = scorers[4]
    on = g4.fast_path
    g4.fast_path = False  # the general path: Ray carries each rank's frame
    try:
        Counted.pickled = 0
        assert await g4.tag_of(Counted(7)) == [7, 7, 7, 7]
        assert Counted.pickled == 1  # was 5: a check, then Ray's own pickle for each of the 4 ranks
        Counted.pickled = 0
        out = await g4.tagged(g4.echo(xs(8)), Counted(3))  # a future: each rank's frame names its own parts
        assert out["tag"].tolist() == [3] * 8 and out["x"].tolist() == list(range(8))
        assert Counted.pickled == 5  # sent after its input's call: taken as it was when made, then one per rank
    finally:
        g4.fast_path = on


async def test_an_actor_handle_given_to_ranks_keeps_its_actor_alive_after_the_caller_drops_it(scorers):
    """Ray counts who holds an actor handle only when Ray carries it: a handle pickled into a frame (or a socket)
    out of band is not counted, and its actor ended once the caller's own handle was gone."""
    import gc

    import ray

    g2 = scorers[2]
    for fast in (False, True):  # the general path, and a group whose fast path may be open
        on = g2.fast_path
        g2.fast_path = fast
        try:
            if fast:
                for _ in range(6):  # repeated small calls: the channel opens
                    await g2.get_scale()
            pinger = ray.remote(Pinger).options(num_cpus=0.01).remote()
            assert await g2.keep_handle(pinger) == [0, 1]
            del pinger
            gc.collect()
            assert await g2.call_kept_handle.options(timeout=120)() == ["pong", "pong"]
        finally:
            g2.fast_path = on


async def test_a_serializer_registered_with_ray_applies_to_every_path(scorers):
    """``ray.util.register_serializer`` decides how a value travels on Ray; a call's frame must honour it (a frozen
    copy of the pickler's table once sent such a value as it was: here, unredacted)."""
    import ray

    g2 = scorers[2]
    ray.util.register_serializer(Secret, serializer=redact, deserializer=unredact)
    try:
        for fast in (False, True):
            on = g2.fast_path
            g2.fast_path = fast
            try:
                for _ in range(6 if fast else 1):  # repeated small calls: the fast path's channel opens
                    assert await g2.text_of(Secret("password")) == ["redacted", "redacted"]
            finally:
                g2.fast_path = on
    finally:
        ray.util.deregister_serializer(Secret)
    assert await g2.text_of(Secret("password")) == ["password", "password"]


async def test_controller_writes_into_an_awaited_result_stay_private(scorers):
    g2 = scorers[2]
    fut = g2.echo_all(xs(50_000))  # broadcast: each rank's single part is the whole batch
    first = await fut
    first[0]["x"][:10] = -1
    again = await g2.total(g2.echo(xs(50_000)))
    assert int(again["t"][0]) == int(torch.arange(25_000).sum())
    assert int((await fut)[0]["x"][0]) == 0  # each await is a private copy: the edit stays in ``first``
    fresh = await g2.echo_all(fut)  # a later consumer reads the producer's bytes, not the controller's edit
    assert torch.equal(fresh[0][0]["x"], torch.arange(50_000))  # (each rank gets await's list: rank 0's first)


@pytest.mark.parametrize("how", ["large", "small by nbytes"])
async def test_a_batch_given_as_the_callers_own_object_ref_is_each_ranks_own_copy(scorers, how):
    """A Batch the caller stored itself (``ray.put``) and passed as its ref: Ray resolves it on each rank as a view
    of the object store's shared memory. The rank took it for a controller-made shard only it reads and handed it to
    the endpoint uncopied, so rank 0's write reached the stored object, and every later reader of the ref; then one
    whose ``nbytes`` was small (an object column counts 8 bytes a row) but whose pickle is not was still not
    copied."""
    import ray

    g2 = scorers[2]
    if how == "large":  # 800 KB: stored in shared memory
        batch = Batch.from_dict({"x": torch.zeros(100_000)})
    else:  # nbytes 12 000, 400 KB pickled: shared memory too
        batch = Batch.from_dict({"x": torch.zeros(1000), "text": ["t" * 400] * 1000})
    assert batch.nbytes < orc_wire.INLINE_BYTES or how == "large"
    ref = ray.put(batch)
    assert await g2.first_x(ref, write_on=0) == [-1.0, 0.0]
    assert await g2.first_x(ref) == [0.0, 0.0]
    assert float(ray.get(ref)["x"][0]) == 0.0


@pytest.mark.parametrize("held", ["list", "dict"])
async def test_a_batch_inside_the_callers_own_object_ref_is_each_ranks_own_copy(scorers, held):
    """``ray.put([batch])`` or ``ray.put({"b": batch})``: Ray resolves the list or dict with the Batch's columns in
    the object store's shared memory; only a Batch given as the ref itself was copied."""
    import ray

    g2 = scorers[2]
    batch = Batch.from_dict({"x": torch.zeros(100_000)})
    ref = ray.put([batch] if held == "list" else {"b": batch})
    assert await g2.first_x_inside(ref, write_on=0) == [-1.0, 0.0]
    assert await g2.first_x_inside(ref) == [0.0, 0.0]
    stored = ray.get(ref)
    assert float((stored[0] if held == "list" else stored["b"])["x"][0]) == 0.0


async def test_a_streamed_calls_own_object_ref_is_each_parts_own_copy(scorers):
    """stream() builds each part's call apart from the other calls: the caller's ref went without the mark that
    makes a rank copy it, so a part's write reached the stored object and the next part's call."""
    import ray

    g2 = scorers[2]
    ref = ray.put(Batch.from_dict({"x": torch.zeros(100_000)}))
    out = await g2.first_x_per_part(g2.gen(xs(8), pieces=2), ref)
    assert out["seen"].tolist() == [0.0] * 8
    assert float(ray.get(ref)["x"][0]) == 0.0


async def test_the_tp_ranks_of_a_mesh_replica_share_one_pickled_call(ray_cluster):
    """The two TP ranks of a DP replica are given the same arguments, a stored shard both read among them: one
    frame a replica (the mark naming the shared argument was a new object for each rank, so each rank's call was
    pickled apart)."""
    from orc_test_workers import MeshWorker

    async with orc.WorkerGroup(orc.ResourcePool(process_on_nodes=[4], cpus_per_worker=0.01), MeshWorker,
                               group_name="mesh_frames") as g:
        big = Batch.from_dict({"x": torch.arange(40_000)})  # 160 KB a replica: stored, read by both TP ranks
        assert await g.tagged_rows(big, Counted(1)) == [20_000, 20_000]
        Counted.pickled = 0
        assert await g.tagged_rows(big, Counted(2)) == [20_000, 20_000]
        # one pickle a replica, and one when the call was made (a large Batch: sent later, its other arguments
        # taken as they were then); was 5: one a rank
        assert Counted.pickled == 3


async def test_writes_into_a_small_results_headers_reach_no_reader(scorers):
    """A small result rides in its reply, so the controller holds its rows: ``outputs()`` and ``parts()`` hand out
    copies of them, so a write into those changes neither an await of the future nor a call it is forwarded into."""
    g2 = scorers[2]
    fut = g2.echo(xs(8))
    for outs in await fut.outputs():
        for o in outs:
            for p in o.parts:
                assert isinstance(p.ref, Batch)  # rode in the reply
                p.ref["x"][:] = -1
    async for part in fut:
        part.info.ref["x"][:] = -2
    assert (await fut)["x"].tolist() == list(range(8))
    assert (await g2.echo(fut))["x"].tolist() == list(range(8))
    assert (await g2.echo(fut))["x"].tolist() == list(range(8))


async def test_a_batch_result_travels_as_one_frame_and_reads_back_the_same(scorers):
    """On the general path a Batch result's reply is one frame (bytes, which Ray carries as they are, with no
    cloudpickle pass of its own): the first await, a second await, ``outputs()`` and a reader all get the rows the
    ranks made."""
    import ray

    g2 = scorers[2]
    on = g2.fast_path
    g2.fast_path = False
    try:
        fut = g2.echo(xs(8))
        await fut.wait()
        assert all(type(v) is bytes for v in ray.get([s.call_refs[0] for s in fut._inv.slots]))
        assert (await fut)["x"].tolist() == list(range(8))
        assert (await fut)["x"].tolist() == list(range(8))  # fetched again: the frames read once more
        assert [p.ref["x"].tolist() for outs in await fut.outputs() for o in outs for p in o.parts] == [
            [0, 1, 2, 3], [4, 5, 6, 7]]
        assert (await g2.echo(fut))["x"].tolist() == list(range(8))  # each reader rank reads its upstream's frame
        assert (await g2.echo_all(g2.echo(xs(8))))[1]["x"].tolist() == list(range(8))  # sent before it landed
    finally:
        g2.fast_path = on


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("rows", [8, 200_000])  # in a frame; over 1 MiB (kept on the fast path's ranks)
async def test_writes_into_a_batch_inside_a_plain_value_reach_no_other_reader(scorers, fast, rows):
    """A Batch inside a plain value (a dict) is each reader's own, whichever path its call took and however
    large: a write into the first await, into ``outputs()`` or on a reading rank changes no later await and no
    other reader. (The fast path unpickled every read of a small reply from the same bytes, so its tensors were
    views of them; a large one read from the object store was a writable view of its shared memory.)"""
    g2 = scorers[2]
    async with _on_path(g2, fast):
        total = float(sum(range(rows)))
        before = g2._shared.fast_calls
        fut = g2.rows_in_dict(rows)
        first = await fut
        first[0]["b"]["x"][:] = -5
        assert [float(v["b"]["x"].sum()) for v in await fut] == [total, total]
        for outs in await fut.outputs():
            outs[0].value["b"]["x"][:] = -6
        assert [float(v["b"]["x"].sum()) for v in await fut] == [total, total]
        assert await g2.scribble(fut) == [[total, total]] * 2  # each rank writes -1 into what it got
        assert await g2.scribble(fut) == [[total, total]] * 2  # the next readers got the producer's rows
        assert [float(v["b"]["x"].sum()) for v in await fut] == [total, total]
        if fast and rows == 8:
            assert g2._shared.fast_calls - before == 3  # the call and both readers took the fast path


def _sums(value: Any) -> list[float]:
    """The sums of column "x" of every Batch in ``value`` (dicts, lists and Outputs walked in order)."""
    if isinstance(value, Batch):
        return [float(value["x"].sum())]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _sums(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _sums(v)]
    return _sums(value.value) if hasattr(value, "value") else []


def _scribble(value: Any) -> None:
    """Write -7 into column "x" of every Batch in ``value``."""
    if isinstance(value, Batch):
        value["x"][:] = -7
    elif isinstance(value, dict):
        for v in value.values():
            _scribble(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _scribble(v)
    elif hasattr(value, "value"):
        _scribble(value.value)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("kind", ["with_ref", "stream"])
@pytest.mark.parametrize("rows", [8, 200_000])
async def test_a_batch_in_a_plain_value_with_a_ref_or_from_a_stream_is_each_readers_own(scorers, fast, kind, rows):
    """As above, for a plain value that also holds an ObjectRef (only Ray may carry it) and for the values a
    streaming endpoint yields: a write into one await, into ``outputs()`` or on a reading rank reaches no other
    reader. (Both came back as Ray's own objects, a large Batch in them a writable view of the object store's
    shared memory, the same memory for every reader.)"""
    g2 = scorers[2]
    async with _on_path(g2, fast):
        total = float(sum(range(rows)))
        fut = g2.rows_and_ref_in_dict(rows) if kind == "with_ref" else g2.rows_in_dicts(rows)
        want = _sums(await fut)
        assert want == [total] * len(want) and want
        _scribble(await fut)
        assert _sums(await fut) == want
        _scribble(await fut.outputs())
        assert _sums(await fut) == want
        if kind == "with_ref":
            assert await g2.scribble(fut) == [[total, total]] * 2  # each rank writes -1 into what it got
            assert await g2.scribble(fut) == [[total, total]] * 2
        assert _sums(await fut) == want


@pytest.mark.parametrize("fast", [False, True])
async def test_a_batch_result_that_cannot_travel_fails_with_its_ranks_error(scorers, fast):
    """Rows the reply cannot carry fail the call with a WorkerError naming group, rank and endpoint, on either
    path: a column that cannot be pickled, and one whose class the controller cannot import."""
    g2 = scorers[2]
    async with _on_path(g2, fast):
        with pytest.raises(orc.WorkerError, match="lock") as e:
            await g2.rows_with("lock")
        assert (e.value.group, e.value.endpoint) == (g2.name, "rows_with") and e.value.rank in (0, 1)
        with pytest.raises(orc.WorkerError, match="could not be unpickled") as e:
            await g2.rows_with("rank_class")
        assert (e.value.group, e.value.endpoint) == (g2.name, "rows_with") and e.value.rank in (0, 1)
        assert await g2.rank_and(1) == [(0, 1), (1, 1)]
