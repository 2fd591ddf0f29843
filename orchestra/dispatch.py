"""Dispatch transforms: how one group call becomes per-rank calls, and how their results become one value.

A transform edits a ``Plan`` (descriptors only, never payloads) in ``split`` and maps the per-rank results in
``collect``. Transforms compose left to right with ``|``::

    @endpoint(D.shard(mesh="actor") | D.pad())      # DP-sharded rows, padded to equal shards
    @endpoint(D.broadcast() | D.rank_zero())        # runs on rank 0 only

``check`` runs synchronously when the call is made (reject bad input before anything is sent); ``split`` may
await (a mesh lookup, upstream headers). A custom transform subclasses ``Dispatch`` — see docs/dispatch.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ._batch import Batch
from ._wire import padded_apart

__all__ = [
    "Dispatch", "Plan", "ShardSpec", "broadcast", "scatter", "shard", "pad", "rank_zero", "metrics", "stream",
    "dp_with_func", "only_ranks", "from_rank",
]


@dataclass(frozen=True)
class ShardSpec:
    """How data arguments are split: each executing rank reads DP piece ``dp_of_rank[rank]`` of ``dp_size``."""

    dp_of_rank: tuple[int, ...]
    dp_size: int
    collectors: tuple[int, ...]
    pad: bool = False
    allow_empty: bool = False
    mesh: str | None = None


@dataclass(frozen=True)
class Plan:
    """A call before it is sent: who runs, with which arguments, and how results come back.

    ``per_rank`` overrides (args, kwargs) for some ranks; ``shard`` (when set) splits every Batch/DataFuture
    argument by rows; ``stream`` runs the call once per arriving part of its streamed input.
    """

    group: Any  # the WorkerGroup view (for world_size, mesh lookups, names)
    endpoint: str
    world_size: int
    ranks: tuple[int, ...]
    args: tuple
    kwargs: dict
    per_rank: dict[int, tuple[tuple, dict]] = field(default_factory=dict)
    shard: ShardSpec | None = None
    stream: bool = False
    collectors: tuple[int, ...] | None = None  # without shard: the ranks whose results count (None: all)

    def with_(self, **changes: Any) -> Plan:
        """A copy with some fields changed: ``dataclasses.replace``'s result, made for a Plan itself without its
        per-field calls (this runs on every call's path; a Plan has no ``__post_init__``)."""
        if type(self) is not Plan:  # a subclass may have fields or a __post_init__ of its own
            return replace(self, **changes)
        unknown = changes.keys() - _PLAN_FIELDS
        if unknown:
            raise TypeError(f"Plan has no field(s) {sorted(unknown)}")
        new = object.__new__(Plan)
        fields_ = new.__dict__
        fields_.update(self.__dict__)
        fields_.update(changes)
        if "args" in changes:
            fields_.pop("_data", None)  # (``data_args``' memo is of the arguments it had)
        return new

    def without_data(self, placeholder: Any) -> Plan:
        """A copy whose Batch and DataFuture arguments are ``placeholder``: what a finished call keeps of its plan
        (its transforms' ``collect`` still reads the rest), so that it holds none of its inputs."""
        def drop(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return (tuple(placeholder if _is_data(a) else a for a in args),
                    {k: placeholder if _is_data(v) else v for k, v in kwargs.items()})
        args, kwargs = drop(self.args, self.kwargs)
        return self.with_(args=args, kwargs=kwargs, per_rank={r: drop(*ak) for r, ak in self.per_rank.items()})

    def data_args(self) -> list[Any]:
        """The Batch and DataFuture arguments of the call (in positional, then keyword order)."""
        # the positional ones found once per plan (this runs several times on every call's path): ``args`` is a
        # tuple of a frozen Plan, and ``with_`` drops the memo with it; ``kwargs`` is a dict a transform could write
        # into, so it is read every time. Each caller gets a list of its own. (``_is_data`` written out.)
        found = self.__dict__.get("_data")
        if found is None:
            found = self.__dict__["_data"] = tuple(
                [a for a in self.args if isinstance(a, Batch) or hasattr(type(a), "_orc_sources")])
        if not self.kwargs:
            return list(found)
        return [*found, *[a for a in self.kwargs.values() if isinstance(a, Batch) or hasattr(type(a), "_orc_sources")]]

    def where(self) -> str:
        return f"group {self.group.name!r}, endpoint {self.endpoint!r}"


_PLAN_FIELDS = frozenset(f.name for f in fields(Plan))


def _is_data(x: Any) -> bool:
    # a DataFuture is recognised by what it offers (the sources a call reads), so that dispatch imports neither
    # the future nor the group: both sit above it
    return isinstance(x, Batch) or hasattr(type(x), "_orc_sources")


_EVERY_RANK: dict[int, tuple[int, ...]] = {}


def every_rank(world_size: int) -> tuple[int, ...]:
    """``tuple(range(world_size))``, one object per size: a call's plan starts with it, and ``check_final`` knows
    it by identity (every rank once, each in range: nothing to check)."""
    ranks = _EVERY_RANK.get(world_size)
    if ranks is None:
        ranks = _EVERY_RANK[world_size] = tuple(range(world_size))
    return ranks


def _rows_known(x: Any) -> int | None:
    return len(x) if isinstance(x, Batch) else x.rows_if_known()


class Dispatch:
    """Base of every dispatch transform. Override any of ``check``, ``split`` and ``collect``."""

    def check(self, plan: Plan) -> Plan:
        """Synchronous validation and rewriting at call time; raise DispatchError with what to change."""
        return plan

    async def split(self, plan: Plan) -> Plan:
        """Asynchronous rewriting before the call is sent (may await mesh lookups)."""
        return plan

    def needs_split(self, plan: Plan) -> bool:
        """Whether ``split`` has work to do for this plan; if no transform has, the call is sent at once."""
        return type(self).split is not Dispatch.split

    def collect(self, plan: Plan, results: list[Any]) -> Any:
        """Map per-rank results to the value ``await`` returns: one per collecting rank (its outputs joined), in the
        order of ``plan.ranks`` (rank order) — a shard call's by the DP replica they serve (row order) — or, in a
        chain, what the transform before made of them."""
        return results

    reduces = False  # collects the per-rank results into one value: must be the last transform

    def __or__(self, other: Dispatch) -> Dispatch:
        if not isinstance(other, Dispatch):
            return NotImplemented
        steps: tuple[Dispatch, ...] = ()
        for s in (*_flatten(self), *_flatten(other)):
            if isinstance(s, _Pad) and steps and isinstance(steps[-1], _Shard):  # shard() | pad() is shard(pad=True)
                prev = steps[-1]
                s = _Shard(prev.mesh, True, prev.allow_empty)
                steps = steps[:-1]
            steps = (*steps, s)
        if len(steps) == 1:
            return steps[0]
        for i, s in enumerate(steps[:-1]):
            if s.reduces and any(type(t).collect is not Dispatch.collect for t in steps[i + 1:]):
                raise TypeError(f"{s!r} turns the per-rank results into one value, so it must come last in "
                                f"{' | '.join(map(repr, steps))}")
        return Chain(steps)

    def __repr__(self) -> str:
        return f"{type(self).__name__.lower()}()"


def _flatten(d: Dispatch) -> tuple[Dispatch, ...]:
    return d.steps if isinstance(d, Chain) else (d,)


class Chain(Dispatch):
    """Transforms applied left to right."""

    def __init__(self, steps: Sequence[Dispatch]) -> None:
        steps = list(steps)
        for i, s in enumerate(steps):  # after a collect of the user's, metrics() cannot tell which rank a result is
            if isinstance(s, _Metrics) and any(type(p).collect not in (Dispatch.collect, _Shard.collect)
                                               for p in steps[:i]):
                steps[i] = _Metrics(s.reduce, ranks_known=False)
        self.steps = tuple(steps)
        self.joins_rows = _joins_rows(self.steps)

    def check(self, plan: Plan) -> Plan:
        for s in self.steps:
            plan = s.check(plan)
        return plan

    async def split(self, plan: Plan) -> Plan:
        for s in self.steps:
            plan = await s.split(plan)
        return plan

    def needs_split(self, plan: Plan) -> bool:
        return any(s.needs_split(plan) for s in self.steps)

    def collect(self, plan: Plan, results: list[Any]) -> Any:
        for s in self.steps:
            results = s.collect(plan, results)
        return results

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.steps))


def joins_rows(dispatch: Dispatch) -> bool:
    """Whether the per-rank results of a shard call of ``dispatch`` reach no ``collect`` but shard()'s, which joins
    their rows: the controller may then join every rank's parts at once (``Invocation._join``)."""
    return dispatch.joins_rows if isinstance(dispatch, Chain) else type(dispatch).collect is _Shard.collect


def _joins_rows(steps: Sequence[Dispatch]) -> bool:
    # the first collect that changes the per-rank list must be shard()'s: every collect after it sees the joined rows
    first = next((type(s).collect for s in steps if type(s).collect is not Dispatch.collect), None)
    return first is _Shard.collect


def _error(plan: Plan, msg: str) -> Exception:
    from ._errors import DispatchError

    return DispatchError(f"{plan.where()}: {msg}")


def check_final(plan: Plan, dispatch: Dispatch) -> None:
    """Refuse a plan that no single transform's ``check`` catches because it comes from their composition (a
    user's transform after ``shard()`` included). Run by the group on the plan that ``check`` made, and again on
    the one ``split`` made, before anything is sent: every rank runs at most once; a shard runs every rank (the
    rows of the others would be lost); the ranks whose results are kept all run."""
    running = set(plan.ranks)
    every = plan.ranks is _EVERY_RANK.get(plan.world_size)  # (the call's own ranks, unchanged: each rank once)
    if not every:
        # one pass (a set) in the usual case, the count only to name the ranks listed twice
        dup = sorted({r for r in plan.ranks if plan.ranks.count(r) > 1}) if len(running) < len(plan.ranks) else []
        if dup:
            raise _error(plan, f"{dispatch!r} runs rank(s) {dup} more than once; list each rank once")
        bad = sorted(r for r in plan.ranks if not 0 <= r < plan.world_size)
        if bad:
            raise _error(plan, f"{dispatch!r} runs rank(s) {bad}, which do not exist in a group of {plan.world_size}")
    if plan.shard is not None and not every:
        left = [r for r in range(plan.world_size) if r not in running]
        if left:
            raise _error(plan, f"{dispatch!r}: shard() splits the rows over all {plan.world_size} ranks, but rank(s) "
                               f"{left} would not run, so the rows given to them would be lost. Shard over a group "
                               f"(a pool) of just the ranks that should run, or run every rank after shard() (a "
                               f"transform after shard() may change arguments or collect, not drop ranks)")
    kept = plan.shard.collectors if plan.shard is not None else plan.collectors
    if kept is not None:
        missing = sorted(r for r in kept if r not in running)
        if missing:
            raise _error(plan, f"{dispatch!r} keeps the result of rank(s) {missing}, but only rank(s) "
                               f"{sorted(running)} run; keep the result of a rank that runs, or run the rank whose "
                               f"result you keep")


class _Broadcast(Dispatch):
    """Every rank gets the same arguments; the result is a list with one value per rank."""

    def __repr__(self) -> str:
        return "broadcast()"


def broadcast() -> Dispatch:
    """Same arguments to every rank; ``await`` gives a list, one result per rank (a Batch argument goes whole)."""
    return _Broadcast()


class _Scatter(Dispatch):
    def check(self, plan: Plan) -> Plan:
        n = plan.world_size
        lists = {i: a for i, a in enumerate(plan.args) if isinstance(a, (list, tuple))}
        klists = {k: v for k, v in plan.kwargs.items() if isinstance(v, (list, tuple))}
        if not lists and not klists:
            raise _error(plan, f"scatter() needs at least one list argument with one entry per rank ({n} ranks)")
        for where, v in [*((f"argument {i}", v) for i, v in lists.items()),
                         *((f"argument {k!r}", v) for k, v in klists.items())]:
            if len(v) != n:
                raise _error(plan, f"scatter(): {where} has {len(v)} entries but the group has {n} ranks; pass "
                                   f"exactly one entry per rank")
        per_rank = {}
        for r in plan.ranks:
            args = tuple(v[r] if i in lists else v for i, v in enumerate(plan.args))
            kwargs = {k: (v[r] if k in klists else v) for k, v in plan.kwargs.items()}
            per_rank[r] = (args, kwargs)
        return plan.with_(per_rank=per_rank)

    def __repr__(self) -> str:
        return "scatter()"


def scatter() -> Dispatch:
    """Rank i gets entry i of every list/tuple argument (other arguments are broadcast); lengths must equal the
    world size. ``await`` gives a list, one result per rank."""
    return _Scatter()


class _Shard(Dispatch):
    def __init__(self, mesh: str | None, pad: bool, allow_empty: bool) -> None:
        self.mesh, self.pad, self.allow_empty = mesh, pad, allow_empty
        self._whole: dict[int, ShardSpec] = {}  # world size -> the spec of a shard over every rank (no mesh)

    def check(self, plan: Plan) -> Plan:
        if not plan.data_args():
            raise _error(plan, "shard() needs at least one Batch or DataFuture argument to split by rows")
        if len(plan.ranks) != plan.world_size:
            raise _error(plan, f"shard() splits rows over all {plan.world_size} ranks, but only rank(s) "
                               f"{list(plan.ranks)} run this call: the rows of the others would be lost. Shard "
                               f"over a group (a pool) of just those ranks, or drop only_ranks()")
        spec = None
        if self.mesh is None:
            spec = self._whole.get(plan.world_size)
            if spec is None:  # (frozen: one per world size, shared by the calls)
                spec = self._whole[plan.world_size] = ShardSpec(
                    tuple(range(plan.world_size)), plan.world_size, tuple(range(plan.world_size)), self.pad,
                    self.allow_empty)
        else:
            cached = plan.group.cached_mesh(self.mesh)
            if cached is not None:
                spec = _mesh_spec(cached, self.mesh, self.pad, self.allow_empty)
        if spec is not None:
            check_rows(plan, spec)
        return plan.with_(shard=spec if spec is not None else ShardSpec((), 0, (), self.pad, self.allow_empty,
                                                                           self.mesh))

    async def split(self, plan: Plan) -> Plan:
        if plan.shard is not None and plan.shard.dp_size == 0:  # mesh not looked up yet
            mesh = await plan.group.mesh(self.mesh, plan.endpoint)
            spec = _mesh_spec(mesh, self.mesh, plan.shard.pad, plan.shard.allow_empty)
            check_rows(plan, spec)
            plan = plan.with_(shard=spec)
        return plan

    def needs_split(self, plan: Plan) -> bool:
        return plan.shard is not None and plan.shard.dp_size == 0

    def collect(self, plan: Plan, results: list[Any]) -> Any:
        if results and all(isinstance(r, Batch) for r in results):
            return Batch.concat(results)
        return results

    def __repr__(self) -> str:
        args = [f"mesh={self.mesh!r}"] if self.mesh else []
        args += ["pad=True"] if self.pad else []
        return f"shard({', '.join(args)})"


def _mesh_spec(mesh: Sequence[Any], name: str, pad: bool, allow_empty: bool) -> ShardSpec:
    return ShardSpec(tuple(m.dp_rank for m in mesh), mesh[0].dp_size,
                     tuple(r for r, m in enumerate(mesh) if m.is_collector), pad, allow_empty, name)


def check_rows(plan: Plan, spec: ShardSpec) -> None:
    """Reject a shard of fewer known rows than DP ranks (unless padding or empty shards are allowed), and a padded
    one of data arguments whose known rows differ (``padded_apart``)."""
    if spec.pad:
        refusal = padded_apart([n for a in plan.data_args() if (n := _rows_known(a)) is not None], spec.dp_size)
        if refusal is not None:
            raise _error(plan, refusal)
    if spec.pad or spec.allow_empty:
        return
    for a in plan.data_args():
        n = _rows_known(a)
        if n is not None and n < spec.dp_size:
            raise _error(plan, f"a batch of {n} rows cannot be sharded over {spec.dp_size} data-parallel ranks "
                               f"without leaving some empty; pass at least {spec.dp_size} rows, or use "
                               f"shard(pad=True) / shard(allow_empty=True)")


def shard(mesh: str | None = None, *, pad: bool = False, allow_empty: bool = False) -> Dispatch:
    """Split every Batch/DataFuture argument by rows over the ranks (or over the DP replicas of ``mesh``);
    ``await`` concatenates the collectors' results in row order.

    Uneven splits are balanced (10 rows over 4 ranks -> 3, 3, 2, 2). ``pad=True`` pads to equal shards by
    repeating rows and strips the padding from the result. With ``mesh``, ranks registered with
    ``Worker.register_mesh`` get the rows of their DP replica; only collector ranks contribute results.
    Other arguments are broadcast (so a function passed next to a batch reaches every rank: verl's
    DP-with-function mode).
    """
    return _Shard(mesh, pad, allow_empty)


def dp_with_func(mesh: str | None = None) -> Dispatch:
    """verl's DP_COMPUTE_PROTO_WITH_FUNC: a function argument broadcast next to sharded data; same as ``shard()``."""
    return _Shard(mesh, False, False)


def pads(dispatch: Dispatch) -> bool:
    """Whether ``dispatch`` pads the rows it shards (``shard(pad=True)``, ``pad()``), as far as its own transforms
    say (a user's transform that sets it in ``check`` is seen at the call)."""
    return any((isinstance(s, _Shard) and s.pad) or isinstance(s, _Pad) for s in _flatten(dispatch))


class _Pad(Dispatch):
    def check(self, plan: Plan) -> Plan:
        if plan.shard is None:
            raise _error(plan, "pad() only applies after shard(): write shard(...) | pad()")
        return plan.with_(shard=replace(plan.shard, pad=True))

    def __repr__(self) -> str:
        return "pad()"


def pad() -> Dispatch:
    """After ``shard``: pad rows to equal shards (repeating rows) and strip the padding from the result."""
    return _Pad()


class _RankZero(Dispatch):
    reduces = True

    def check(self, plan: Plan) -> Plan:
        if plan.shard is not None:
            raise _error(plan, "rank_zero() runs on one rank and cannot follow shard(); use broadcast() | rank_zero()")
        if 0 not in plan.ranks:
            raise _rank_zero_left_out(plan, "run", plan.ranks)
        if plan.collectors is not None and 0 not in plan.collectors:
            raise _rank_zero_left_out(plan, "are kept", plan.collectors)
        return plan.with_(ranks=(0,), collectors=(0,))  # kept: a later transform that drops rank 0 is refused

    def collect(self, plan: Plan, results: list[Any]) -> Any:
        return results[0]

    def __repr__(self) -> str:
        return "rank_zero()"


def _rank_zero_left_out(plan: Plan, verb: str, chosen: Sequence[int]) -> Exception:
    """rank_zero() after transforms that leave rank 0 out: it must not replace their choice of ranks."""
    r = chosen[0]
    return _error(plan, f"rank_zero() runs rank 0, but only rank(s) {list(chosen)} {verb} before it; to get one of "
                        f"those ranks' value write only_ranks({r}) | from_rank({r}) (or broadcast() | from_rank({r}) "
                        f"to run every rank), or let rank 0 run")


def rank_zero() -> Dispatch:
    """Run on rank 0 only; ``await`` gives its single result."""
    return _RankZero()


class _OnlyRanks(Dispatch):
    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(sorted(ranks))  # results come back in rank order, whatever order the ranks were named

    def check(self, plan: Plan) -> Plan:
        if plan.shard is not None:
            raise _error(plan, "only_ranks() cannot follow shard(): the rows of the other ranks would be lost; "
                               "use broadcast() | only_ranks(...)")
        bad = [r for r in self.ranks if not 0 <= r < plan.world_size]
        if bad:
            raise _error(plan, f"{self!r}: rank(s) {bad} do not exist in a group of {plan.world_size}")
        added = [r for r in self.ranks if r not in plan.ranks]  # an earlier transform chose fewer ranks: narrow it
        if added:
            raise _error(plan, f"{self!r}: rank(s) {added} would run although an earlier transform "
                               f"chose rank(s) {list(plan.ranks)}; only_ranks() narrows the ranks that run, it "
                               f"does not add any: name a subset of them, or put only_ranks() first")
        return plan.with_(ranks=self.ranks)

    def __repr__(self) -> str:
        return f"only_ranks({', '.join(map(str, self.ranks))})"


def only_ranks(*ranks: int) -> Dispatch:
    """Run on the given ranks only (arguments as the other transforms say); ``await`` gives their results in rank
    order. At least one rank, each named once."""
    if not ranks:
        raise ValueError("only_ranks() needs at least one rank: a call on no rank would run nowhere")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"only_ranks{ranks}: rank(s) {twice} more than once; name each rank once")
    return _OnlyRanks(ranks)


class _FromRank(Dispatch):
    reduces = True

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def check(self, plan: Plan) -> Plan:
        if not 0 <= self.rank < plan.world_size:
            raise _error(plan, f"from_rank({self.rank}): no such rank in a group of {plan.world_size}")
        if plan.shard is not None:
            raise _error(plan, "from_rank() picks one rank's value; it cannot follow shard()")
        return plan.with_(collectors=(self.rank,))

    def collect(self, plan: Plan, results: list[Any]) -> Any:
        return results[0]

    def __repr__(self) -> str:
        return f"from_rank({self.rank})"


def from_rank(rank: int = 0) -> Dispatch:
    """Every rank runs (e.g. a collective gather); only ``rank``'s result is kept: ``await`` gives that value, and
    forwarding the future hands just that value to the next call."""
    return _FromRank(rank)


class _Metrics(Dispatch):
    reduces = True

    def __init__(self, reduce: str | Callable[[list[float]], float], ranks_known: bool = True) -> None:
        self.reduce = reduce
        self.ranks_known = ranks_known  # False after another collect: results are named by position, not rank

    def collect(self, plan: Plan, results: list[Any]) -> Any:
        if not all(isinstance(r, dict) for r in results):
            bad = next(type(r).__name__ for r in results if not isinstance(r, dict))
            raise TypeError(f"{plan.where()}: metrics() expects every rank to return a dict, got {bad}")
        fn = _REDUCERS[self.reduce] if isinstance(self.reduce, str) else self.reduce
        ranks = _result_ranks(plan, len(results)) if self.ranks_known else None
        names = [f"rank {r}" for r in ranks] if ranks is not None else [f"result {i}" for i in range(len(results))]
        vals: dict[str, list[float]] = {}  # a key a rank leaves out is reduced over the ranks that return it
        for who, r in zip(names, results):
            for k, v in r.items():
                if not _is_number(v):
                    raise TypeError(f"{plan.where()}: metrics() needs one number per key, but {who} returned "
                                    f"{k!r} = {v!r:.60} ({type(v).__name__}); return a float (or leave the key out "
                                    f"on that rank), and send other values through an endpoint without metrics()")
                vals.setdefault(k, []).append(float(v))
        return {k: fn(v) for k, v in vals.items()}

    def __repr__(self) -> str:
        return f"metrics(reduce={self.reduce!r})"


def _is_number(x: Any) -> bool:
    """One real number: a float, int or bool, a numpy scalar, a one-element tensor or array (not a string that
    parses as one)."""
    if isinstance(x, (str, bytes)):
        return False
    try:
        float(x)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _result_ranks(plan: Plan, n: int) -> list[int] | None:
    """The rank each of a call's ``n`` collected results came from, in the order ``collect`` gets them: a shard
    call's collectors by the DP replica they serve, other calls' in the plan's order of ranks (rank order, unless
    a transform of a user's reorders them); None when they are not ``n`` (then results are named by position)."""
    if plan.shard is not None:
        spec = plan.shard
        ranks = sorted(spec.collectors, key=lambda r: spec.dp_of_rank[r])
    elif plan.collectors is not None:
        kept = set(plan.collectors)
        ranks = [r for r in plan.ranks if r in kept]
    else:
        ranks = list(plan.ranks)
    return ranks if len(ranks) == n else None


_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda v: math.fsum(v) / len(v),
    "sum": math.fsum,
    "max": max,
    "min": min,
}


def metrics(reduce: str | Callable[[list[float]], float] = "mean") -> Dispatch:
    """Each rank returns a dict of numbers; ``await`` gives one dict, each key reduced over the ranks
    (``"mean"``, ``"sum"``, ``"max"``, ``"min"`` or a function)."""
    if isinstance(reduce, str) and reduce not in _REDUCERS:
        raise ValueError(f"metrics(reduce={reduce!r}): choose one of {sorted(_REDUCERS)} or pass a function")
    return _Metrics(reduce)


class _Stream(Dispatch):
    def check(self, plan: Plan) -> Plan:
        if plan.shard is None:
            raise _error(plan, "stream() maps parts over the DP replicas; write shard(...) | stream()")
        return plan.with_(stream=True)

    def __repr__(self) -> str:
        return "stream()"


def forwarded_as(dispatch: Dispatch, plan: Plan) -> str:
    """What a later call that takes this call's future reads, from the call's transforms and plan — always what
    ``await`` gives, less nothing:

    - ``"rows"``: a ``shard()`` call: one row space (the collectors' rows, in input order);
    - ``"one"``: ``rank_zero()`` / ``from_rank(r)``: the one kept rank's value (a Batch is rows);
    - ``"per_rank"``: one value per rank (``broadcast()``, ``scatter()``, ``only_ranks()``): the list, never rows;
    - ``"collected"``: a transform whose ``collect`` makes one value out of several ranks' (``metrics()``, a user's
      own): only the controller makes it, so no call can read the future (await it and pass the value).
    """
    steps = _flatten(dispatch)
    plain = (Dispatch.collect, _Shard.collect, _RankZero.collect, _FromRank.collect)
    if any(type(s).collect not in plain for s in steps):
        return "collected"
    if plan.shard is not None:
        return "rows"
    if any(isinstance(s, (_RankZero, _FromRank)) for s in steps):
        return "one"
    return "per_rank"


def collects_by_shape(dispatch: Dispatch) -> bool:
    """Whether every ``collect`` of ``dispatch`` is orchestra's own, which reads the plan's ranks, shard and
    collectors, never its arguments: a finished call may then drop its data arguments (``Plan.without_data``). A
    user's collect may read them (``plan.data_args()``), so its call keeps them."""
    # asked when every call ends; the answer for one of orchestra's own transforms (a Chain, whose steps never change)
    # is kept on it; a user's transform is asked each time, its attributes left as they are
    memo = dispatch.__dict__ if type(dispatch).__module__ == __name__ else None
    known = memo.get("_collects_by_shape") if memo is not None else None
    if known is None:
        own = (Dispatch.collect, _Shard.collect, _RankZero.collect, _FromRank.collect, _Metrics.collect)
        known = all(type(s).collect in own for s in _flatten(dispatch))
        if memo is not None:
            memo["_collects_by_shape"] = known
    return known


def stream() -> Dispatch:
    """After ``shard``: run the call once per part of a streamed DataFuture argument as each part arrives, so this
    stage starts before the producer finishes; the result streams part by part, in input order."""
    return _Stream()
