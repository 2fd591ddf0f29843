"""Dispatch transforms without Ray: ``check`` (runs when the call is made), ``split`` (async), ``collect`` and
composition, on a tiny stand-in for the group; plus a user-defined transform in a few lines.
"""

from __future__ import annotations

import asyncio
import math
import statistics

import numpy as np
import pytest
import torch

from orchestra import Batch, DispatchError
from orchestra import dispatch as D
from orchestra._worker import MeshInfo
from orchestra.dispatch import Dispatch, Plan


class FakeGroup:
    """What transforms read from a group: its name and (for shard(mesh=...)) the mesh lookups."""

    name = "actor"

    def __init__(self, mesh: list[MeshInfo] | None = None) -> None:
        self._mesh_infos = mesh

    def cached_mesh(self, name: str) -> list[MeshInfo] | None:
        return None

    async def mesh(self, name: str, endpoint: str) -> list[MeshInfo]:
        return self._mesh_infos


class FakeFuture:
    """What transforms read from a DataFuture argument: the rows its producers reported (None until they have)."""

    _orc_sources = ()

    def __init__(self) -> None:
        self.rows: int | None = None

    def rows_if_known(self) -> int | None:
        return self.rows


def plan(*args, world: int = 4, group: FakeGroup | None = None, **kwargs) -> Plan:
    return Plan(group=group or FakeGroup(), endpoint="step", world_size=world, ranks=tuple(range(world)),
                args=args, kwargs=kwargs)


def rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


# -- broadcast / scatter ------------------------------------------------------------------------------------------
def test_broadcast_sends_the_same_arguments_everywhere():
    p = D.broadcast().check(plan(1, b=2))
    assert p.ranks == (0, 1, 2, 3) and p.per_rank == {} and p.shard is None
    assert D.broadcast().collect(p, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert not D.broadcast().needs_split(p)


def test_scatter_gives_rank_i_entry_i():
    p = D.scatter().check(plan(["a", "b", "c", "d"], 7, tag=("w", "x", "y", "z"), k=1))
    assert p.per_rank[2] == (("c", 7), {"tag": "y", "k": 1})
    assert [p.per_rank[r][0][0] for r in range(4)] == ["a", "b", "c", "d"]


def test_scatter_errors_say_what_to_change():
    with pytest.raises(DispatchError, match=r"needs at least one list argument with one entry per rank \(4 ranks\)"):
        D.scatter().check(plan(1, 2))
    with pytest.raises(DispatchError, match=r"argument 0 has 3 entries but the group has 4 ranks"):
        D.scatter().check(plan([1, 2, 3]))
    with pytest.raises(DispatchError, match=r"argument 'xs' has 5 entries") as e:
        D.scatter().check(plan(xs=[1, 2, 3, 4, 5]))
    assert "group 'actor', endpoint 'step'" in str(e.value)
    assert isinstance(e.value, ValueError)  # DispatchError is a ValueError too


# -- shard / pad --------------------------------------------------------------------------------------------------
def test_shard_spec_over_all_ranks():
    p = D.shard().check(plan(rows(10), 0.5))
    assert p.shard == D.ShardSpec((0, 1, 2, 3), 4, (0, 1, 2, 3))
    assert p.data_args() == [p.args[0]]
    assert not D.shard().needs_split(p)  # the group's size is known: nothing to await


def test_shard_needs_a_data_argument():
    with pytest.raises(DispatchError, match="at least one Batch or DataFuture argument"):
        D.shard().check(plan([1, 2, 3, 4]))


def test_shard_rejects_fewer_rows_than_ranks():
    with pytest.raises(DispatchError, match=r"a batch of 3 rows cannot be sharded over 4 data-parallel ranks") as e:
        D.shard().check(plan(rows(3)))
    assert "shard(pad=True)" in str(e.value) and "allow_empty=True" in str(e.value)
    assert D.shard(pad=True).check(plan(rows(3))).shard.pad
    assert D.shard(allow_empty=True).check(plan(rows(3))).shard.allow_empty


def test_shard_row_check_uses_known_future_rows():
    fut = FakeFuture()
    D.shard().check(plan(fut))  # rows unknown: nothing to check yet
    fut.rows = 2  # reported by the producers
    with pytest.raises(DispatchError, match="a batch of 2 rows"):
        D.shard().check(plan(fut))


def test_shard_over_a_mesh_is_resolved_in_split():
    mesh = [MeshInfo(r // 2, 2, r % 2 == 0) for r in range(4)]  # DP 2 x TP 2, first rank of each replica collects
    d = D.shard(mesh="actor")
    p = d.check(plan(rows(5), group=FakeGroup(mesh)))
    assert p.shard.dp_size == 0 and d.needs_split(p)  # not looked up yet
    p = asyncio.run(d.split(p))
    assert p.shard == D.ShardSpec((0, 0, 1, 1), 2, (0, 2), mesh="actor")
    assert not d.needs_split(p)
    with pytest.raises(DispatchError, match="a batch of 1 rows cannot be sharded over 2"):
        asyncio.run(d.split(d.check(plan(rows(1), group=FakeGroup(mesh)))))


def test_shard_collect_concatenates_batches_in_rank_order():
    p = D.shard().check(plan(rows(4)))
    out = D.shard().collect(p, [rows(2), Batch.from_dict({"x": torch.tensor([7])})])
    assert out["x"].tolist() == [0, 1, 7]
    assert D.shard().collect(p, [1, 2]) == [1, 2]  # non-Batch results stay a list


def test_pad_needs_shard_first():
    with pytest.raises(DispatchError, match=r"pad\(\) only applies after shard\(\): write shard\(...\) \| pad\(\)"):
        D.pad().check(plan(rows(8)))
    assert (D.shard() | D.pad()).check(plan(rows(8))).shard.pad


def test_shard_then_pad_accepts_fewer_rows_than_ranks():
    assert (D.shard() | D.pad()).check(plan(rows(3))).shard.pad  # as shard(pad=True) does


def test_stream_needs_shard_first():
    with pytest.raises(DispatchError, match=r"stream\(\) maps parts over the DP replicas"):
        D.stream().check(plan(rows(8)))
    assert (D.shard() | D.stream()).check(plan(rows(8))).stream


# -- rank_zero / only_ranks / from_rank ---------------------------------------------------------------------------
def test_rank_zero():
    p = D.rank_zero().check(plan("ckpt"))
    assert p.ranks == (0,)
    assert D.rank_zero().collect(p, ["saved"]) == "saved"
    with pytest.raises(DispatchError, match=r"rank_zero\(\) runs on one rank and cannot follow shard\(\)"):
        (D.shard() | D.rank_zero()).check(plan(rows(8)))


def test_only_ranks():
    assert D.only_ranks(1, 3).check(plan()).ranks == (1, 3)
    with pytest.raises(DispatchError, match=r"rank\(s\) \[3\] do not exist in a group of 2"):
        D.only_ranks(1, 3).check(plan(world=2))


def test_only_ranks_refusals_name_it_as_it_is_written():
    """They read ``only_ranks(9,)`` (the tuple's repr), not what the call wrote."""
    with pytest.raises(DispatchError, match=r"only_ranks\(9\): rank\(s\) \[9\]"):
        D.only_ranks(9).check(plan())


def test_only_ranks_runs_its_ranks_in_rank_order():
    """``only_ranks(1, 0)`` ran the ranks in the order named, so ``await`` gave rank 1's value first (results come in
    rank order) and ``metrics()`` after it blamed rank 0 for rank 1's bad value."""
    assert D.only_ranks(3, 1).check(plan()).ranks == (1, 3)
    d = D.broadcast() | D.only_ranks(1, 0) | D.metrics()
    p = d.check(plan(world=2))
    assert p.ranks == (0, 1)
    with pytest.raises(TypeError, match=r"but rank 1 returned 'loss' = 'oops'"):
        d.collect(p, [{"loss": 0.5}, {"loss": "oops"}])  # the invocation's results, in the plan's rank order


def test_metrics_names_each_results_rank_in_the_order_the_plan_runs_them():
    """A transform of a user's that lists the ranks out of order gets their results in that order (the order the
    call runs them); metrics() assumed rank order and named the other rank."""
    class backwards(Dispatch):
        def check(self, plan: Plan) -> Plan:
            return plan.with_(ranks=plan.ranks[::-1])

    d = D.broadcast() | backwards() | D.metrics()
    p = d.check(plan(world=2))
    with pytest.raises(TypeError, match=r"but rank 1 returned 'loss' = 'oops'"):
        d.collect(p, [{"loss": "oops"}, {"loss": 0.5}])  # rank 1's result first: the order the ranks ran


def test_rank_zero_keeps_rank_zero_and_refuses_a_plan_that_leaves_it_out():
    """``only_ranks(1) | rank_zero()`` ran rank 0 (dropping only_ranks(1) without a word), and ``rank_zero() |
    only_ranks(1)`` gave rank 1's value as rank zero's."""
    p = (D.broadcast() | D.rank_zero()).check(plan())
    assert p.ranks == (0,) and p.collectors == (0,)
    with pytest.raises(DispatchError, match=r"group 'actor', endpoint 'step': rank_zero\(\) runs rank 0, but only "
                                            r"rank\(s\) \[1\] run before it.*only_ranks\(1\) \| from_rank\(1\)"):
        (D.only_ranks(1) | D.rank_zero()).check(plan(world=2))
    d = D.broadcast() | D.rank_zero() | D.only_ranks(1)
    with pytest.raises(DispatchError, match=r"only_ranks\(1\): rank\(s\) \[1\] would run although an earlier "
                                            r"transform chose rank\(s\) \[0\]"):
        D.check_final(d.check(plan(world=2)), d)
    for ok in (D.only_ranks(1, 0) | D.rank_zero(), D.rank_zero() | D.only_ranks(0)):
        p = ok.check(plan(world=2))
        D.check_final(p, ok)
        assert p.ranks == (0,) and ok.collect(p, ["r0"]) == "r0"


def test_only_ranks_needs_a_rank_and_each_rank_once():
    """``only_ranks()`` with no rank ran the call nowhere and awaited ``[]``; a rank named twice ran it twice."""
    with pytest.raises(ValueError, match="at least one rank"):
        D.only_ranks()
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] more than once"):
        D.only_ranks(1, 0, 1)


def test_only_ranks_after_shard_is_rejected():
    with pytest.raises(DispatchError, match="only_ranks\\(\\) cannot follow shard\\(\\)"):
        (D.shard() | D.only_ranks(0, 1)).check(plan(rows(8)))


@pytest.mark.parametrize("mesh", [None, "actor"])
def test_shard_after_only_ranks_is_rejected_instead_of_dropping_the_other_ranks_rows(mesh):
    with pytest.raises(DispatchError, match=r"only rank\(s\) \[0\] run this call: the rows of the others would be "
                                            r"lost"):
        (D.only_ranks(0) | D.shard(mesh=mesh)).check(plan(rows(6), world=2))
    assert (D.only_ranks(0, 1) | D.shard()).check(plan(rows(6), world=2)).shard.dp_size == 2  # every rank: fine


def test_a_transform_after_shard_that_drops_ranks_is_refused_on_the_final_plan():
    """Whatever transform removes ranks after shard() (a user's, not only only_ranks), the final plan is refused:
    the rows of the ranks that do not run would be lost."""
    d = D.shard() | only_even_ranks()
    p = d.check(plan(rows(6), world=3))
    with pytest.raises(DispatchError, match=r"shard\(\) \| only_even_ranks\(\).*rank\(s\) \[1\] would not run") as e:
        D.check_final(p, d)
    assert "group 'actor', endpoint 'step'" in str(e.value) and "the rows" in str(e.value)
    D.check_final(D.shard().check(plan(rows(6), world=3)), D.shard())  # every rank runs: fine


def test_from_rank_of_a_rank_that_does_not_run_is_refused_up_front():
    d = D.broadcast() | D.only_ranks(0) | D.from_rank(1)
    with pytest.raises(DispatchError, match=r"from_rank\(1\).*rank\(s\) \[1\].*only rank\(s\) \[0\] run"):
        D.check_final(d.check(plan(world=2)), d)

    class Twice(D.Dispatch):  # a user's transform that names a rank twice
        def check(self, p: D.Plan) -> D.Plan:
            return p.with_(ranks=(1, 1))

    with pytest.raises(DispatchError, match=r"rank\(s\) \[1\] more than once"):
        D.check_final(Twice().check(plan(world=2)), Twice())


def test_reducing_transforms_must_come_last():
    with pytest.raises(TypeError, match="must come last"):
        D.broadcast() | D.metrics() | D.rank_zero()
    with pytest.raises(TypeError, match="must come last"):
        D.rank_zero() | D.metrics()


def test_from_rank_keeps_one_rank_result():
    p = D.from_rank(2).check(plan())
    assert p.ranks == (0, 1, 2, 3) and p.collectors == (2,)
    assert D.from_rank(2).collect(p, ["r2"]) == "r2"
    with pytest.raises(DispatchError, match=r"from_rank\(4\): no such rank"):
        D.from_rank(4).check(plan())


# -- composition --------------------------------------------------------------------------------------------------
def test_composition_applies_left_to_right():
    d = D.broadcast() | D.rank_zero()
    assert repr(d) == "broadcast() | rank_zero()"
    p = d.check(plan("path"))
    assert p.ranks == (0,)
    assert d.collect(p, ["only rank 0 ran"]) == "only rank 0 ran"
    chained = (D.shard() | D.pad()) | D.metrics("sum")
    assert len(chained.steps) == 2  # chains flatten; shard() | pad() folds into shard(pad=True)
    assert repr(chained) == "shard(pad=True) | metrics(reduce='sum')"
    assert chained.collect(chained.check(plan(rows(8))), [{"n": 2}, {"n": 3}]) == {"n": 5.0}
    with pytest.raises(TypeError):
        D.broadcast() | "rank_zero"


# -- metrics ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduce, expected", [
    ("mean", statistics.fmean), ("sum", math.fsum), ("max", max), ("min", min),
    (lambda v: sorted(v)[len(v) // 2], lambda v: sorted(v)[len(v) // 2]),
])
def test_metrics_reduce(reduce, expected):
    results = [{"loss": 1.0, "tokens": 10}, {"loss": 3.0, "tokens": 30}, {"loss": 2.0, "tokens": 20}]
    out = D.metrics(reduce).collect(plan(world=3), results)
    assert out == {"loss": expected([1.0, 3.0, 2.0]), "tokens": expected([10.0, 30.0, 20.0])}


def test_metrics_reduces_each_key_over_the_ranks_that_return_it():
    out = D.metrics().collect(plan(world=3), [{"a": 1}, {"a": 3, "b": torch.tensor(2.0)}, {"b": np.float32(1.0), "c": True}])
    assert out == {"a": 2.0, "b": 1.5, "c": 1.0}  # a flag averages to a rate


@pytest.mark.parametrize("value, kind", [("x", "str"), (None, "NoneType"), ([1.0], "list"),
                                         (torch.ones(2), "Tensor")])
def test_metrics_refuses_a_value_that_is_not_one_number_naming_key_and_rank(value, kind):
    """A value that is not one number was left out of the reduced dict without a word (a rank's tag, a None for
    'no value this step', a 2-element tensor), so a metric could vanish from the logs unnoticed."""
    with pytest.raises(TypeError, match=rf"group 'actor', endpoint 'step': metrics\(\) needs one number per key, "
                                        rf"but rank 1 returned 'tag' = .* \({kind}\)"):
        D.metrics().collect(plan(world=2), [{"a": 1.0}, {"a": 2.0, "tag": value}])


def test_metrics_errors():
    with pytest.raises(TypeError, match=r"group 'actor', endpoint 'step': metrics\(\) expects every rank to return a "
                                        r"dict, got list"):
        D.metrics().collect(plan(world=2), [{"a": 1}, [1]])
    with pytest.raises(ValueError, match=r"metrics\(reduce='median'\): choose one of"):
        D.metrics("median")


# -- a user-defined transform -------------------------------------------------------------------------------------
class only_even_ranks(Dispatch):
    """Run on the even ranks only."""

    def check(self, plan: Plan) -> Plan:
        return plan.with_(ranks=tuple(r for r in plan.ranks if r % 2 == 0))


def test_user_defined_transform():
    d = D.broadcast() | only_even_ranks() | D.metrics("sum")
    p = d.check(plan(world=5))
    assert p.ranks == (0, 2, 4)
    assert not d.needs_split(p)  # no async split: the call is sent at once
    assert d.collect(p, [{"n": 1}, {"n": 1}, {"n": 1}]) == {"n": 3.0}
    assert repr(only_even_ranks()) == "only_even_ranks()"


def test_a_transform_with_an_async_split_is_awaited():
    class tag_rank(Dispatch):
        async def split(self, plan: Plan) -> Plan:
            await asyncio.sleep(0)  # e.g. a lookup
            return plan.with_(per_rank={r: ((r,), {}) for r in plan.ranks})

    d = D.broadcast() | tag_rank()
    p = d.check(plan(world=3))
    assert d.needs_split(p)
    assert asyncio.run(d.split(p)).per_rank == {0: ((0,), {}), 1: ((1,), {}), 2: ((2,), {})}


def test_metrics_after_a_users_collect_names_results_by_position():
    """After a user's collect (here one reversing the list) metrics() named ranks by the plan's order, so it blamed
    rank 0 for rank 2's string."""

    class Reverse(Dispatch):
        def collect(self, plan, results):
            return list(reversed(results))

    chain = D.broadcast() | Reverse() | D.metrics()
    with pytest.raises(TypeError, match=r"but result 0 returned 'loss' = 'oops'"):
        chain.collect(plan(world=3), [{"loss": 0.5}, {"loss": 0.5}, {"loss": "oops"}])
    with pytest.raises(TypeError, match=r"but rank 2 returned 'loss' = 'oops'"):
        (D.broadcast() | D.metrics()).collect(plan(world=3), [{"loss": 0.5}, {"loss": 0.5}, {"loss": "oops"}])


def test_only_ranks_narrows_an_earlier_choice_of_ranks_and_never_adds_one():
    """rank_zero() | only_ranks(0, 1) ran rank 1 too (its result dropped): only_ranks replaced the earlier choice."""
    with pytest.raises(DispatchError, match=r"only_ranks\(0, 1\): rank\(s\) \[1\] would run although an earlier "
                                            r"transform chose rank\(s\) \[0\]"):
        (D.broadcast() | D.rank_zero() | D.only_ranks(0, 1)).check(plan(world=3))
    assert (D.only_ranks(0, 2) | D.only_ranks(2)).check(plan(world=3)).ranks == (2,)


def test_a_plans_data_arguments_follow_its_arguments():
    """``data_args`` keeps what it found among a plan's positional arguments: a copy with other arguments finds
    theirs, a keyword dict written into after a first look is read again, and each caller gets a list of its
    own."""
    a, b, c = rows(4), rows(4), rows(4)
    p = plan(a, 7, k=b)
    assert p.data_args() == [a, b]
    p.data_args().append("mine")  # a caller's list is its own
    assert p.data_args() == [a, b]
    q = p.with_(args=(c,))
    assert q.data_args() == [c, b] and p.data_args() == [a, b]
    assert p.with_(kwargs={}).data_args() == [a]
    p.kwargs["more"] = c  # (a Plan is frozen, its kwargs dict is not)
    assert p.data_args() == [a, b, c]
    f = FakeFuture()
    assert plan(f, a).data_args() == [f, a]


def test_a_plan_of_every_rank_is_still_checked_for_the_results_it_keeps():
    """``check_final`` knows the ranks a call starts with (``every_rank``) by identity and skips their checks; the
    ranks whose results are kept are checked all the same, and an equal tuple made by a transform is checked
    fully."""
    p = Plan(group=FakeGroup(), endpoint="step", world_size=3, ranks=D.every_rank(3), args=(rows(6),), kwargs={})
    assert D.every_rank(3) is D.every_rank(3) == (0, 1, 2)
    D.check_final(p, D.broadcast())
    with pytest.raises(DispatchError, match=r"keeps the result of rank\(s\) \[5\]"):
        D.check_final(p.with_(collectors=(0, 5)), D.broadcast())
    with pytest.raises(DispatchError, match=r"keeps the result of rank\(s\) \[0.5\]"):
        D.check_final(p.with_(shard=D.ShardSpec((0, 1, 2), 3, (0.5,))), D.shard())
    with pytest.raises(DispatchError, match=r"rank\(s\) \[2\] would not run"):
        D.check_final(p.with_(ranks=(0, 1, 0.5), shard=D.ShardSpec((0, 1, 2), 3, (0, 1))), D.shard())
    with pytest.raises(DispatchError, match=r"rank\(s\) \[3\], which do not exist"):
        D.check_final(p.with_(ranks=(0, 1, 3)), D.broadcast())
