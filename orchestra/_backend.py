"""The seam between orchestra's core and where ranks run: a ``Backend`` reserves slots for a pool, spawns one host
per rank, puts and gets parts, and kills hosts.

Two backends implement it: ``"ray"`` (the default and the only one for real jobs: one Ray actor process per rank)
and ``"local"`` (``orchestra._local``: every rank in the controller's process, for fast tests and debugging).
Handles and references keep Ray's shape on both, so the call path above the seam is one code path:

- ``handle.<method>.remote(*args, **kwargs)`` sends a call and returns a *ref*; methods run on the lane named by
  their ``@ray.method(concurrency_group=...)`` (compute, control or watch), in the order they were sent;
- ``handle.<method>.options(num_returns="streaming").remote(...)`` returns an async iterator of refs, one per
  yield, whose ``completed()`` is a ref of the whole call;
- a ref is awaitable, has ``future()`` (a ``concurrent.futures.Future``) and ``task_id().hex()`` (the id the
  controller's cooperative cancellation names calls by); ``get(refs)`` fetches refs of either kind (blocking).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:  # pragma: no cover
    from ._pool import ResourcePool

__all__ = ["Backend", "RayBackend", "Slot", "RankDied", "TaskFailed", "TaskId", "current", "set_current", "is_ref", "get",
           "by_name", "register", "unregister"]

log = logging.getLogger("orchestra")


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: its reservation (a Ray placement group; None in-process), bundle, node and rank among
    the pool's ranks on that node."""

    rank: int
    placement_group: Any
    bundle_index: int
    node_ip: str
    node_id: str
    local_rank: int


class TaskId:
    """A call's id in the shape of Ray's ``TaskID`` (``.hex()``): what cooperative cancellation names calls by, for
    calls that are not Ray tasks (in-process ranks, the fast path)."""

    __slots__ = ("_hex",)

    def __init__(self, h: str) -> None:
        self._hex = h

    def hex(self) -> str:
        return self._hex


class RankDied(Exception):
    """A call's rank is gone (killed, or its group closed under it): the in-process backend's ``ActorDiedError``."""


class TaskFailed(Exception):
    """An in-process host method raised something other than a ``WorkerError`` (Ray's ``RayTaskError``)."""

    def __init__(self, message: str, cause: BaseException | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.cause = cause
        self.remote_traceback = remote_traceback


class ReplyUnreadable(Exception):
    """A reply arrived but could not be rebuilt where it is read (unpickling it raised ``cause``): what Ray reports
    as a ``RaySystemError`` from its deserializer, the fast path's and the in-process backend's equivalent."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class Backend(ABC):
    """Where a pool's ranks run. Subclasses: ``RayBackend`` here, ``LocalBackend`` in ``orchestra._local``."""

    name: str = "?"
    #: whether a rank's process environment is its own (RANK, WORLD_SIZE, MASTER_ADDR ... are set per rank)
    own_process: bool = True

    @abstractmethod
    def resources(self) -> dict[str, float]:
        """Total resources (``{"CPU": 4.0, ...}``)."""

    @abstractmethod
    def check_fits(self, pool: ResourcePool) -> None:
        """Raise ``PlacementError`` at once when ``pool`` can never be placed. Blocking."""

    @abstractmethod
    async def reserve(self, pool: ResourcePool, held: list[Any]) -> list[Slot]:
        """Reserve ``pool``'s slots; every reservation made is appended to ``held`` as soon as it exists (so that a
        cancelled reserve can still be given back with ``unreserve``). Returns one Slot per rank."""

    @abstractmethod
    def unreserve(self, held: list[Any], pool_name: str) -> None:
        """Give reservations back (the hosts placed in them must be gone). Blocking."""

    @abstractmethod
    def spawn(self, pool: ResourcePool, host_cls: type, slots: list[Slot], group: str,
              concurrency_groups: dict[str, int]) -> list[Any]:
        """Start one host per slot: ``host_cls(group, rank, world_size, local_rank, placement)``; returns handles."""

    @abstractmethod
    def kill(self, handle: Any) -> None:
        """End a host now: its calls in flight and later ones fail as a dead rank's. Blocking."""

    @abstractmethod
    def put(self, obj: Any) -> Any:
        """Store ``obj`` for readers on any rank; returns its ref. Readers share the stored object: never write it."""

    def wait_exited(self, ranks: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
        """Wait (blocking) until the processes of killed ranks (``Host.process()``'s entries) have exited, up to
        ``timeout`` seconds; returns the entries of those still running. Nothing to wait for by default."""
        return []


class RayBackend(Backend):
    """One Ray actor process per rank, placed in a STRICT_PACK placement group per node entry of the pool."""

    name = "ray"
    own_process = True

    def resources(self) -> dict[str, float]:
        return dict(ray.cluster_resources())

    def check_fits(self, pool: ResourcePool) -> None:
        bundle = pool.bundle()
        need_total = {k: v * pool.world_size for k, v in bundle.items()}
        avail = ray.available_resources()
        total = ray.cluster_resources()
        node_totals = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        problems = []
        for k, v in need_total.items():
            if total.get(k, 0.0) + 1e-9 < v:
                problems.append(f"{k}: need {v:g}, available {avail.get(k, 0.0):g} of {total.get(k, 0):g}")
        for i, count in enumerate(pool.process_on_nodes):
            need = {k: v * count for k, v in bundle.items()}
            if not any(all(t.get(k, 0.0) + 1e-9 >= v for k, v in need.items()) for t in node_totals):
                problems.append(f"node entry {i} needs {need} on ONE node; the largest node has "
                                f"{_largest(node_totals, need)}")
        if problems:
            from ._errors import PlacementError

            raise PlacementError(pool.fit_message(problems))

    async def reserve(self, pool: ResourcePool, held: list[Any]) -> list[Slot]:
        import asyncio
        import uuid

        import anyio
        from ray.util.placement_group import placement_group, placement_group_table

        from ._errors import PlacementError

        bundle = pool.bundle()

        def create() -> list[Any]:
            # entries spread over distinct nodes (STRICT_SPREAD across entries, STRICT_PACK within one): each
            # entry gets a node of its own that can hold it as a soft target, biggest entries first
            targets: dict[int, str] = {}
            if len(pool.process_on_nodes) > 1:
                nodes = sorted((n for n in ray.nodes() if n.get("Alive")),
                               key=lambda n: -n.get("Resources", {}).get("CPU", 0.0))
                for i in sorted(range(len(pool.process_on_nodes)), key=lambda i: -pool.process_on_nodes[i]):
                    need = {k: v * pool.process_on_nodes[i] for k, v in bundle.items()}
                    node = next((n["NodeID"] for n in nodes if n["NodeID"] not in targets.values() and
                                 all(n.get("Resources", {}).get(k, 0.0) + 1e-9 >= v for k, v in need.items())), None)
                    if node is not None:
                        targets[i] = node
            made = []
            for i, n in enumerate(pool.process_on_nodes):  # recorded as made, so a cancel still releases them
                pg = placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK",
                                     name=f"{pool.name}-{i}-{uuid.uuid4().hex[:8]}",
                                     _soft_target_node_id=targets.get(i))
                held.append(pg)
                made.append(pg)
            return made

        pgs = await anyio.to_thread.run_sync(create)
        try:
            await asyncio.wait_for(asyncio.gather(*[pg.ready() for pg in pgs]), pool.placement_timeout)
        except asyncio.TimeoutError:
            states = await anyio.to_thread.run_sync(lambda: [placement_group_table(pg).get("state") for pg in pgs])
            avail = await anyio.to_thread.run_sync(ray.available_resources)
            raise PlacementError(pool.fit_message(
                [f"placement groups not ready after {pool.placement_timeout:g} s (states {states}); the cluster "
                 f"has {avail} available"])) from None

        def where() -> list[tuple[str, str, Any, int]]:
            node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            return [(node_ip.get(node, ""), node, pg, count)
                    for pg, count in zip(pgs, pool.process_on_nodes)
                    for node in [placement_group_table(pg)["bundles_to_node_id"][0]]]

        placed = await anyio.to_thread.run_sync(where)
        shared: dict[str, list[int]] = {}
        for i, (_ip, node, _, _) in enumerate(placed):
            shared.setdefault(node, []).append(i)
        shared = {node: entries for node, entries in shared.items() if len(entries) > 1}
        if shared:
            log.warning("resource pool %r: node entries share a node (%s): the cluster has no free node for each "
                        "entry (process_on_nodes=%s); ranks of different entries then compete for that node",
                        pool.name, "; ".join(f"entries {e} on {node[:12]}" for node, e in shared.items()),
                        pool.process_on_nodes)
        placed.sort(key=lambda t: tuple(int(x) if x.isdigit() else 0 for x in t[0].split(".")))
        slots, rank, per_node = [], 0, {}
        for ip, node, pg, count in placed:
            for b in range(count):
                local = per_node.get(node, 0)
                per_node[node] = local + 1
                slots.append(Slot(rank, pg, b, ip, node, local))
                rank += 1
        return slots

    def unreserve(self, held: list[Any], pool_name: str) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in held:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - Ray already gone, or the group already removed
                log.warning("resource pool %r: could not remove placement group %s: %r", pool_name, pg.id.hex(), e)

    def spawn(self, pool: ResourcePool, host_cls: type, slots: list[Slot], group: str,
              concurrency_groups: dict[str, int]) -> list[Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(concurrency_groups=concurrency_groups)(host_cls)
        res = pool.actor_resources()
        return [actor_cls.options(
                    **res, scheduling_strategy=PlacementGroupSchedulingStrategy(s.placement_group, s.bundle_index),
                ).remote(group, s.rank, len(slots), s.local_rank,
                         {"bundle_index": s.bundle_index, "placement_group": s.placement_group.id.hex()})
                for s in slots]

    def kill(self, handle: Any) -> None:
        ray.kill(handle)

    def wait_exited(self, ranks: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
        """``ray.kill`` returns before the process ends (and frees its memory and devices): wait for the ranks on
        this node (their pids are seen here) until each has exited, polling; ranks on other nodes are not waited
        for (their processes cannot be seen from here)."""
        try:
            if _client_mode():  # the node id is the client server's, and its processes are not this machine's
                return []
            here = ray.get_runtime_context().get_node_id()
        except Exception as e:  # noqa: BLE001 - no node context (Ray gone): nothing here to wait for
            log.debug("wait_exited: no node id here: %r", e)
            return []
        left = [r for r in ranks if r.get("node_id") == here and isinstance(r.get("pid"), int)
                and r["pid"] != os.getpid()]
        deadline, pause = time.monotonic() + timeout, 0.001
        while True:
            left = [r for r in left if _running(r["pid"], r.get("start"))]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def put(self, obj: Any) -> Any:
        return ray.put(obj)


def _running(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` still runs: not gone, not another process that took its pid since (its start time is
    not ``start``), and not a zombie whose threads have all exited (its memory and devices are released; it only
    waits for its parent to read its status). Read from /proc on Linux; elsewhere, whether the pid exists."""
    if _PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            return False
        if start is not None and int(fields[19]) != start:
            return False
        return fields[0] not in (b"Z", b"X") or int(fields[17]) > 1
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the pid: ours is gone
        return False
    return True


def process_start(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot, from /proc), which tells it from a later process that
    took its pid; None where there is no /proc."""
    if not _PROC:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _client_mode() -> bool:
    """Whether this process drives Ray through Ray Client (its nodes' processes are not on this machine)."""
    from ray.util.client import ray as client

    return client.is_connected()


_PROC = os.path.exists("/proc/self/stat")


def _largest(node_totals: list[dict], need: dict) -> dict:
    if not node_totals:
        return {}
    best = max(node_totals, key=lambda t: tuple(t.get(k, 0.0) for k in need))
    return {k: best.get(k, 0.0) for k in need}


# -- references of either backend ----------------------------------------------------------------------------------
def is_ref(x: Any) -> bool:
    """True for a stored object's reference (a Ray ``ObjectRef`` or an in-process one)."""
    return isinstance(x, ray.ObjectRef) or getattr(type(x), "_orc_ref", False)


def get(refs: list[Any]) -> list[Any]:
    """Fetch ``refs`` (blocking; never on an event loop): Ray's in one ``ray.get``, in-process ones directly."""
    if not refs:
        return []
    if all(isinstance(r, ray.ObjectRef) for r in refs):
        return ray.get(list(refs))
    return [r.get() if getattr(type(r), "_orc_ref", False) else ray.get(r) for r in refs]


# -- which backend new pools use --------------------------------------------------------------------------------------
_RAY = RayBackend()
_registry: dict[str, Backend] = {"ray": _RAY}
_current: list[Backend] = [_RAY]


def register(backend: Backend) -> None:
    """Make ``backend`` selectable by name (``ResourcePool(backend=name)``)."""
    _registry[backend.name] = backend


def unregister(name: str) -> None:
    """Forget the backend registered as ``name`` (Ray's stays)."""
    if name != "ray":
        _registry.pop(name, None)


def by_name(name: str) -> Backend:
    """The backend registered as ``name``; ValueError naming the choices otherwise."""
    try:
        return _registry[name]
    except KeyError:
        hint = " (start it with orc.init(backend='local'))" if name == "local" else ""
        raise ValueError(f"no orchestra backend {name!r} is running{hint}; running: {sorted(_registry)}") from None


_session = [0]  # bumped by orc.shutdown(): a pool made before then belongs to a session that ended


def session() -> int:
    """The number of the session new pools belong to (how many times ``orc.shutdown()`` ended one)."""
    return _session[0]


def end_session() -> None:
    """``orc.shutdown()``: pools made until now belong to a session that ended (their reservations went with it)."""
    _session[0] += 1


def current() -> Backend:
    """The backend a new pool uses when it names none (the one ``orc.init`` started last)."""
    return _current[0]


def set_current(backend: Backend | None) -> None:
    """Make ``backend`` the default for new pools (None: Ray again)."""
    _current[0] = backend or _RAY
