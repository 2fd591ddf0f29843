"""Group semantics on the in-process backend (no Ray): dispatch transforms, meshes, colocation, error locations,
fail-fast, deadlines, cancellation, input checks, call options, forwarding by rows, unions, and what a closed or dead
group answers.

These tests ran on the Ray test cluster (tests/integration/test_group_{dispatch,errors,forwarding}.py,
test_core_integrity.py, test_core_lifecycle.py).
What they check is decided by orchestra's controller and its ``Host``, which both backends share (docs/testing.md,
"The in-process backend"), so here each takes milliseconds instead of a Ray worker process per rank. What only Ray
shows stayed there: per-process environment and placement, the object store, streams and call order over Ray
actors, real process deaths, collectives, Ray's own error paths. The semantics the two backends must agree on are
checked on both by tests/contract.

The worker classes are the Ray tests' (``tests/integration/orc_test_workers.py``): the same code runs on both.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra._batch import balanced_sizes
from orchestra._wire import Span, reader_cuts
from orchestra.testing import kill_rank

_INTEGRATION = Path(__file__).resolve().parents[2] / "integration"
if str(_INTEGRATION) not in sys.path:
    sys.path.insert(0, str(_INTEGRATION))
from orc_test_workers import Actor, Critic, Hazard, MeshWorker, Scorer  # noqa: E402


def pool(n: int) -> ResourcePool:
    return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend="local")


def xs(n: int, **extra: Any) -> Batch:
    return Batch.from_dict({"x": torch.arange(n), **extra}, meta={"step": 7})


def rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails


@pytest.fixture(scope="module")
async def bed() -> AsyncIterator[dict[str, WorkerGroup]]:
    """The module's groups, started once: Scorers of 2, 3 and 4 ranks (scale 1.0, named s2/s3/s4), a 4-rank Scorer
    at scale 2.0 (``d4``, the dispatch tests'), a 4-rank DP x TP MeshWorker and Hazards of 2 and 4 ranks. A test
    that changes a group's state puts it back."""
    groups = {f"s{n}": WorkerGroup(pool(n), Scorer, 1.0, group_name=f"s{n}") for n in (2, 3, 4)}
    groups["d4"] = WorkerGroup(pool(4), Scorer, 2.0, group_name="d4")
    groups["mesh4"] = WorkerGroup(pool(4), MeshWorker)  # its role: "MeshWorker"
    groups["h2"] = WorkerGroup(pool(2), Hazard, group_name="h2")
    groups["h4"] = WorkerGroup(pool(4), Hazard, group_name="h4")
    try:
        await asyncio.gather(*[g.ready() for g in groups.values()])
        yield groups
    finally:
        for g in groups.values():
            await g.aclose()


# -- dispatch transforms (from test_group_dispatch.py) ---------------------------------------------------------------
async def test_shard_balanced_uneven(bed):
    out = await bed["d4"].score(xs(10))
    assert torch.equal(out["score"], torch.arange(10).double() * 2)
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]  # 10 over 4 -> 3, 3, 2, 2
    assert out.meta == {}


async def test_shard_keeps_non_tensor_columns_and_meta(bed):
    b = xs(6, name=[f"r{i}" for i in range(6)])
    out = await bed["d4"].echo(b)
    assert list(out["name"]) == [f"r{i}" for i in range(6)]
    assert out.meta == {"step": 7}
    assert torch.equal(out["x"], b["x"])


async def test_shard_pad_strips_padding(bed):
    g4 = bed["d4"]
    out = await g4.padded(xs(10))
    assert torch.equal(out["x2"], torch.arange(10) * 2)
    assert set(out["n"].tolist()) == {3}  # every rank saw an equal shard of 3 rows (12 padded)
    out = await g4.padded_pipe(xs(5))
    assert torch.equal(out["x2"], torch.arange(5) * 2)
    assert set(out["n"].tolist()) == {2}


async def test_shard_allow_empty(bed):
    out = await bed["d4"].maybe_empty(xs(2))
    assert out["x"].tolist() == [0, 1]


async def test_broadcast_scatter_rank_zero_metrics(bed):
    g4 = bed["d4"]
    assert await g4.set_scale(3.0) == [3.0] * 4
    try:
        assert await g4.get_scale() == [3.0] * 4
        assert await g4.take([10, 11, 12, 13], tag="t") == ["t10@0", "t11@1", "t12@2", "t13@3"]
        assert await g4.save("ckpt") == "ckpt:0"
        m = await g4.report()
        assert m == {"loss": 1.5, "tokens": 25.0}
        assert await g4.count(xs(10)) == {"rows": 10.0}
    finally:
        await g4.set_scale(2.0)


async def test_metrics_refuses_a_rank_value_that_is_not_a_number_naming_the_rank(bed):
    """One rank's string (or 2-element tensor) was dropped from the reduced dict without a word."""
    g4 = bed["d4"]
    with pytest.raises(TypeError, match=r"endpoint 'report': metrics\(\) needs one number per key, but rank 2 "
                                        r"returned 'tag' = 'rank2' \(str\)"):
        await g4.report(tag_rank=2)
    with pytest.raises(TypeError, match=r"endpoint 'count': metrics\(\) needs one number per key, but rank 3 "
                                        r"returned 'first' = .* \(Tensor\)"):
        await g4.count(xs(10), tag_rank=3)
    assert await g4.report() == {"loss": 1.5, "tokens": 25.0}  # the group goes on


class _RowsPerRank(D.Dispatch):
    """A user's collect: the rows of each collecting rank's result, one entry per rank (as ``collect`` is given)."""

    def collect(self, plan: D.Plan, results: list[Any]) -> Any:
        assert isinstance(results, list), type(results)
        return [(r["rank"].unique().tolist(), r["x"].tolist()) for r in results]


class _Joined(D.Dispatch):
    """A user's collect after shard(): it gets what shard() made of the per-rank results."""

    def collect(self, plan: D.Plan, results: Any) -> Any:
        return type(results).__name__, results["x"].tolist()


class _UserCollect(orc.Worker):
    """A mesh whose DP replicas run in reverse rank order (rank r serves replica n - 1 - r)."""

    def __init__(self) -> None:
        self.register_mesh("rev", dp_rank=self.world_size - 1 - self.rank, dp_size=self.world_size)

    def _tagged(self, b: Batch) -> Batch:
        out = b.clone()
        out["rank"] = torch.full((len(b),), self.rank)
        return out

    @endpoint(_RowsPerRank() | D.shard())
    def per_rank(self, b: Batch) -> Batch:
        return self._tagged(b)

    @endpoint(_RowsPerRank() | D.shard(mesh="rev"))
    def per_rank_rev(self, b: Batch) -> Batch:
        return self._tagged(b)

    @endpoint(D.shard() | _Joined())
    def joined(self, b: Batch) -> Batch:
        return self._tagged(b)

    @endpoint(D.shard())
    def echo(self, b: Batch) -> Batch:
        return b


async def test_a_users_collect_with_shard_gets_one_result_per_collecting_rank():
    """A shard call joined every rank's rows into one Batch before any collect ran, so a user's collect got a
    one-element list holding all rows, where ``collect`` promises one result per collecting rank. A transform after
    shard() gets what shard()'s collect made of them: the rows joined, in row order."""
    async with WorkerGroup(pool(3), _UserCollect, group_name="user_collect") as g:
        assert await g.per_rank(rows(7)) == [([0], [0, 1, 2]), ([1], [3, 4]), ([2], [5, 6])]
        # the collectors by the DP replica they serve (row order), here the reverse of rank order
        assert await g.per_rank_rev(rows(7)) == [([2], [0, 1, 2]), ([1], [3, 4]), ([0], [5, 6])]
        assert await g.joined(rows(7)) == ("Batch", list(range(7)))
        # its future is the controller's value, which no call can read as it is
        with pytest.raises(orc.DispatchError, match="collected into one value by the controller"):
            g.echo(g.per_rank(rows(7)))
        assert (await g.echo(rows(7)))["x"].tolist() == list(range(7))  # built-in shard: rows joined once


class _Relayout(orc.Worker):
    def __init__(self) -> None:
        self.register_mesh("m", dp_rank=self.rank, dp_size=self.world_size)

    @endpoint(D.broadcast())
    def relayout(self, same: bool) -> None:
        if same:
            self.register_mesh("m", dp_rank=self.rank, dp_size=self.world_size)
        else:
            self.register_mesh("m", dp_rank=0, dp_size=1, is_collector=self.rank == 0)

    @endpoint(D.shard(mesh="m"))
    def rows_seen(self, b: Batch) -> Batch:
        return Batch.from_dict({"n": torch.full((len(b),), len(b))})


async def test_a_mesh_registered_again_with_another_layout_is_refused():
    """The controller looks a mesh up once and keeps it: a rank that registered mesh 'm' again with another layout
    (DP 2 -> 1) was still sharded 2/2 while describe() showed the new layout."""
    async with WorkerGroup(pool(2), _Relayout, group_name="relayout") as g:
        assert (await g.rows_seen(rows(4)))["n"].tolist() == [2, 2, 2, 2]
        await g.relayout(same=True)  # the same layout again: nothing changes
        with pytest.raises(orc.WorkerError, match=r"register_mesh\('m'\): this rank is registered in mesh 'm' as "
                                                  r"dp_rank \d of 2 \(a collector\), and a mesh keeps its layout .* "
                                                  r"register the new layout under another name"):
            await g.relayout(same=False)
        assert (await g.rows_seen(rows(4)))["n"].tolist() == [2, 2, 2, 2]


class _PadReader(orc.Worker):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint(D.shard() | D.pad())
    def tiled(self, b: Batch) -> Batch:
        self.calls += 1
        out = b.repeat(2, interleave=False).slice(0, len(b))  # rows picked by position: the filler rows not last
        out["pad_seen"] = torch.full((len(b),), b.pad_count)
        return out

    @endpoint(D.broadcast())
    def seen(self) -> int:
        return self.calls


async def test_a_pad_calls_filler_rows_are_rows_like_any_to_its_endpoint():
    """pad()'s filler rows are the controller's to drop (it knows how many each rank got): the pieces a rank gets
    carry no pad count of them. With the pad count travelling through split, a rank's piece said 1, and picking its
    rows so that a filler row was not last raised."""
    async with WorkerGroup(pool(4), _PadReader, group_name="pad_reader") as g:
        out = await g.tiled(rows(5))  # padded to 8: 2 rows a rank
        assert out["x"].tolist() == [0, 1, 2, 3, 4] and out["pad_seen"].tolist() == [0] * 5
        with pytest.raises(orc.DispatchError, match=r"pad\(\) would pad a batch that has 1 padding row\(s\) of its "
                                                    r"own \(pad_to_multiple\).*unpad\(\) it first"):
            g.tiled(rows(5).pad_to_multiple(8).slice(0, 6))


class _Tagger(orc.Worker):
    @endpoint(D.shard())
    def tag(self, b: Batch) -> Batch:
        out = b.clone()  # the input's pad count comes back with its rows
        out["y"] = b["x"] * 10
        return out


async def test_a_pad_read_wrapping_around_a_padded_upstream_result_is_refused_naming_pad_to_multiple():
    """A shard(pad=True) reader whose last share wraps to the first rows joined [the upstream's last rows, ending in
    its padding rows] + [the first rows], which concat refused (padding followed by real rows), naming batches the
    user never sees. Then the wrapped read dropped the upstream's pad count: its filler row came back as a real row
    ([0, 1, 2, 3, 0] with pad count 0, so unpad() kept it). Refused now, as the same rows given as a Batch are."""
    async with WorkerGroup(pool(1), _Tagger, group_name="tagger") as up, \
            WorkerGroup(pool(3), _PadReader, group_name="pad_reader3") as down:
        src = rows(4).pad_to_multiple(5)  # 4 rows + 1 padding row
        with pytest.raises((orc.DispatchError, orc.WorkerError),  # the controller's when the headers are here
                           match=r"1 padding row\(s\) of their own \(pad_to_multiple\).*unpad\(\)"):
            await down.tiled(up.tag(src))
        out = await down.tiled(up.tag(src.unpad()))  # unpadded first: 4 rows over 3 ranks, pad()'s fillers dropped
        assert out["x"].tolist() == [0, 1, 2, 3] and out["pad_seen"].tolist() == [0] * 4


@pytest.mark.parametrize("awaited", [True, False], ids=["headers known", "upstream running"])
async def test_a_pad_read_over_a_padded_upstream_result_runs_on_no_rank(awaited):
    """6 rows, the last 2 the upstream's own padding, read by a pad() call over 4 ranks (padded to 8 again): no
    share wraps around, so no rank saw the conflict, and the rank reading rows 4-5 got them as its rows, with a pad
    count of 2 that no one drops. The same rows given as a Batch are refused before sending; now the part headers
    carry their padding, so the controller refuses them when it has the headers, and every rank alike when not."""
    async with WorkerGroup(pool(1), _Tagger, group_name="tagger6") as up, \
            WorkerGroup(pool(4), _PadReader, group_name="pad_reader4") as down:
        fut = up.tag(rows(4).pad_to_multiple(6))
        if awaited:
            await fut
        with pytest.raises((orc.DispatchError, orc.WorkerError),
                           match=r"2 padding row\(s\) of their own \(pad_to_multiple\).*unpad\(\)") as info:
            await down.tiled(fut)
        if awaited:  # the controller had the headers: nothing was sent
            assert isinstance(info.value, orc.DispatchError) and "'pad_reader4'" in str(info.value)
        assert await down.seen() == [0, 0, 0, 0]
        out = await down.tiled(up.tag(rows(6)))  # a multiple of nothing: padded by pad() alone, fillers dropped
        assert out["x"].tolist() == list(range(6)) and out["pad_seen"].tolist() == [0] * 6


class _RankChoice(orc.Worker):
    @endpoint(D.broadcast() | D.only_ranks(2, 0))
    def who(self) -> int:
        return self.rank

    @endpoint(D.broadcast() | D.only_ranks(1, 0) | D.metrics())
    def bad_metric(self) -> dict:
        return {"loss": "oops" if self.rank == 1 else 0.5}

    @endpoint(D.broadcast() | D.rank_zero() | D.only_ranks(1))
    def zero_then_one(self) -> int:
        return self.rank

    @endpoint(D.only_ranks(1) | D.rank_zero())
    def one_then_zero(self) -> int:
        return self.rank

    @endpoint(D.only_ranks(2, 0) | D.rank_zero())
    def zero_among_others(self) -> int:
        return self.rank

    @endpoint(D.only_ranks(1) | D.from_rank(1))  # what the refusal of one_then_zero says to write instead
    def one_then_from_one(self) -> int:
        return self.rank


async def test_only_ranks_results_in_rank_order_and_rank_zero_keeps_rank_zero():
    """``only_ranks(2, 0)`` gave ``[rank 2, rank 0]`` and ``metrics()`` after it blamed the wrong rank;
    ``rank_zero() | only_ranks(1)`` gave rank 1's value as rank zero's, and ``only_ranks(1) | rank_zero()`` ran
    rank 0, dropping only_ranks(1) without a word."""
    async with WorkerGroup(pool(3), _RankChoice, group_name="rank_choice") as g:
        assert await g.who() == [0, 2]
        with pytest.raises(TypeError, match=r"metrics\(\) needs one number per key, but rank 1 returned 'loss'"):
            await g.bad_metric()
        with pytest.raises(orc.DispatchError, match=r"only_ranks\(1\): rank\(s\) \[1\] would run although an "
                                                    r"earlier transform chose rank\(s\) \[0\]"):
            g.zero_then_one()
        with pytest.raises(orc.DispatchError, match=r"endpoint 'one_then_zero': rank_zero\(\) runs rank 0, but "
                                                    r"only rank\(s\) \[1\] run before it"):
            g.one_then_zero()
        assert await g.zero_among_others() == 0
        assert await g.one_then_from_one() == 1


async def test_function_broadcast_with_sharded_data(bed):
    out = await bed["d4"].apply(lambda t: t * t, xs(9))
    assert torch.equal(out["out"], torch.arange(9) ** 2)


async def test_async_endpoint(bed):
    assert await bed["d4"].async_value(3) == [30, 31, 32, 33]


async def test_mesh_dispatch_replicates_to_tp_ranks_and_collects_from_collectors(bed):
    g = bed["mesh4"]
    await g.reset_stats()
    out = await g.compute(xs(10))
    assert torch.equal(out["x"], torch.arange(10))
    assert out["dp"].tolist() == [0] * 5 + [1] * 5
    assert out["rank"].tolist() == [0] * 5 + [2] * 5  # collectors only
    stats = await g.stats()
    # both TP ranks of a replica got the same 5 rows
    assert [s["compute"]["rows_used"] for s in stats] == [5, 5, 5, 5]
    out = await g.compute_padded(xs(3))
    assert torch.equal(out["x"], torch.arange(3)) and set(out["n"].tolist()) == {2}
    d = await g.describe()
    assert d[1]["meshes"]["MeshWorker"]["actor"] == {"dp_rank": 0, "dp_size": 2, "is_collector": False}
    with pytest.raises(orc.DispatchError, match="never called self.register_mesh"):
        await g.unregistered(xs(4))
    # the mesh is cached: a second call sends at once
    assert g.cached_mesh("actor") is not None


async def test_colocated_roles_share_processes():
    """(From test_group_errors.py.) In-process every rank shares the test's pid, so the pid check is trivially
    true here: that colocated roles share one Ray process is checked on Ray by the contract's
    test_colocated_roles_share_each_rank. What this adds: per-role init arguments, the view's name, unknown roles."""
    views = WorkerGroup.colocate(pool(2), {"actor": Actor, "critic": Critic}, actor={"lr": 0.5}, critic=(1.0,))
    actor, critic = views["actor"], views["critic"]
    try:
        await actor.ready()
        assert await actor.pid() == await critic.pid()
        assert await actor.get_lr() == [0.5, 0.5]
        out = await critic.values(rows(5))
        assert torch.equal(out["v"], torch.arange(5).double() + 1.0)
        d = await critic.describe()
        assert d[0]["roles"] == ["actor", "critic"]
        assert actor.name == "actor+critic/actor"
        with pytest.raises(TypeError, match="unknown role"):
            WorkerGroup.colocate(pool(1), {"a": Actor}, b={})
    finally:
        await actor.aclose()


# -- errors, deadlines, cancellation, bad input (from test_group_errors.py) ------------------------------------------
async def test_worker_error_names_location_and_fails_fast(bed, seq):
    g3 = bed["s3"]
    with pytest.raises(orc.WorkerError) as info:
        # ranks 0 and 2 run (positions 0, 1) before rank 1 fails (position 2); then they wait for position 3,
        # which the test holds: the error must come while they still run
        await g3.fail_on(1, seq, [[0, 4], [2], [1, 5]])
    # did not wait for the other ranks: they still waited for positions 4 and 5 behind the test's 3. The failure
    # cancelled their call, so their Sequencer waits gave 4 and 5 back (``fail_on`` does not look at cancelled(),
    # the wait does): the test enters them itself
    async with seq(3):
        pass
    for p in (4, 5, 6):
        async with seq(p):
            pass
    e = info.value
    assert type(e) is orc.WorkerError
    assert (e.group, e.rank, e.endpoint, e.exc_type) == (g3.name, 1, "fail_on", "ValueError") and g3.name == "s3"
    assert "boom on 1" in str(e) and "Traceback" in e.remote_traceback and "fail_on" in e.remote_traceback
    assert await g3.get_scale() == [1.0] * 3


async def test_upstream_error_surfaces_downstream(bed):
    g3 = bed["s3"]
    # the upstream result lacks the column that score requires: the worker rejects it with the location
    with pytest.raises(orc.WorkerError, match="missing column") as info:
        await g3.score(g3.echo(Batch.from_dict({"y": torch.arange(6)})))
    assert info.value.endpoint == "score"
    # an upstream failure fails the forwarded call with the upstream's own error
    with pytest.raises(orc.WorkerError, match="missing column") as info:
        await g3.plus_one(g3.score(g3.echo(Batch.from_dict({"y": torch.arange(6)}))))
    assert info.value.endpoint == "score"
    # a future of one value per rank (broadcast) is not rows: refused when the call is made, before sending
    with pytest.raises(orc.DispatchError, match="one value per rank"):
        g3.score(g3.get_scale())


async def test_deadline_names_running_ranks_and_cancels_work(bed):
    g3 = bed["s3"]
    await g3.take_outcomes()
    with pytest.raises(orc.CallTimeoutError) as info:
        await g3.hold_until_cancelled.options(timeout=0.5)()  # ends only when cancelled
    assert isinstance(info.value, TimeoutError)
    assert info.value.pending_ranks == (0, 1, 2)
    assert "rank(s) [0, 1, 2] still running" in str(info.value)
    # every rank stopped because of the deadline's cancel: it saw it while running, or skipped the queued call
    assert all(o in ([], ["cancelled"]) for o in await g3.take_outcomes())
    assert await g3.get_scale() == [1.0] * 3


async def test_cancelling_the_awaiting_task_cancels_the_ranks_work(bed, seq):
    g3 = bed["s3"]
    await g3.take_outcomes()

    async def waiter():
        return await g3.hold_until_cancelled(seq)

    task = asyncio.create_task(waiter())
    async with seq(3):  # ranks 0..2 passed positions 0..2: the call runs on every rank
        pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await g3.take_outcomes() == [["cancelled"]] * 3  # each running rank saw the cancel and stopped
    assert await g3.get_scale() == [1.0] * 3


async def test_bad_input_rejected_before_sending(bed):
    g3 = bed["s3"]
    await g3.reset_stats()
    with pytest.raises(orc.DispatchError, match=r"missing column\(s\) \['x'\]"):
        g3.score(Batch.from_dict({"y": torch.arange(6)}))
    with pytest.raises(orc.DispatchError, match="2 rows cannot be sharded over 3"):
        g3.score(rows(2))
    with pytest.raises(orc.DispatchError, match="argument 0 has 2 entries but the group has 3 ranks"):
        g3.take([1, 2])
    with pytest.raises(orc.DispatchError, match="signature"):
        g3.score(rows(6), 1, 2)
    with pytest.raises(orc.DispatchError, match="needs at least one Batch"):
        g3.score(None)
    with pytest.raises(AttributeError, match="has no endpoint 'nope'"):
        g3.nope
    stats = await g3.stats()
    assert all("score" not in s or s["score"]["calls"] == 0 for s in stats)


async def test_arguments_are_checked_against_the_signature_on_every_call_not_only_the_first(bed):
    """A call binds its arguments to the endpoint's signature once per argument shape (count, keyword names), so
    a shape that bound before is not bound again; any other shape still is, on the endpoint and its options."""
    g3 = bed["s3"]
    assert len(await g3.score(rows(6))) == 6  # this shape binds
    assert len(await g3.score(batch=rows(6))) == 6
    for call in (lambda: g3.score(rows(6), 1), lambda: g3.score(), lambda: g3.score(rows(6), batch=rows(6)),
                 lambda: g3.score(other=rows(6)), lambda: g3.score.options(timeout=5)(rows(6), 1)):
        with pytest.raises(orc.DispatchError, match=r"signature is score\(self, batch"):
            call()
    assert len(await g3.score.options(timeout=5)(rows(6))) == 6
    with pytest.raises(orc.DispatchError, match="signature"):
        g3.score(rows(6), 1)  # still refused after the options call bound the good shape


# -- forwarding by rows (from test_group_forwarding.py) ----------------------------------------------------------------
@pytest.mark.parametrize(
    "src,dst,n,parts_in,rows_in",
    [
        (4, 2, 10, [2, 3], [6, 7]),        # producer 3,3,2,2 -> consumer [0,5) [5,10)
        (2, 4, 10, [1, 2, 1, 1], [5, 10, 5, 5]),  # producer 5,5 -> consumer 3,3,2,2
        (3, 4, 11, [1, 2, 2, 1], [4, 8, 7, 3]),   # producer 4,4,3 -> consumer 3,3,3,2
        (2, 2, 9, [1, 1], [5, 4]),          # aligned: part i -> rank i
    ],
)
async def test_forwarding_fetches_only_overlapping_parts(bed, src, dst, n, parts_in, rows_in):
    a, b = bed[f"s{src}"], bed[f"s{dst}"]
    await b.reset_stats()
    orc.reset_controller_stats()
    up = a.echo(rows(n))
    down = b.plus_one(up)
    out = await down
    assert torch.equal(out["y"], torch.arange(n) + 1)
    st = [s["plus_one"] for s in await b.stats()]
    assert [s["parts_in"] for s in st] == parts_in
    assert [s["rows_in"] for s in st] == rows_in
    assert [s["rows_used"] for s in st] == [len(c) for c in rows(n).chunk(dst)]
    # the controller fetched the consumer's result only, never the upstream payload
    assert orc.controller_stats()["bytes_materialized"] == out.nbytes


@pytest.mark.parametrize("src,dst", [(4, 2), (2, 4), (3, 4), (4, 3), (2, 2)])
async def test_large_outputs_are_cut_where_their_readers_start_so_each_reads_exactly_its_rows(bed, src, dst):
    """Over INLINE_BYTES a producer knows where its rows sit (its share of a controller-made batch, then of each
    forwarded future) and cuts its parts at every open group's reader boundaries: a reshard reads no row twice."""
    a, b = bed[f"s{src}"], bed[f"s{dst}"]
    n = 48  # 8 KiB a row: every rank's output is over INLINE_BYTES (64 KiB)
    big = Batch.from_dict({"x": torch.arange(n), "w": torch.ones(n, 2048)})
    await a.reset_stats()
    await b.reset_stats()
    first = a.echo(big)
    out = await b.plus_one(a.echo(first))  # the second echo reads its rows from the first: the place carries over
    assert torch.equal(out["y"], torch.arange(n) + 1)
    for g, name in ((a, "echo"), (b, "plus_one")):
        st = [s[name] for s in await g.stats()]
        assert [s["rows_in"] for s in st] == [s["rows_used"] for s in st], (g.name, st)
    produced = [s["echo"]["parts_out"] for s in await a.stats()]
    # cut only where a reader of 2, 3 or 4 ranks starts (at most 3 cuts per share here), not into 8 parts each
    assert all(p <= 2 * 4 for p in produced) and sum(produced) < 8 * 2 * src, produced


@pytest.mark.parametrize("src,dst", [(2, 4), (4, 3), (3, 2)])
async def test_outputs_of_n_rows_per_input_row_are_cut_where_their_readers_start(bed, src, dst):
    """A result of ``n`` rows per input row (a rollout of n samples a prompt) sits at n times its input's place, if
    every rank returns n per row: it is cut where its readers start, and each reader reads exactly its rows."""
    a, b = bed[f"s{src}"], bed[f"s{dst}"]
    prompts = 12  # 4 samples each; 8 KiB a row: every rank's output is over INLINE_BYTES (64 KiB)
    batch = Batch.from_dict({"x": torch.arange(prompts), "w": torch.ones(prompts, 2048)})
    await a.reset_stats()
    await b.reset_stats()
    out = await b.plus_one(a.samples(batch, 4))
    assert torch.equal(out["y"], torch.arange(prompts).repeat_interleave(4) + 1)
    st = [s["plus_one"] for s in await b.stats()]
    assert [s["rows_in"] for s in st] == [s["rows_used"] for s in st], st
    # each producer rank cut its output where a reader of some open group's size starts inside it (the old rule kept
    # an output of this size whole: one part, which readers fetched whole)
    sizes, shares, start, want = a._shared.reader_sizes(), balanced_sizes(prompts, src), 0, []
    for rows in shares:
        want.append(len(reader_cuts(Span(4 * start, 4 * rows, 4 * prompts), sizes)) + 1)
        start += rows
    assert [s["samples"]["parts_out"] for s in await a.stats()] == want
    assert max(want) > 1


@pytest.mark.parametrize("src,dst", [(2, 3), (4, 3), (3, 4)])
async def test_ranks_that_disagree_on_rows_per_input_row_still_give_readers_the_right_rows(bed, src, dst):
    """Each rank guesses its output's place from its own rows; when the ranks disagree the guesses are wrong, which
    may cost readers extra parts, never wrong or missing rows."""
    a, b = bed[f"s{src}"], bed[f"s{dst}"]
    n = 40
    batch = Batch.from_dict({"x": torch.arange(n), "w": torch.ones(n, 2048)})
    out = await b.plus_one(a.uneven_samples(batch))
    shares = batch["x"].split(balanced_sizes(n, src))
    want = torch.cat([s.repeat_interleave(1 + r % 2) for r, s in enumerate(shares)]) + 1
    assert torch.equal(out["y"], want)


class _FiveReplicas(orc.Worker):
    """DP=5 x TP=2 on 10 ranks: a DP size that no group of the module has as its rank count."""

    def __init__(self) -> None:
        self.register_mesh("actor", dp_rank=self.rank // 2, dp_size=5, is_collector=self.rank % 2 == 0)


async def test_reader_sizes_know_meshes_registered_at_start_before_any_call(bed):
    async with WorkerGroup(pool(10), _FiveReplicas, group_name="five") as g:
        await g.ready()
        assert {2, 3, 4, 5, 10} <= set(bed["s2"]._shared.reader_sizes())  # the mesh was never looked up
    assert 5 not in bed["s2"]._shared.reader_sizes()  # a closed group's readers are gone


async def test_padded_shares_read_exactly_their_rows_and_wrapped_rows(bed):
    """A padded controller-made shard keeps its rows' place (the controller names it), and a padded reader's last
    share, which wraps around to the first rows, finds a cut there too: nobody reads rows it does not use."""
    a, b, c = bed["s2"], bed["s3"], bed["s4"]
    n = 1001  # 8 KiB a row; 3 and 2 do not divide it: pad=True shares of 334 and 501 wrap 1 row to the start
    big = Batch.from_dict({"x": torch.arange(n), "w": torch.ones(n, 2048)})
    for g in (a, b, c):
        await g.reset_stats()
    up = a.padded_echo(big)  # padded controller-made shards
    mid = b.padded_echo(up)  # padded readers of a forwarded future
    out = await c.echo(mid)
    assert torch.equal(out["x"], torch.arange(n))
    for g, name in ((b, "padded_echo"), (c, "echo")):
        st = [s[name] for s in await g.stats()]
        assert [s["rows_in"] for s in st] == [s["rows_used"] for s in st], (g.name, st)


async def test_mesh_stream_from_a_different_rank_count_waits_and_sends_once(bed):
    g = bed["mesh4"]
    await g.reset_stats()
    async with WorkerGroup(pool(1), Scorer, group_name="one") as one:
        fut = one.gen(rows(6), pieces=3)
        out = await g.compute.options(stream=True)(fut)  # 1 upstream slot vs 2 DP replicas: no part-wise calls
        assert torch.equal(out["x"], torch.arange(6) + 100)
        assert [s["compute"]["calls"] for s in await g.stats()] == [1, 1, 1, 1]


# -- integrity (from test_core_integrity.py) ---------------------------------------------------------------------------
async def test_unserializable_broadcast_argument_is_rejected_before_sending(bed):
    import threading

    h4 = bed["h4"]
    before = await h4.seen_calls()
    with pytest.raises(orc.DispatchError, match="argument 'tag'"):
        await h4.mark(tag=threading.Lock())
    assert await h4.seen_calls() == before


def _jagged(lengths: list[int]) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.nested's prototype notice)
        return torch.nested.nested_tensor([torch.arange(k) for k in lengths], layout=torch.jagged)


async def test_a_column_the_wire_cannot_carry_is_refused_naming_group_endpoint_rank_and_column(bed):
    """A jagged (torch.nested) column, the natural shape of variable-length responses, cannot travel: the call is
    refused before any rank is sent anything, and the error says which column and what to pass instead (before:
    torch's '.numpy() is not supported for tensor subclasses', naming neither group, endpoint nor column)."""
    h4 = bed["h4"]
    before = await h4.seen_calls()
    b = Batch.from_dict({"x": torch.arange(4), "response": _jagged([3, 1, 4, 2])})
    with pytest.raises(orc.DispatchError) as info:
        await h4.count(b)
    msg = str(info.value)
    for part in ("group 'h4'", "endpoint 'count'", "argument 0", "rank 0", "Batch column 'response'",
                 "list of per-row tensors", "no rank was sent the call"):
        assert part in msg, (part, msg)
    assert await h4.seen_calls() == before


async def test_a_sparse_column_of_a_shard_call_is_refused_naming_it_and_a_tensor_column_is_not_blamed_on_another(bed):
    """torch cannot split a sparse column: the shard call is refused naming it, not with torch's 'aten::as_strided'.
    And a refusal of a tensor column names that column, not an object column next to it."""
    import threading

    h4 = bed["h4"]
    before = await h4.seen_calls()
    with pytest.raises(orc.DispatchError, match="Batch column 'c'.*to_dense") as info:
        await h4.count(Batch.from_dict({"x": torch.arange(4), "c": torch.eye(4).to_sparse()}))
    assert "group 'h4'" in str(info.value) and "endpoint 'count'" in str(info.value)
    both = Batch.from_dict({"x": torch.arange(4), "response": _jagged([1, 2, 3, 4]), "obj": [threading.Lock()] * 4})
    with pytest.raises(orc.DispatchError) as info:
        await h4.echo_all(both)
    assert "Batch column 'response'" in str(info.value) and "column 'obj'" not in str(info.value)
    assert await h4.seen_calls() == before


@pytest.mark.parametrize("call", ["count", "echo_all"])
async def test_a_column_whose_storage_was_freed_is_refused_naming_it_and_no_rank_is_sent_the_call(bed, call):
    """FSDP frees a parameter's unsharded storage after use (``untyped_storage().resize_(0)``); a column still
    viewing it was sent as whatever memory lay there (or crashed the controller), with no error."""
    h4 = bed["h4"]
    before = await h4.seen_calls()
    whole = torch.arange(64.0)
    col = whole[:8]
    whole.untyped_storage().resize_(0)
    with pytest.raises(orc.DispatchError) as info:
        await getattr(h4, call)(Batch.from_dict({"x": torch.arange(8), "w": col}))
    msg = str(info.value)
    for part in ("group 'h4'", f"endpoint '{call}'", "Batch column 'w'", "freed or shrunk", "clone()"):
        assert part in msg, (part, msg)
    assert await h4.seen_calls() == before


class _Ragged(orc.Worker):
    @endpoint(D.shard())
    def respond(self, batch: Batch) -> Batch:
        return Batch.from_dict({"response": _jagged([k + 1 for k in batch["x"].tolist()])})


async def test_a_result_the_wire_cannot_carry_fails_its_call_naming_the_rank_and_the_column():
    async with WorkerGroup(pool(2), _Ragged, group_name="ragged") as g:
        with pytest.raises(orc.WorkerError) as info:
            await g.respond(rows(4))
    e = info.value
    assert e.group == "ragged" and e.endpoint == "respond" and e.rank in (0, 1)
    assert "Batch column 'response'" in str(e) and "list of per-row tensors" in str(e)


@pytest.mark.parametrize("wrap", [lambda f: [f], lambda f: {"a": f}, lambda f: Batch.from_dict({"f": [f, f]})],
                         ids=["list", "dict", "object-column"])
async def test_a_future_inside_an_argument_is_refused_naming_it_before_sending(bed, wrap):
    """A DataFuture is forwarded only as an argument itself (or a union of such): one inside a list, a dict or a
    Batch's object column cannot travel, and the error says so, not that some lock cannot be pickled."""
    h4 = bed["h4"]
    before = await h4.seen_calls()
    fut = h4.echo(rows(4))
    with pytest.raises(orc.DispatchError, match="argument 'tag'") as info:
        await h4.mark(tag=wrap(fut))
    msg = str(info.value)
    assert "DataFuture" in msg and "top-level argument" in msg and "await" in msg and "_thread.lock" not in msg
    assert await h4.seen_calls() == before
    assert (await fut)["x"].tolist() == [0, 1, 2, 3]


async def test_unions_of_differently_split_futures_forward_by_rows(bed):
    h4 = bed["h4"]
    b10 = rows(10)
    out = await h4.echo(h4.add1(b10) | h4.score(b10))  # rows per rank 3,3,2,2 | 3,3,3,1
    assert out["a"].tolist() == list(range(1, 11))
    assert out["s"].tolist() == [2 * i for i in range(10)]
    direct = await (h4.add1(b10) | h4.score(b10))
    assert torch.equal(direct["a"], out["a"]) and torch.equal(direct["s"], out["s"])


async def test_row_counts_come_from_the_producer_not_the_input(bed):
    up = bed["h2"].expand(rows(2), n=4)  # 2 rows in, 8 rows out
    out = await bed["h4"].echo(up)
    assert out["x"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert up.rows_if_known() == 8


# -- options, deadlines and cancellation, closed and dead groups (from test_core_lifecycle.py) ------------------------
async def test_bad_options_name_the_option(bed):
    h2 = bed["h2"]
    with pytest.raises(ValueError, match="timeout"):
        h2.sleep.options(timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        h2.sleep.options(timeout="abc")
    with pytest.raises(TypeError, match="stream"):
        h2.sleep.options(stream="yes")


async def test_timeout_on_a_queued_call_means_it_never_runs(bed, seq):
    h2 = bed["h2"]
    before = await h2.seen_calls()
    # holds the group's send order until its last part: each producer rank yields its first part, then waits for
    # the test's position 0 (rank 0 passes 1, rank 1 passes 2) before the rest
    slow = h2.per_part(h2.gen_in_turn(rows(8), seq, [1, 2], pieces=4))
    queued = h2.mark.options(timeout=0.05)("late")
    with pytest.raises(orc.CallTimeoutError):
        await queued
    async with seq(0):  # the stream can end only now: "late" timed out while still queued behind it
        pass
    await slow
    assert await h2.seen_calls() == before  # "late" was never sent


async def test_remote_cancel_is_an_orchestra_error_in_other_awaiters(bed):
    g = bed["s2"]
    fut = g.hold_until_cancelled()  # ends only when cancelled
    fut.cancel()
    with pytest.raises(orc.CallCancelledError, match="cancelled"):
        await fut
    await g.take_outcomes()


async def test_a_call_in_flight_at_shutdown_says_so(seq):
    g = WorkerGroup(pool(2), Scorer, group_name="closing")
    await g.ready()
    fut = g.hold_until_cancelled(seq)
    async with seq(2):  # both ranks are running it
        pass
    await g.aclose()
    with pytest.raises(orc.GroupClosedError, match="'closing' was shut down"):
        await fut
    with pytest.raises(orc.GroupClosedError, match="was shut down"):
        g.sleep(1.0)


async def test_reading_a_dead_groups_future_blames_that_group():
    async with WorkerGroup(pool(2), Hazard, group_name="producer") as src, \
            WorkerGroup(pool(2), Hazard, group_name="consumer") as dst:
        await kill_rank(src, 1)
        with pytest.raises(orc.WorkerDiedError) as info:
            await dst.echo(src.echo(rows(4)))
        assert (info.value.group, info.value.rank) == ("producer", 1)


async def test_upstream_worker_error_is_reported_at_the_upstream_rank():
    async with WorkerGroup(pool(2), Hazard, group_name="up") as src, \
            WorkerGroup(pool(2), Hazard, group_name="down") as dst:
        with pytest.raises(orc.WorkerError) as info:
            await dst.echo(src.gen_fail(rows(4)))
        assert (info.value.group, info.value.endpoint) == ("up", "gen_fail")

