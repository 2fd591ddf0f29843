"""WorkerGroup: one actor per rank of a pool, seen from the controller as one object whose endpoints return futures."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import _stats
from ._batch import Batch, balanced_sizes
from ._errors import DispatchError, OrchestraError
from ._future import DataFuture, UnionFuture, _Slot, convert_error
from ._host import CONCURRENCY_GROUPS, REFS_KWARG, host_class, method_name
from ._pool import ResourcePool
from ._wire import DataArg, Layout, PartInfo, Source
from ._worker import EndpointSpec, MeshInfo, Worker, endpoints_of
from .dispatch import Plan
from .dispatch import stream as stream_transform

__all__ = ["WorkerGroup"]


class _Gate:
    """Calls on a group's actors are sent in the order they were made. A call that must wait before sending (a
    mesh lookup, an upstream stream still producing) holds back the later ones, so that every rank sees the same
    sequence of calls: collectives on those ranks then always pair up."""

    def __init__(self) -> None:
        self._next = 0
        self._open = 0
        self._done: set[int] = set()
        self._waiters: dict[int, asyncio.Future] = {}

    def ticket(self) -> int:
        t = self._next
        self._next += 1
        return t

    def is_turn(self, ticket: int) -> bool:
        return self._open == ticket

    async def turn(self, ticket: int) -> None:
        if self._open < ticket:
            w = self._waiters[ticket] = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                self._waiters.pop(ticket, None)

    def release(self, ticket: int) -> None:
        if ticket < self._open or ticket in self._done:  # idempotent
            return
        self._done.add(ticket)
        while self._open in self._done:
            self._done.discard(self._open)
            self._open += 1
        w = self._waiters.get(self._open)
        if w is not None and not w.done():
            w.set_result(None)


class _Shared:
    """The actors of a group (shared by the role views of a colocated group) and their start-up."""

    def __init__(self, pool: ResourcePool, roles: dict[str, tuple[type, tuple, dict]], name: str) -> None:
        self.pool, self.roles, self.name = pool, roles, name
        self.hosts: list[Any] = []
        self.info: list[dict] = []
        self.meshes: dict[tuple[str, str], list[MeshInfo]] = {}
        self.seq: list[int] = []
        self._start: asyncio.Task | None = None
        self._ready = False
        self._dead = False
        self.gate = _Gate()

    def start(self) -> asyncio.Task:
        if self._start is None:
            self._start = asyncio.get_running_loop().create_task(self._boot())
            self._start.add_done_callback(lambda t: t.cancelled() or t.exception())
        return self._start

    async def _boot(self) -> None:
        slots = await self.pool.slots()
        world = len(slots)
        res = self.pool.actor_resources()
        actor_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(
            host_class({role: cls for role, (cls, _, _) in self.roles.items()}))
        self.hosts = [
            actor_cls.options(
                **res,
                scheduling_strategy=PlacementGroupSchedulingStrategy(s.placement_group, s.bundle_index),
            ).remote(self.name, s.rank, world, s.local_rank,
                     {"bundle_index": s.bundle_index, "placement_group": s.placement_group.id.hex()})
            for s in slots
        ]
        try:
            ip, port = await self.hosts[0].address.remote()
            self.info = await asyncio.gather(*[
                h.setup.remote({"RANK": str(s.rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(s.local_rank),
                                "LOCAL_WORLD_SIZE": str(sum(1 for t in slots if t.node_id == s.node_id)),
                                "MASTER_ADDR": ip, "MASTER_PORT": str(port)}, self.roles)
                for h, s in zip(self.hosts, slots)])
        except BaseException as e:
            self.kill()
            err = convert_error(e, self.name, "__init__", None)
            raise err from None
        self._ready = True

    async def ready(self) -> None:
        if self._dead:
            raise OrchestraError(f"group {self.name!r} was shut down; create a new WorkerGroup")
        await asyncio.shield(self.start())

    def kill(self) -> None:
        for h in self.hosts:
            try:
                ray.kill(h)
            except Exception:
                pass


class WorkerGroup:
    """The ranks of a pool running one Worker class; endpoints appear as methods that return DataFutures.

    ``WorkerGroup(pool, Cls, *init_args, group_name=..., **init_kwargs)`` returns at once; actors start in the
    background (``await group.ready()`` waits for them). ``WorkerGroup.colocate`` puts several roles in one
    process per rank.
    """

    def __init__(self, pool: ResourcePool, cls: type[Worker], *args: Any, group_name: str | None = None,
                 **kwargs: Any) -> None:
        _check_worker_class(cls)
        name = group_name or cls.__name__
        self._init(_Shared(pool, {name: (cls, args, kwargs)}, name), name, cls)

    def _init(self, shared: _Shared, role: str, cls: type) -> None:
        self._shared, self._role, self._cls = shared, role, cls
        self._endpoints = endpoints_of(cls)
        self._callers: dict[str, _Endpoint] = {}
        try:
            asyncio.get_running_loop()
            shared.start()
        except RuntimeError:
            pass  # no loop yet: start on the first await

    @classmethod
    def colocate(cls, pool: ResourcePool, classes: Mapping[str, type[Worker]], *, group_name: str | None = None,
                 **init: Any) -> dict[str, WorkerGroup]:
        """One process per rank holding every role; returns a view per role (sharing the actors).

        Init arguments go by role name: ``colocate(pool, {"actor": A, "critic": C}, actor={"lr": 1e-3})`` — a
        dict is keyword arguments, a tuple or list positional ones.
        """
        unknown = set(init) - set(classes)
        if unknown:
            raise TypeError(f"colocate: init arguments for unknown role(s) {sorted(unknown)}; roles are "
                            f"{sorted(classes)}")
        roles = {}
        for role, klass in classes.items():
            _check_worker_class(klass)
            a = init.get(role, {})
            args, kwargs = ((), dict(a)) if isinstance(a, Mapping) else (tuple(a), {})
            roles[role] = (klass, args, kwargs)
        shared = _Shared(pool, roles, group_name or "+".join(classes))
        views = {}
        for role, klass in classes.items():
            v = cls.__new__(cls)
            v._init(shared, role, klass)
            views[role] = v
        return views

    # -- properties -----------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The group's name as used in errors and traces (``group/role`` for colocated roles)."""
        return self._role if self._shared.name == self._role else f"{self._shared.name}/{self._role}"

    @property
    def role(self) -> str:
        return self._role

    @property
    def world_size(self) -> int:
        return self._shared.pool.world_size

    @property
    def pool(self) -> ResourcePool:
        return self._shared.pool

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, one per rank (after ``ready()``)."""
        return list(self._shared.hosts)

    async def ready(self) -> WorkerGroup:
        """Wait until every rank's worker is constructed; raises the first construction error."""
        await self._shared.ready()
        return self

    async def describe(self) -> list[dict[str, Any]]:
        """Per rank: rank, local rank, node, pid, bundle, devices, roles and registered meshes."""
        await self.ready()
        return list(await asyncio.gather(*[h.describe.remote() for h in self._shared.hosts]))

    async def stats(self) -> list[dict[str, dict[str, float]]]:
        """Per rank, per endpoint of this role: calls, parts/rows/bytes fetched and produced, seconds."""
        await self.ready()
        return list(await asyncio.gather(*[h.stats.remote(self._role) for h in self._shared.hosts]))

    async def reset_stats(self) -> None:
        await self.ready()
        await asyncio.gather(*[h.reset_stats.remote() for h in self._shared.hosts])

    async def set_tracing(self, enabled: bool = True) -> None:
        """Record a span per call on every rank (and the parts each fetched and produced) for ``orchestra.Tracer``."""
        await self.ready()
        await asyncio.gather(*[h.set_tracing.remote(enabled) for h in self._shared.hosts])

    async def take_events(self) -> list[tuple[int, list[dict]]]:
        """Per rank, (pid, spans recorded since the last take)."""
        await self.ready()
        return list(await asyncio.gather(*[h.take_events.remote() for h in self._shared.hosts]))

    async def ping(self) -> list[int]:
        """Round trip to every rank's control loop (answers even while an endpoint computes)."""
        await self.ready()
        return list(await asyncio.gather(*[h.ping.remote() for h in self._shared.hosts]))

    def shutdown(self) -> None:
        """Kill the actors (of every colocated role) and give the pool's placement groups back."""
        self._shared._dead = True
        self._shared.kill()
        self._shared.pool.release()

    def __getattr__(self, name: str) -> _Endpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        caller = self._callers.get(name)
        if caller is None:
            spec = self._endpoints.get(name)
            if spec is None:
                raise AttributeError(f"{self._cls.__name__} (group {self.name!r}) has no endpoint {name!r}; "
                                     f"endpoints: {sorted(self._endpoints)}. Mark methods with @endpoint.")
            caller = self._callers[name] = _Endpoint(self, spec)
        return caller

    def __repr__(self) -> str:
        return f"<WorkerGroup {self.name!r} {self._cls.__name__} x{self.world_size}>"

    def _method_name(self, endpoint: str) -> str:
        return method_name(list(self._shared.roles).index(self._role), endpoint)

    # -- meshes ---------------------------------------------------------------------------------------------------
    def _cached_mesh(self, name: str) -> list[MeshInfo] | None:
        return self._shared.meshes.get((self._role, name))

    async def _mesh(self, name: str, endpoint: str) -> list[MeshInfo]:
        key = (self._role, name)
        if key not in self._shared.meshes:
            await self.ready()
            found = await asyncio.gather(*[h.meshes.remote(self._role) for h in self._shared.hosts])
            self._shared.meshes[key] = _validate_mesh(self.name, endpoint, name, [m.get(name) for m in found])
        return self._shared.meshes[key]


def _check_worker_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"a WorkerGroup runs a subclass of orchestra.Worker, got {cls!r}")


def _validate_mesh(group: str, endpoint: str, name: str, infos: list[MeshInfo | None]) -> list[MeshInfo]:
    where = f"group {group!r}, endpoint {endpoint!r}: shard(mesh={name!r})"
    missing = [r for r, m in enumerate(infos) if m is None]
    if missing:
        raise DispatchError(f"{where}: rank(s) {missing} never called self.register_mesh({name!r}, ...); register the "
                            f"mesh on every rank (e.g. in __init__) before calling this endpoint")
    sizes = {m.dp_size for m in infos}
    if len(sizes) != 1:
        raise DispatchError(f"{where}: ranks disagree on dp_size ({sorted(sizes)})")
    dp = sizes.pop()
    for d in range(dp):
        members = [r for r, m in enumerate(infos) if m.dp_rank == d]
        if not members:
            raise DispatchError(f"{where}: no rank registered dp_rank {d} of dp_size {dp}")
        collectors = [r for r in members if infos[r].is_collector]
        if len(collectors) != 1:
            raise DispatchError(f"{where}: DP replica {d} (ranks {members}) needs exactly one collector rank, has "
                                f"{collectors}")
    return list(infos)


class _Endpoint:
    """A group's endpoint: call it to get a DataFuture; ``.options(timeout=...)`` for a per-call deadline."""

    def __init__(self, group: WorkerGroup, spec: EndpointSpec, timeout: float | None = None,
                 stream: bool = False) -> None:
        self.group, self.spec, self.timeout, self.stream = group, spec, timeout, stream

    def options(self, *, timeout: float | None = None, stream: bool | None = None) -> _Endpoint:
        """This endpoint with call options: ``timeout`` seconds until the call fails with a TimeoutError;
        ``stream=True`` maps a sharded endpoint over the parts of a streamed input as they arrive (``D.stream()``)."""
        return _Endpoint(self.group, self.spec, timeout if timeout is not None else self.timeout,
                         self.stream if stream is None else stream)

    def __repr__(self) -> str:
        return f"<endpoint {self.group.name}.{self.spec.name} dispatch={self.spec.dispatch!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> DataFuture:
        g, spec = self.group, self.spec
        if spec.signature is not None:
            try:
                spec.signature.bind(None, *args, **kwargs)
            except TypeError as e:
                raise DispatchError(f"group {g.name!r}, endpoint {spec.name!r}: {e}; signature is "
                                    f"{spec.name}{spec.signature}") from None
        plan = Plan(group=g, endpoint=spec.name, world_size=g.world_size, ranks=tuple(range(g.world_size)),
                    args=args, kwargs=kwargs)
        plan = spec.dispatch.check(plan)
        if self.stream and not plan.stream:
            plan = stream_transform().check(plan)
        _check_columns(plan, spec)
        fut = DataFuture(group=g.name, endpoint=spec.name, timeout=self.timeout)
        if plan.shard is not None:
            rows = [len(a) if isinstance(a, Batch) else a.rows_if_known() for a in plan.data_args()]
            if rows and all(r is not None for r in rows):
                fut._known_rows = rows[0]
        _stats.add_call()
        gate = g._shared.gate
        ticket = gate.ticket()
        if (g._shared._ready and gate.is_turn(ticket) and not spec.dispatch.needs_split(plan) and not plan.stream
                and not any(isinstance(a, DataFuture) for a in plan.data_args())):
            _bind_collect(fut, spec, plan)  # fast path: send now
            try:
                _send(g, spec, plan, fut, _per_rank_calls(plan, _describe_all_sync(plan)))
            finally:
                gate.release(ticket)
            return fut
        fut._task = asyncio.get_running_loop().create_task(_submit(g, spec, plan, fut, ticket))
        fut._task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return fut


def _check_columns(plan: Plan, spec: EndpointSpec) -> None:
    if not spec.requires:
        return
    for a in plan.data_args():
        if isinstance(a, Batch):
            missing = [k for k in spec.requires if k not in a]
            if missing:
                raise DispatchError(f"{plan.where()}: the batch is missing column(s) {missing} (it has "
                                    f"{sorted(a.keys())}); add them or pass a future whose result has them")


async def _submit(g: WorkerGroup, spec: EndpointSpec, plan: Plan, fut: DataFuture, ticket: int) -> None:
    """Finish the plan (mesh lookups, upstream headers), build per-rank descriptors and send the calls, in the
    order the calls on this group were made."""
    gate = g._shared.gate
    released = False
    try:
        await g.ready()
        await gate.turn(ticket)
        plan = await spec.dispatch.split(plan)
        _bind_collect(fut, spec, plan)
        if plan.stream:
            released = True  # the stream releases the gate once its last part is sent
            await _submit_stream(g, spec, plan, fut, lambda: gate.release(ticket))
        else:
            _send(g, spec, plan, fut, _per_rank_calls(plan, await _describe_all(plan)))
    except BaseException as e:
        gate.release(ticket)
        fut._fail_submit(e if not isinstance(e, asyncio.CancelledError) else
                         asyncio.CancelledError(f"{g.name}.{spec.name} was cancelled before it was sent"))
        if isinstance(e, asyncio.CancelledError):
            raise
    finally:
        if not released:
            gate.release(ticket)


def _bind_collect(fut: DataFuture, spec: EndpointSpec, plan: Plan) -> None:
    """How ``await fut`` assembles per-rank results: the dispatch's collect over the final plan (sharded Batch
    results arrive as one concatenation of every part)."""
    fut._collect = lambda values: spec.dispatch.collect(plan, values)
    fut._concat_all = plan.shard is not None


def _send(g: WorkerGroup, spec: EndpointSpec, plan: Plan, fut: DataFuture,
          calls: dict[int, tuple[tuple, dict, list]]) -> None:
    hosts = g._shared.hosts
    meth = g._method_name(spec.name)
    collectors = set(plan.shard.collectors if plan.shard is not None else
                     plan.collectors if plan.collectors is not None else plan.ranks)
    slots = []
    for r in plan.ranks:
        args, kwargs, refs = calls[r]
        slot = _Slot(r, r in collectors)
        if spec.streaming:
            a, kw = _with_refs(args, kwargs, refs)
            gen = getattr(hosts[r], meth).options(num_returns="streaming").remote(*a, **kw)
            slot.call_ref = gen
            asyncio.get_running_loop().create_task(_drain(gen, slot))
        else:
            a, kw = _with_refs(args, kwargs, refs)
            ref = getattr(hosts[r], meth).remote(*a, **kw)
            slot.call_ref = ref
            slot.add(ref)
            slot.finish()
        slots.append(slot)
    fut._set_slots(slots)


def _with_refs(args: tuple, kwargs: dict, refs: list) -> tuple[tuple, dict]:
    """Upstream header refs ride nested in one keyword argument; the worker fetches them (see Host._call)."""
    if not refs:
        return args, kwargs
    return args, {**kwargs, REFS_KWARG: list(refs)}


async def _drain(gen: Any, slot: _Slot) -> None:
    try:
        async for ref in gen:
            slot.add(ref)
        slot.finish()
    except BaseException as e:  # noqa: BLE001 - surfaced through the future
        slot.finish(e)


async def _slot_refs(fut: DataFuture) -> list[list[ray.ObjectRef]]:
    """The output refs of each collected slot of an upstream future, once its calls are all sent and finished
    streaming (values are not awaited: only the refs are needed)."""
    await fut._wait_submitted()
    for s in fut._slots:
        if s.collected:
            try:
                await s.done
            except BaseException as e:
                raise convert_error(e, fut.group, fut.endpoint, s.rank) from None
    return [list(s.refs) for s in fut._slots if s.collected]


async def _describe_all(plan: Plan) -> dict[int, Any]:
    """Descriptors of every data argument (awaiting upstream futures' submission, never their payloads)."""
    out: dict[int, Any] = {}
    for a in plan.data_args():
        if id(a) not in out and (plan.shard is not None or isinstance(a, DataFuture)):
            out[id(a)] = (_describe_batch(a, plan.shard) if isinstance(a, Batch)
                          else await _describe_data(a, plan.shard, plan))
    return out


def _describe_all_sync(plan: Plan) -> dict[int, Any]:
    """Like ``_describe_all`` when every data argument is a concrete Batch."""
    if plan.shard is None:
        return {}
    return {id(a): _describe_batch(a, plan.shard) for a in plan.data_args()}


def _per_rank_calls(plan: Plan, described: dict[int, Any]) -> dict[int, tuple[tuple, dict, list]]:
    """(args, kwargs, top-level refs) for every executing rank, with data arguments turned into descriptors."""
    spec = plan.shard
    out = {}
    for r in plan.ranks:
        args, kwargs = plan.per_rank.get(r, (plan.args, plan.kwargs))
        b = _ArgBuilder()

        def convert(a: Any) -> Any:
            per_dp = described.get(id(a))
            if per_dp is None:
                return a
            sources, layout = per_dp[spec.dp_of_rank[r] if spec is not None else 0]
            if (len(sources) == 1 and len(sources[0]) == 1 and isinstance(sources[0][0], PartInfo)
                    and layout.kind == "whole" and not layout.pad_rows):
                return sources[0][0].ref  # a controller-made shard: the Batch itself, or its ref for Ray to resolve
            return DataArg(tuple(Source(tuple(b.add(o) for o in src)) for src in sources), layout,
                           values_ok=spec is None)

        out[r] = (tuple([convert(a) for a in args]), {k: convert(v) for k, v in kwargs.items()}, b.refs)
    return out


class _ArgBuilder:
    """Collects the refs a rank's call takes as top-level arguments (Ray resolves them before the call runs)."""

    def __init__(self) -> None:
        self.refs: list[Any] = []
        self._index: dict[Any, int] = {}

    def add(self, o: Any) -> Any:
        if isinstance(o, ray.ObjectRef):
            i = self._index.get(o)
            if i is None:
                i = self._index[o] = len(self.refs)
                self.refs.append(o)
            return i
        return o


INLINE_BYTES = 64 << 10  # controller-made shards below this travel inside the call instead of via ray.put


def _put(b: Batch) -> PartInfo:
    nbytes = b.nbytes
    if nbytes < INLINE_BYTES:
        return PartInfo(b, len(b), nbytes)
    _stats.add_put(nbytes)
    return PartInfo(ray.put(b), len(b), nbytes)


def _describe_batch(a: Batch, spec: Any) -> dict[int, tuple[list[list[Any]], Layout]]:
    """A concrete Batch split by the controller: DP piece d becomes one part that only DP replica d reads."""
    D = spec.dp_size
    batch = a.pad_to_multiple(D) if spec.pad and len(a) % D else a
    shards = batch.split(balanced_sizes(len(batch), D))
    out, start = {}, 0
    for d, s in enumerate(shards):
        pad_rows = min(len(s), max(0, start + len(s) - len(a))) if batch is not a else 0
        start += len(s)
        out[d] = ([[_put(s)]], Layout("whole", pad_rows=pad_rows))
    return out


async def _describe_data(a: Batch | DataFuture, spec: Any, plan: Plan) -> dict[int, tuple[list[list[Any]], Layout]]:
    """Per DP index: the sources (lists of output refs / part infos) and the layout of the rows it reads."""
    comps = list(a._parts_of) if isinstance(a, UnionFuture) else [a]
    if spec is None:  # broadcast: every rank reads everything
        return {0: ([await _all_outputs(c) for c in comps], Layout("whole"))}
    D = spec.dp_size
    slot_lists = []
    aligned = not spec.pad
    for c in comps:
        if isinstance(c, Batch):  # stored as D balanced parts, so that each rank reads about its share
            slot_lists.append([[_put(p) for p in c.chunk(D) if len(p)]])
            aligned = False
        else:
            slots = await _slot_refs(c)
            slot_lists.append(slots)
            aligned = aligned and len(slots) == D
    if aligned:
        return {d: ([slots[d] for slots in slot_lists], Layout("whole")) for d in range(D)}
    flat = [[o for s in slots for o in s] for slots in slot_lists]
    return {d: (flat, Layout("balanced", d, D, spec.pad, allow_empty=spec.allow_empty)) for d in range(D)}


async def _all_outputs(c: Any) -> list[Any]:
    if isinstance(c, Batch):
        return [_put(c)]
    return [o for s in await _slot_refs(c) for o in s]


async def _submit_stream(g: WorkerGroup, spec: EndpointSpec, plan: Plan, fut: DataFuture,
                         release: Any) -> None:
    """``stream()``: one call per arriving upstream part; the part from upstream slot i goes to DP replica i mod D
    (every rank of it). ``release`` is called once the last part is sent."""
    streamed = [a for a in plan.data_args() if isinstance(a, DataFuture)]
    if len(streamed) != 1 or any(isinstance(x, Batch) for x in _components(streamed[0])):
        raise DispatchError(f"{plan.where()}: stream() needs exactly one DataFuture argument (or a union of "
                            f"futures) to map over")
    if spec.streaming:
        raise DispatchError(f"{plan.where()}: stream() maps a plain endpoint over parts; a generator endpoint "
                            f"cannot be mapped")
    src = streamed[0]
    comps = _components(src)
    for c in comps:
        await c._wait_submitted()
    n_slots = {len([s for s in c._slots if s.collected]) for c in comps}
    if len(n_slots) != 1:
        raise DispatchError(f"{plan.where()}: the futures joined with | stream from different numbers of ranks "
                            f"{sorted(n_slots)}; stream() pairs their parts one to one")
    shard = plan.shard
    D = shard.dp_size
    if shard.mesh is not None and n_slots.pop() != D:
        # ranks of a mesh run collectives: every DP replica must get a call per part. With a different number of
        # upstream ranks that cannot keep rows in order, so the call waits for every part and is sent once.
        plan = plan.with_(stream=False)
        _send(g, spec, plan, fut, _per_rank_calls(plan, await _describe_all(plan)))
        release()
        return
    members = {d: [r for r in plan.ranks if shard.dp_of_rank[r] == d] for d in range(D)}
    comp_slots = [[s for s in c._slots if s.collected] for c in comps]
    out_slots = [_Slot(cs.rank, True) for cs in comp_slots[0]]
    fut._set_slots(out_slots)
    hosts = g._shared.hosts
    meth = g._method_name(spec.name)
    remaining = [len(out_slots)]

    def one_done() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            release()

    async def follow(i: int) -> None:
        k = 0
        d = i % D
        try:
            while True:
                if all(len(cs[i].refs) > k for cs in comp_slots):
                    refs = [cs[i].refs[k] for cs in comp_slots]
                    for r in members[d]:
                        args, kwargs = plan.per_rank.get(r, (plan.args, plan.kwargs))
                        darg = DataArg(tuple(Source((j,)) for j in range(len(refs))), Layout("whole"))
                        args = tuple(darg if x is src else x for x in args)
                        kwargs = {kk: (darg if v is src else v) for kk, v in kwargs.items()}
                        a, kw = _with_refs(args, kwargs, refs)
                        ref = getattr(hosts[r], meth).remote(*a, **kw)
                        if r in shard.collectors:
                            out_slots[i].add(ref)
                            out_slots[i].call_ref = ref
                        else:  # tracked for errors only
                            side = _Slot(r, False)
                            side.add(ref)
                            side.finish()
                            fut._slots.append(side)
                    k += 1
                    continue
                if all(cs[i].done.done() for cs in comp_slots):
                    for cs in comp_slots:
                        exc = cs[i].done.exception()
                        if exc is not None:
                            raise convert_error(exc, src.group, src.endpoint, cs[i].rank)
                    if any(len(cs[i].refs) != len(comp_slots[0][i].refs) for cs in comp_slots):
                        raise DispatchError(f"{plan.where()}: the joined futures yielded different numbers of "
                                            f"parts on slot {i}; stream() pairs their parts one to one")
                    out_slots[i].finish()
                    return
                waits = [cs[i].watch() for cs in comp_slots]
                if any(len(cs[i].refs) > k for cs in comp_slots) or any(cs[i].done.done() for cs in comp_slots):
                    continue
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            out_slots[i].finish(e)
        finally:
            one_done()

    loop = asyncio.get_running_loop()
    for i in range(len(out_slots)):
        loop.create_task(follow(i))
    if not out_slots:
        release()


def _components(a: Any) -> list[Any]:
    return list(a._parts_of) if isinstance(a, UnionFuture) else [a]
