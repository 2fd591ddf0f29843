"""The process behind each rank: a Ray actor that hosts one or more Worker roles.

A threaded actor with two concurrency groups: "control" (ping, stats, meshes) answers at once, even while an
endpoint computes; "compute" is one thread that runs endpoint bodies one at a time, in the order calls arrive
(async endpoints run on an event loop owned by that thread).
Data arguments are resolved here: the host fetches only the parts overlapping its rows, slices and concatenates
them, and stores its results as parts (bounded in size so that readers can fetch just what they need).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import faulthandler
import logging
import os
import pickle
import socket
import threading
import time
import traceback
import types
from collections.abc import Iterator
from typing import Any

import ray

from . import _backend, _channel, _frame, _sessions
from ._batch import Batch, balanced_sizes
from ._errors import DECLARED_DEAD, UPSTREAM_FAILED, OrchestraError, WorkerDiedError, WorkerError
from ._wire import (FRAME_KWARG, FRAME_REFS_KWARG, INLINE_BYTES, REFS_KWARG, SHARED_KWARG, STORE_KWARG, DataArg,
                    Output, PartInfo, RefAt, Source, Span, columns_apart, overlapping, padded_again, padded_apart,
                    rank_value, reader_cuts, row_range)
from ._worker import EndpointSpec, Worker, _Context, endpoints_of

log = logging.getLogger("orchestra")

__all__ = ["Host"]

PART_BYTES = int(os.environ.get("ORCHESTRA_PART_BYTES", 8 << 20))
MIN_PART_BYTES = 1 << 20


def part_count(nbytes: int) -> int:
    """How many parts an output of ``nbytes`` is stored as: parts of at most PART_BYTES, and at least 8 parts of
    >= 1 MiB each for outputs that large, so that a reader of a reshard fetches little beyond its own rows."""
    target = min(PART_BYTES, max(MIN_PART_BYTES, nbytes // 8))
    return max(1, -(-nbytes // target))


def _part_sizes(n: int, nbytes: int, span: Span | None, readers: tuple[int, ...]) -> list[int]:
    """Row counts of the parts an output of ``n`` rows is stored as (see ``Host._store``)."""
    if not n:
        return [0]
    if nbytes < INLINE_BYTES:  # rides in the reply whole: every reader of the reply gets all of it anyway
        return [n]
    if span is None:
        return balanced_sizes(n, max(1, min(n, part_count(nbytes))))
    bounds = [0, *reader_cuts(span, readers), n]
    sizes = []
    for lo, hi in zip(bounds, bounds[1:]):  # each reader-aligned piece, split further to at most PART_BYTES
        rows = hi - lo
        pieces = max(1, min(rows, -(-(nbytes * rows // n) // PART_BYTES)))
        sizes.extend(balanced_sizes(rows, pieces))
    return sizes


def _span_of(parts: list[PartInfo]) -> Span | None:
    """Where ``parts`` (one reader's, in order) sit in their call's rows, when each says and they are contiguous."""
    if not parts or parts[0].start < 0:
        return None
    at, total = parts[0].start, parts[0].total
    for p in parts:
        if p.start != at or p.total != total:
            return None
        at += p.rows
    return Span(parts[0].start, at - parts[0].start, total)


def _wanted(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """Global row ranges for rows [start, stop) of a sequence padded past ``n`` by wrapping to its first rows."""
    out, i = [], start
    while i < stop and n:
        lo = i % n if i >= n else i
        hi = min(n, lo + (stop - i))
        out.append((lo, hi))
        i += hi - lo
    return out


def _counters() -> dict[str, float]:
    """One endpoint's counters (``WorkerGroup.stats()``): ``calls`` begun (running ones too; failed and cancelled
    ones too), of which ``errors`` ended with an error and ``cancelled`` were cancelled; parts/rows/bytes fetched and
    produced; ``seconds`` spent in the endpoint (a generator's: in its body between yields)."""
    return {"calls": 0, "errors": 0, "cancelled": 0, "parts_in": 0, "rows_in": 0, "rows_used": 0, "bytes_in": 0,
            "parts_out": 0, "rows_out": 0, "bytes_out": 0, "seconds": 0.0}


COMPUTE = "compute"
CONTROL = "control"
WATCH = "watch"  # one call per rank that never returns while the process lives: the controller's death notice
FORWARD = "forward"  # a reader's fetch of a fast-path result that is still being computed (Host.retained)
CONCURRENCY_GROUPS = {COMPUTE: 1, CONTROL: 1, WATCH: 1, FORWARD: 4}


_DONE = object()
_GENERATORS = (types.GeneratorType, types.AsyncGeneratorType)  # what inspect.isgenerator / isasyncgen test, in one


def _is_value(o: Any) -> bool:
    return not isinstance(o, PartInfo) and not (isinstance(o, Output) and o.parts is not None)


def _split_refs(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """The user arguments, and the upstream headers the call reads (fetched here, in the worker, not by Ray before
    the call: a task whose argument failed upstream would never reach the actor and stall its ordered queue).
    An upstream failure raises a WorkerError marked UPSTREAM_FAILED: the controller reports the upstream's own
    error (its group, rank and endpoint) instead of this rank's."""
    refs = kwargs.pop(REFS_KWARG, None)
    if not refs:
        return args, ()
    try:
        values = _backend.get(refs)
    except (ray.exceptions.RayError, _backend.RankDied, _backend.TaskFailed, OrchestraError) as e:
        raise WorkerError(f"an upstream call this one reads from failed: {type(e).__name__}",
                          exc_type=UPSTREAM_FAILED) from None
    return args, tuple(_frame.read_reply(v) for v in values)  # an upstream rank's reply frame (Host._reply)


def _unframe(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A Ray call's arguments: unpickled from its frame when the controller sent one (see ``orchestra._frame``);
    the call's positional arguments are then the values Ray resolved for the refs given as arguments."""
    blob = kwargs.pop(FRAME_KWARG, None)
    if blob is None:
        return args, kwargs
    return _frame.loads_call(blob, kwargs.pop(FRAME_REFS_KWARG, ()), args)  # args: the resolved top-level refs


def _own_batches(v: Any) -> Any:
    """``v`` with every Batch in its lists, tuples and dicts cloned (the rest as is)."""
    if isinstance(v, Batch):
        return v.clone()
    if type(v) in (list, tuple):  # (a subclass, a named tuple: as is)
        return type(v)(_own_batches(x) for x in v)
    if type(v) is dict:
        return {k: _own_batches(x) for k, x in v.items()}
    return v


def _require(spec: EndpointSpec, batch: Batch) -> None:
    """Raise KeyError naming the columns endpoint ``spec`` requires that ``batch`` lacks."""
    missing = [k for k in spec.requires if k not in batch]
    if missing:
        raise KeyError(f"input is missing column(s) {missing} that endpoint {spec.name!r} requires; it has "
                       f"{sorted(batch.keys())}")


def _rows_in(args: tuple, kwargs: dict) -> int:
    """Rows of the (padded) data input of a call: its Batch arguments, which a union made row-aligned."""
    return next((len(a) for a in (*args, *kwargs.values()) if isinstance(a, Batch)), 0)


def host_class(roles: dict[str, type]) -> type:
    """A Host subclass with one actor method per (role, endpoint), so a call carries only its own arguments."""
    methods: dict[str, Any] = {}
    for i, (role, cls) in enumerate(roles.items()):
        for name, spec in endpoints_of(cls).items():
            methods[method_name(i, name)] = _method(role, name, spec.streaming)
    return type("Host", (Host,), methods)


def method_name(role_index: int, endpoint: str) -> str:
    return f"r{role_index}_{endpoint}"


def _method(role: str, name: str, streaming: bool) -> Any:
    if streaming:
        def m(self, *args, **kwargs):
            yield from self._call_stream(role, name, args, kwargs)
    else:
        def m(self, *args, **kwargs):
            return self._reply(self._call(role, name, args, kwargs), role, name)
    m.__name__ = m.__qualname__ = name
    return ray.method(concurrency_group=COMPUTE)(m)


_SCALARS = frozenset((type(None), bool, int, float, str))  # replies Ray encodes itself (see Host._reply)


def _not_a_frame(value: Any, rank: int) -> Any:
    """``value`` as a reply that is not a frame: a bytes-like value inside an Output (see ``Host._reply``; Ray
    hands a bytearray or a bytes subclass back as plain bytes, which would read as a frame)."""
    return Output(rank, value=value) if isinstance(value, (bytes, bytearray, memoryview)) else value


def _shrunk(e: WorkerError, limit: int = 64 << 10) -> WorkerError:
    """``e`` with its message and remote traceback cut to ``limit`` characters each, so that it fits a frame."""
    def cut(text: str) -> str:
        return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters cut]"
    return type(e)(cut(e.message), group=e.group, role=e.role, rank=e.rank, endpoint=e.endpoint,
                   remote_traceback=cut(e.remote_traceback), exc_type=e.exc_type)


class RayRuntime:
    """What a host asks of the process it runs in, inside a Ray actor. The in-process backend gives hosts its own
    (``orchestra._local``). The Ray runtime context is bound lazily: making one per call costs more than the call."""

    own_process = True  # RANK, WORLD_SIZE, MASTER_ADDR ... are this process's own environment

    def __init__(self) -> None:
        self._ctx = None

    def _context(self) -> Any:
        if self._ctx is None:
            self._ctx = ray.get_runtime_context()
        return self._ctx

    def task_id(self) -> str | None:
        """The id of the call running now on this thread (what the controller cancels calls by)."""
        return self._context().get_task_id()

    def runtime_cancelled(self) -> bool:
        """Whether Ray itself cancelled the call running now."""
        return self._context().is_canceled()

    def put(self, obj: Any) -> Any:
        return ray.put(obj)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def log_path(self) -> str | None:
        """The file this process's stderr goes to (Ray's ``worker-...-<pid>.err`` on its node), if it is one: where
        a crash leaves its last words and each thread's Python stack."""
        try:
            path = os.readlink("/proc/self/fd/2")
        except OSError:  # not Linux, or no stderr
            return None
        return path if path.startswith("/") and os.path.isfile(path) else None

    def placement(self) -> tuple[list[Any], str | None]:
        """(GPU ids, node id) of this process."""
        try:
            ctx = self._context()
            return list(ctx.get_accelerator_ids().get("GPU", [])), ctx.get_node_id()
        except Exception:  # pragma: no cover - outside Ray
            return [], None


class CallCancelled(Exception):
    """Raised on the worker for a call the controller cancelled (its id was in cancel_calls) before it started,
    while it waited for its inputs, or while it ran: a cancelled call has no result, for the caller or any reader."""


class _CancelledCalls:
    """Ray task ids (hex) of calls the controller cancelled. The control lane adds, the compute lane checks at a call's start,
    between a generator's yields and whenever an endpoint polls ``Worker.cancelled()``. Cooperative: Ray's own
    task cancellation can leave a gap in an actor's ordered queue (a cancelled task that never reached the actor
    stalls every later call for 30 s), so it is not used."""

    def __init__(self, keep: int = 100_000) -> None:
        self._lock = threading.Lock()
        self.ids: set[str] = set()  # read without the lock (a set's membership test is atomic)
        self._order: collections.deque = collections.deque()
        self._keep = keep

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, ids: list[str]) -> None:
        with self._lock:
            for i in ids:
                if i not in self.ids:
                    self.ids.add(i)
                    self._order.append(i)
            while len(self._order) > self._keep:
                self.ids.discard(self._order.popleft())

    def __contains__(self, call_id: object) -> bool:
        return call_id in self.ids


class _Stats:
    """Per role, per endpoint counters. The compute lane counts a call when it begins (``begin``: ``calls``) and adds
    the rest of what it did when it ends (``commit``), each under the lock; the control lane reads (``snapshot``) and
    resets (``reset``) under the same lock: a snapshot never holds part of a call's counts. A call running across a
    reset of its role counts after the reset, whole (its ``calls`` too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_role: dict[str, dict[str, dict[str, float]]] = {}

    def _get(self, role: str, name: str) -> dict[str, float]:
        """The counters of (role, endpoint), created on first use; under ``self._lock`` (``begin``, ``commit``)."""
        eps = self._by_role.get(role)
        if eps is None:
            eps = self._by_role[role] = {}
        c = eps.get(name)
        if c is None:
            c = eps[name] = _counters()
        return c

    def begin(self, role: str, name: str) -> tuple[collections.defaultdict, dict[str, float]]:
        """Count a call of (role, endpoint) begun: its tally (what it adds as it runs, kept by the call itself, no
        lock; a key not touched reads 0, from C: no Python call on the path) and the counters it was counted in (for
        ``commit``)."""
        with self._lock:
            try:
                c = self._by_role[role][name]
            except KeyError:
                c = self._get(role, name)
            c["calls"] += 1
        return collections.defaultdict(int), c

    def commit(self, role: str, name: str, tally: dict[str, float], held: dict[str, float],
               seconds: float) -> dict[str, float]:
        """Add what a call did (``tally`` and the ``seconds`` it ran) to the counters ``held`` (``begin``'s). Those
        of a role reset meanwhile were emptied: the call counts in the new ones, its ``calls`` too. Returns the
        counters it counted in (a stream commits at every part)."""
        with self._lock:
            if not held:
                held = self._get(role, name)
                held["calls"] += 1
            if tally:
                for k, v in tally.items():
                    held[k] += v
            held["seconds"] += seconds
        return held

    def snapshot(self, role: str | None = None) -> dict[str, dict[str, float]]:
        with self._lock:
            roles = [role] if role else list(self._by_role)
            return {ep: dict(c) for r in roles for ep, c in self._by_role.get(r, {}).items()}

    def reset(self, role: str | None = None) -> None:
        """Forget the counters of ``role`` (None: of every role on this rank). Those dropped are emptied, which tells
        a call that runs across the reset (``commit``)."""
        with self._lock:
            for r in ([role] if role is not None else list(self._by_role)):
                for c in self._by_role.pop(r, {}).values():
                    c.clear()


class _Events:
    """Trace spans recorded by the compute lane and taken by the control lane; none is lost between the two. At most
    ``maxlen`` are kept between two takes: past it the oldest are dropped, and counted (``take`` reports them)."""

    def __init__(self, maxlen: int = 200_000) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque = collections.deque(maxlen=maxlen)
        self._dropped = 0

    def add(self, event: dict) -> None:
        with self._lock:
            if len(self._items) == self._items.maxlen:
                self._dropped += 1
            self._items.append(event)

    def take(self) -> list[dict]:
        """The spans added since the last take (the count of dropped ones stays for ``take_counted``)."""
        with self._lock:
            items, self._items = self._items, collections.deque(maxlen=self._items.maxlen)
        return list(items)

    def take_counted(self) -> tuple[list[dict], int]:
        """The spans added since the last take, and how many were dropped since the last ``take_counted`` (the
        buffer was full)."""
        with self._lock:
            items, self._items = self._items, collections.deque(maxlen=self._items.maxlen)
            dropped, self._dropped = self._dropped, 0
        return list(items), dropped


def _bound_anywhere() -> socket.socket:
    """A TCP socket bound with SO_REUSEADDR to a free port on every address (IPv6 ``::`` taking IPv4 too, else
    IPv4), never listening. (``engines._dist._hold_port`` is the same for ``spawn``: engines do not import
    orchestra, which imports Ray.)"""
    dual = socket.has_dualstack_ipv6()  # "::" then takes IPv4 too
    s = socket.socket(socket.AF_INET6 if dual else socket.AF_INET, socket.SOCK_STREAM)
    if dual:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::" if dual else "", 0))
    return s


_this_process: list[Any] = [None]


def process_host() -> Any:
    """The Host of this process when it is a rank's own process (a Ray actor), else None (the in-process backend
    keeps one Host per lane thread: ``_local.current_host``)."""
    return _this_process[0]


def _dump_stacks_on_crash() -> None:
    """On a fatal signal (SIGSEGV, SIGABRT from a heap-corruption check or ``std::terminate``, ...), write every
    Python thread's stack to stderr (fd 2: the worker's log) first. Ray enables ``faulthandler`` for the current
    thread only, then its core worker installs its own crash handler, which runs first and passes the signal on;
    on a corrupted heap it died before that, leaving a log with no Python stack at all. ``enable()`` on an enabled
    faulthandler does not reinstall its handlers, so it is disabled (which also takes Ray's handler down: its report
    of the signal is replaced by Python's ``Fatal Python error: ...``) and enabled again."""
    try:
        faulthandler.disable()
        faulthandler.enable(file=2, all_threads=True)
    except (OSError, ValueError, RuntimeError) as e:  # no fd 2: the rank runs on, without the dump
        log.warning("rank process %d: could not enable faulthandler on fd 2 (%r); a crash will leave no Python stack",
                    os.getpid(), e)


def _unwrap_helpers(host: Host) -> None:
    """Bind ``host``'s private helpers (``Host._call`` and the like, never called through Ray) unwrapped. Ray wraps
    every method of an actor class for its tracing, so each helper call of a call's path ran through one more Python
    frame and a check, tracing on or not; the methods Ray calls keep Ray's wrapper. Only Ray's wrapper is taken off
    (a subclass's own helper stays)."""
    cls = type(host)
    for name in [n for n in vars(Host) if n.startswith("_") and not n.startswith("__")] + ["is_cancelled"]:
        fn = getattr(cls, name, None)
        if getattr(fn, "__ray_tracing_wrapped__", False):
            setattr(host, name, fn.__wrapped__.__get__(host))


class Host:
    """Ray actor hosting the roles of one rank (several roles when colocated)."""

    def __init__(self, group: str, rank: int, world_size: int, local_rank: int, placement: dict[str, Any],
                 runtime: Any = None) -> None:
        self.runtime = runtime if runtime is not None else RayRuntime()
        if self.runtime.own_process:
            _dump_stacks_on_crash()
            _this_process[0] = self  # a rank's process holds one Host (process_host)
        self.group, self.rank, self.world_size, self.local_rank = group, rank, world_size, local_rank
        self.placement = placement
        self.roles: dict[str, Worker] = {}
        self.specs: dict[str, dict[str, EndpointSpec]] = {}
        self.contexts: dict[str, _Context] = {}
        self.stats_ = _Stats()
        self.cancelled_calls = _CancelledCalls()
        self._watching = threading.Event()
        self._declared: str | None = None  # why a role declared this rank dead (Worker.declare_dead): none if not
        self._inline_parts = 0  # results stored inline so far (names them for traces)
        # what names this host's inline parts apart from another group's of the same name (traces key parts by name)
        self._inline_tag = f"{group}:{rank}:{os.getpid()}.{id(self):x}"
        self._loop: asyncio.AbstractEventLoop | None = None  # compute thread's loop for async endpoints
        self._fast_call: str | None = None  # the id of the fast-path call running now on the compute lane
        self._kept: dict[str, Any] = {}  # fast-path results a frame cannot carry (refs, > 1 MiB), until taken
        self._kept_lock = threading.Lock()
        self.sessions = _sessions.Sessions()  # how far each fast-path session got; readers waiting on its calls
        self._held_ports: list[socket.socket] = []  # MASTER_PORT, kept bound for this rank's process group (address)
        self.tracing = False
        self.events = _Events()
        _unwrap_helpers(self)

    def _aloop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    # -- control plane --------------------------------------------------------------------------------------------
    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> int | dict[str, str]:
        """The rank, or ``{"declared_dead": why}`` once a role declared it dead (its process still answers)."""
        return self._rank_or_declared()

    @ray.method(concurrency_group=CONTROL)
    def process(self) -> dict[str, Any]:
        """This rank's process — pid, start time (``_backend.process_start``) and node — asked before set-up, so
        that closing the group can wait for the process to exit even when its start-up failed."""
        return {"rank": self.rank, "pid": os.getpid(), "start": _backend.process_start(os.getpid()),
                "node_id": self.runtime.placement()[1]}

    @ray.method(concurrency_group=CONTROL)
    def address(self) -> tuple[str, int]:
        """This node's address and a free TCP port on it, for MASTER_ADDR / MASTER_PORT. This host keeps the port
        bound on every address (SO_REUSEADDR, never listening) for as long as it lives, so that a port picked free is
        not taken before this rank's process group listens on it (which binds with SO_REUSEADDR, as torch's store and
        ``engines.rendezvous_store`` do): a plain bind, a bind to port 0 and an outgoing connection cannot get it. (A
        SO_REUSEADDR bind can, which only a port chosen on purpose would meet.)"""
        ip = self.runtime.node_ip()
        hold = _bound_anywhere()
        port = hold.getsockname()[1]
        if self.runtime.own_process:  # closed with the process
            self._held_ports.append(hold)
        else:  # in-process ranks build no process group of their own
            hold.close()
        return ip, port

    @ray.method(concurrency_group=COMPUTE)
    def setup(self, env: dict[str, str], roles: dict[str, tuple[type, tuple, dict]]) -> dict[str, Any]:
        """Set the distributed environment, then build each role's Worker (in the compute thread)."""
        if self.runtime.own_process:  # in-process ranks share one environment: Worker.rank etc. say who they are
            os.environ.update(env)
        for role, (cls, args, kwargs) in roles.items():
            ctx = _Context(self.group, role, self.rank, self.world_size, self.local_rank, self.is_cancelled,
                           own_process=self.runtime.own_process, declare_dead=self._declare_dead)
            try:
                obj = cls.__new__(cls)
                obj._orc = ctx
                obj.__init__(*args, **kwargs)
            except BaseException as e:
                raise self._error(e, role, "__init__") from None
            self.roles[role] = obj
            self.contexts[role] = ctx
            self.specs[role] = endpoints_of(cls)
        return self.describe()

    @ray.method(concurrency_group=CONTROL)
    def describe(self) -> dict[str, Any]:
        import torch

        gpu_ids, node = self.runtime.placement()
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return {
            "rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "node_ip": self.runtime.node_ip(),
            "node_id": node, "log": self.runtime.log_path(), **self.placement, "gpu_ids": list(gpu_ids),
            "device": device, "roles": list(self.roles),
            "meshes": {role: {n: dataclasses.asdict(m) for n, m in c.meshes.items()}
                       for role, c in self.contexts.items()},
        }

    @ray.method(concurrency_group=CONTROL)
    def meshes(self, role: str) -> dict[str, Any]:
        return dict(self.contexts[role].meshes)

    @ray.method(concurrency_group=WATCH)
    def watch(self) -> int | dict[str, str]:
        """Block until the host is told to stop watching: the controller holds this call's ref, and Ray fails it
        within milliseconds of the process dying (crash, OOM kill, node loss). Returns the rank, or
        ``{"declared_dead": why}`` once a role declared the rank dead (``Worker.declare_dead``)."""
        self._watching.wait()
        return self._rank_or_declared()

    def _rank_or_declared(self) -> int | dict[str, str]:
        return self.rank if self._declared is None else {"declared_dead": self._declared}

    def _declare_dead(self, why: str) -> None:
        """A role's ``Worker.declare_dead``: the first reason stands; the watch call returns it to supervision."""
        if self._declared is None:
            self._declared = why
            log.error("group %r rank %d declared dead: %s", self.group, self.rank, why)
        self._watching.set()

    @ray.method(concurrency_group=CONTROL)
    def stop_watch(self) -> None:
        self._watching.set()

    @ray.method(concurrency_group=CONTROL)
    def cancel_calls(self, ids: list[str]) -> None:
        """Mark calls cancelled: one not started yet is skipped, a running one sees ``Worker.cancelled()``."""
        self.cancelled_calls.add(ids)

    def is_cancelled(self) -> bool:
        """Whether the call running now on the compute lane was cancelled (by the controller, by its Ray task id,
        or through Ray). Free while nothing was ever cancelled on this rank."""
        if self._fast_call is not None:  # a fast-path call: cancelled only by its own id (no Ray task of its own)
            return self._fast_call in self.cancelled_calls.ids
        if self.cancelled_calls and self.runtime.task_id() in self.cancelled_calls:
            return True
        return self.runtime.runtime_cancelled()

    @ray.method(concurrency_group=CONTROL)
    def stats(self, role: str | None = None) -> dict[str, dict[str, float]]:
        return self.stats_.snapshot(role)

    @ray.method(concurrency_group=CONTROL)
    def reset_stats(self, role: str | None = None) -> None:
        """Zero the counters of ``role`` (None: of every role hosted here). A call running meanwhile counts after."""
        self.stats_.reset(role)

    @ray.method(concurrency_group=CONTROL)
    def set_tracing(self, enabled: bool) -> float:
        """Record a span per call (or stop); returns this rank's own wall clock as recording turned on, so that a
        tracer can tell the spans that started after it by this process's clock, not the controller's."""
        now = time.time()
        self.tracing = enabled
        return now

    @ray.method(concurrency_group=CONTROL)
    def take_events(self, counted: bool = False) -> tuple[int, list[dict]] | dict[str, Any]:
        """(pid, recorded spans) since the last take; each span names the parts it fetched and produced (its
        ``error``: the exception type of a call that failed, ``cancelled``: True for one that was cancelled).
        ``counted``: ``{"pid", "spans", "dropped"}`` instead, ``dropped`` the spans this rank had to drop since the
        last counted take (more than ``_Events``' ``maxlen`` between two takes)."""
        if counted:
            spans, dropped = self.events.take_counted()
            return {"pid": os.getpid(), "spans": spans, "dropped": dropped}
        return os.getpid(), self.events.take()

    @ray.method(concurrency_group=COMPUTE)
    def noop(self, *args: Any, **kwargs: Any) -> None:
        """A bare actor method that takes any arguments and does nothing: the floor raw Ray sets, for benchmarks."""
        return None

    # -- fast path (see orchestra._channel) ----------------------------------------------------------------------
    @ray.method(concurrency_group=COMPUTE)
    def serve_channel(self, path: str, address: str | tuple[str, int], secret: bytes) -> int:
        """Hold the compute lane and run the calls the controller writes into the socket at ``address`` (a Unix
        socket path, or the controller's (ip, port) from another node), in order, until it shuts its side (a
        release, or the group closing); returns how many were served. ``path`` names the channel's session here,
        ``secret`` proves to the controller that Ray sent this rank. Each call runs exactly as on the general path;
        its reply (or error) is written back as one frame."""
        served = 0
        session = self.sessions.session(path)
        sock = frames = None
        got_frame = False
        try:
            # a rank that cannot connect fails this call: the controller then fails the calls sent meanwhile (to no
            # rank: it writes none until every rank joined) and releases the others
            sock = _channel.connect(address, secret, self.rank)
            frames = sock.makefile("rb")  # (its buffer: a small frame read in one recv)
            with _channel.batch_scheduled():  # a frame arriving here does not preempt the controller's writes
                while True:
                    body = _channel.recv_frame(frames)
                    if body is None:
                        return served
                    got_frame = True
                    call_id, kind, payload, value = self._run_frame(body)
                    self._fast_done(session, call_id, kind, payload, value)  # before the reply: see Host.retain
                    try:
                        _channel.send_frame(sock, pickle.dumps((call_id, kind, payload),
                                                               protocol=pickle.HIGHEST_PROTOCOL))
                    except OSError as e:  # the controller closed its side (its loop ended): no one reads replies
                        with self._kept_lock:
                            self._kept.pop(call_id, None)  # nor takes this one
                        log.debug("group %r rank %d: fast-path reply not sent, the controller left (%r)",
                                  self.group, self.rank, e)
                        return served
                    served += 1
        finally:
            if frames is not None:
                frames.close()  # (first: the socket's descriptor is closed once no file of it is open)
            if sock is not None:
                sock.close()
            if got_frame:
                self.sessions.ended(path)  # a reader still waiting for one of its calls waits for one that never ran
            # else it never joined, or its channel never did: the controller either sends its calls through Ray
            # (run_fast_call, which hands a reader that asked its outcome) or says they never run (forget_session)

    def _run_frame(self, body: bytes) -> tuple[str, str, bytes, Any]:
        """Run one fast-path call frame exactly as the general path runs a call: (call id, "ok"/"err"/"kept",
        the reply frame, the value). A reply too large for a frame (or holding refs) is kept (``take_result``)."""
        call_id, role, name, blob = pickle.loads(body)
        self._fast_call = call_id
        try:
            args, kwargs = _frame.loads_frame(blob)
            kind, value = "ok", self._call(role, name, args, kwargs)
        except BaseException as e:  # noqa: BLE001 - every error goes back to the controller as the reply
            kind, value = "err", e if isinstance(e, WorkerError) else self._error(e, role, name)
        finally:
            self._fast_call = None
        try:
            payload = _frame.dumps_frame(value)
        except _frame.NeedsRay:  # holds refs (a large Batch's parts) or is too large: handed over by Ray
            if kind == "err":  # an error too large for a frame: cut down, it stays an error
                payload = _frame.dumps_frame(_shrunk(value))
            else:
                try:
                    kept = self._snapshot(value)
                except Exception as e:  # noqa: BLE001 - a result that cannot be stored fails its call only
                    kind, payload = "err", _frame.dumps_frame(_shrunk(self._error(e, role, name)))
                else:
                    with self._kept_lock:
                        self._kept[call_id] = kept
                    kind, payload = "kept", b""
        except Exception as e:  # noqa: BLE001 - a result that cannot be pickled fails its call only
            kind, payload = "err", _frame.dumps_frame(_shrunk(self._error(e, role, name)))
        return call_id, kind, payload, value

    @ray.method(concurrency_group=COMPUTE)
    def run_fast_call(self, path: str, frame: bytes, last: bool = False) -> Any:
        """A call of fast-path session ``path`` whose channel never opened (a rank could not join), sent through Ray
        instead: the same frame, run under its own call id (so its cancellation reaches it), replying as the
        general path does; a reader that asked for its outcome (``retain``) gets it as from the channel. ``last``:
        the session's last call here, which ends it (its serve loop got no frame and left it open)."""
        session = self.sessions.session(path)
        try:
            call_id, kind, payload, value = self._run_frame(frame)
            self._fast_done(session, call_id, kind, payload, value)
        finally:
            if last:
                self.sessions.ended(path)
        if kind == "ok":
            return payload  # the reply frame, read by the controller (or a reader) as a general-path reply
        if kind == "kept":
            with self._kept_lock:
                kept = self._kept.pop(call_id)
            return self._unkept(kept)
        raise _frame.loads_frame(payload)

    @ray.method(concurrency_group=CONTROL)
    def forget_session(self, path: str) -> None:
        """Fast-path session ``path`` never opened and its calls will not run (they failed at the controller): a
        reader waiting for one of them (``retained``) is told so."""
        self.sessions.ended(path)

    @ray.method(concurrency_group=CONTROL)
    def forget_calls(self, path: str, call_ids: list[str]) -> None:
        """These calls of fast-path session ``path``, resent through Ray, failed at the controller (Ray could not
        reach this actor, so they may not have run): a reader waiting for one (``retained``), or asking later, is
        told not to wait for them here."""
        self.sessions.never(path, call_ids)

    def _fast_done(self, session: _sessions.Session, call_id: str, kind: str, payload: bytes, value: Any) -> None:
        """A fast-path call finished: note how far its ``session`` got, and hand its outcome to a reader that asked
        (``retain``) — the value as the call returned it (the reply frame, or the kept snapshot), or its error."""
        def outcome() -> tuple[str, Any]:
            if kind == "kept":
                with self._kept_lock:
                    return "kept", self._kept[call_id]
            if kind == "ok":
                return "ok", payload
            return "err", value if isinstance(value, BaseException) else _frame.loads_frame(payload)
        self.sessions.done(session, call_id, _channel.call_number(call_id), outcome)

    @ray.method(concurrency_group=CONTROL)
    def retain(self, path: str, call_id: str, ask: str) -> str:
        """A reader of fast-path call ``call_id`` is about to be sent while its reply has not reached the controller:
        "done" when the call already finished here (its reply is on its way: the controller waits for it), "never"
        when it will not run here (its session ended without it, or the controller said so), else "retaining": its
        outcome is kept for ``retained``, which the reader fetches. Decided under the lock a finishing call takes,
        so nothing is missed. ``ask`` names this reader's request (each reader has its own); the controller sends
        ``retained`` with it, always (no await in between): that call ends the entry."""
        return self.sessions.retain(path, call_id, ask)

    @ray.method(concurrency_group=FORWARD)
    def retained(self, ask: str) -> Any:
        """The outcome of a fast-path call ``retain`` kept, once it finished: returned as its general-path reply
        would be (a reader's ``_split_refs`` reads it), or raised; None when ``retain`` kept nothing (the reader
        does not read this). On its own lane, since it waits: for ``retain`` (it may run first), then for the call."""
        slot = self.sessions.retained(ask)
        if slot.decision != "retaining":
            return None
        kind, v = slot.outcome
        if kind == "ok":
            return v  # the reply frame itself
        if kind == "kept":
            return self._unkept(v)
        if kind == "err":
            raise v
        raise RuntimeError(f"fast-path call {slot.call_id} never ran on rank {self.rank}: its channel ended first")

    def _snapshot(self, value: Any) -> tuple[bool, Any]:
        """A fast-path result kept until the controller takes it, as it is now: put into the object store at once
        (pickled, as Ray pickles a general-path reply when its call returns), since the next call may write into
        the objects it holds (a state dict, an array) before the controller takes it. A Batch result's Output whose
        parts are all stored objects is kept as it is (the Output is frozen); one with rows riding inline (``nbytes``
        under INLINE_BYTES, an object column counting 8 bytes a row, yet too large for a frame) holds the endpoint's
        own Batch, and is pickled now like any other value. (put?, value or its ref)."""
        if isinstance(value, Output) and all(_backend.is_ref(p.ref) for p in value.parts or ()):
            return False, value
        # a frame (or, holding refs, a RefFrame), as the general path's reply would be: each read gets its own copy
        return True, self.runtime.put(_frame.dumps_reply(value))

    @ray.method(concurrency_group=CONTROL)
    def take_result(self, call_id: str, discard: bool = False) -> Any:
        """A kept fast-path result, returned as the general path would have (a large Batch's parts are already in
        the object store: their refs travel with Ray, which tracks who holds them); ``discard`` drops it (its call
        already ended)."""
        with self._kept_lock:
            kept = self._kept.pop(call_id)
        return None if discard else self._unkept(kept)

    def _unkept(self, kept: tuple[bool, Any]) -> Any:
        """A kept result (``_snapshot``) as a Ray reply: the Output, or the frame (or RefFrame) stored for it."""
        put, value = kept
        return ray.get(value) if put else value

    @ray.method(concurrency_group=CONTROL)
    def discard_kept(self, call_ids: list[str]) -> None:
        """Drop the kept results of these fast-path calls, if any: the controller will not take them (the channel
        closed with their replies unread)."""
        with self._kept_lock:
            for call_id in call_ids:
                self._kept.pop(call_id, None)

    # -- data plane -----------------------------------------------------------------------------------------------
    def _reply(self, out: Any, role: str, name: str) -> Any:
        """What an endpoint's Ray call returns: its output pickled into one frame, as the fast path's reply is, or
        the output itself when it holds refs (Ray must carry those) or is a scalar (None, a number, a string: Ray
        encodes those itself). A frame of any size: Ray hands a large one out of its object store as a ``bytes``
        copy, so the Batches a plain value holds are each reader's own (as an object, they were writable views of
        the store's shared memory: ``test_writes_into_a_batch_inside_a_plain_value_reach_no_other_reader``). Ray carries a ``bytes`` reply as it is, where it pickles an
        Output with cloudpickle (``python -m bench.reply_encoding``: 4–13 % less wall time for a 4-row Batch result
        here); and a value comes back exactly as the fast path gives it (Ray turns a bytearray in a list into bytes). The controller reads it with ``_frame.read_reply``: ``bytes``
        always means a frame, so a bytes-like value returned as is travels inside an Output. A result that cannot
        be pickled fails its call with this rank's error, as on the fast path. A value that holds refs travels as a
        RefFrame (its refs next to its frame, for Ray to track), but a Batch result's Output whose parts are stored
        objects as it is: it holds headers and refs, no rows. A streaming endpoint's every yield is such a reply."""
        if self.runtime.own_process and type(out) not in _SCALARS:
            if isinstance(out, Output) and out.is_batch and any(_backend.is_ref(p.ref) for p in out.parts):
                return out
            try:
                return _frame.dumps_reply(out)
            except Exception as e:  # noqa: BLE001 - the call fails with it, naming rank and endpoint
                raise self._error(e, role, name) from None
        return _not_a_frame(out, self.rank)

    def _call(self, role: str, name: str, args: tuple, kwargs: dict) -> Any:
        """Run endpoint ``name`` of ``role``: a Batch result comes back as an Output header, anything else as is. Its
        counters are added when it ends (``_Stats.commit``), a failed or cancelled call's too, counted as such; while
        tracing, so is its span (marked ``error`` / ``cancelled``)."""
        tally = fetched = None
        seconds = 0.0
        try:
            args, kwargs = _unframe(args, kwargs)
            spec, fn, ctx, tally, held = self._begin(role, name)
            shared = kwargs.pop(SHARED_KWARG, ())
            readers, given = kwargs.pop(STORE_KWARG, ((), None))
            if given is not None:  # (start, rows, total): see _invocation._per_rank_calls
                given = Span(*given)
            args, resolved = _split_refs(args, kwargs)
            start, fetched = time.time(), ([] if self.tracing else None)
            (args, kwargs), pad, span = self._resolve(args, kwargs, resolved, tally, spec, fetched, shared, given)
            if self.is_cancelled():  # while it waited for a forwarded input: it never reaches the endpoint
                raise CallCancelled("cancelled while it waited for its inputs; the endpoint did not run")
            rows_in = _rows_in(args, kwargs) if pad else None
            t0 = time.perf_counter()
            try:
                result = self._aloop().run_until_complete(fn(*args, **kwargs)) if spec.is_async else fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
            if self.is_cancelled():  # the caller was told the call ended: no reader may take this result for one
                raise CallCancelled("cancelled while it ran; its result is discarded")
            if isinstance(result, _GENERATORS):  # Ray would keep its first item as the value
                raise TypeError(f"the endpoint returned a generator object ({type(result).__name__}), which is not a "
                                f"value; to stream parts, write the endpoint itself as a generator (yield in its "
                                f"body), or return list(...) to return every item")
            if pad and (not isinstance(result, Batch) or len(result) != rows_in):
                got = f"{len(result)} rows" if isinstance(result, Batch) else type(result).__name__
                raise ValueError(f"endpoint returned {got} for an input of {rows_in} rows ({pad} of them padding); "
                                 f"an endpoint with padded input (shard(pad=True) or pad()) must return one row per "
                                 f"input row, so that the padding rows can be dropped")
            out = self._store(result, pad, tally, span if readers else None, readers)
        except BaseException as e:
            if tally is not None:
                self._ended_badly(e, role, name, tally, held, seconds, fetched, start if fetched is not None else 0.0)
            if isinstance(e, WorkerError):
                raise
            raise self._error(e, role, name) from None
        self.stats_.commit(role, name, tally, held, seconds)
        if fetched is not None:
            self._event(role, name, start, time.time(), fetched, out)
        return out

    def _ended_badly(self, e: BaseException | None, role: str, name: str, tally: dict, held: dict, seconds: float,
                     fetched: list | None, start: float, span_name: str | None = None) -> None:
        """Count a call (or a stream's last step) that failed or was cancelled (``errors`` / ``cancelled``; ``e``
        None: cancelled) with what it did, and record its span while tracing, marked with the error's type or
        ``cancelled``."""
        kind = e.exc_type if isinstance(e, WorkerError) else type(e).__name__
        if e is None or isinstance(e, (CallCancelled, GeneratorExit)) or kind == "CallCancelled" or self.is_cancelled():
            tally["cancelled"] += 1
            mark: dict[str, Any] = {"cancelled": True}
        else:
            tally["errors"] += 1
            mark = {"error": kind}
        self.stats_.commit(role, name, tally, held, seconds)
        if fetched is not None:
            self._event(role, span_name or name, start, time.time(), fetched, None, mark)

    def _call_stream(self, role: str, name: str, args: tuple, kwargs: dict) -> Iterator[Output]:
        """Run a generator endpoint; each yield becomes one stored output, handed back as soon as it exists. Its
        ``seconds`` count the time spent in the generator's body (each step to its next yield), not the time it
        waits at a yield for the consumer; its counters are added at every part."""
        tally = fetched = None
        seconds, seq = 0.0, 0
        try:
            args, kwargs = _unframe(args, kwargs)
            spec, fn, ctx, tally, held = self._begin(role, name)
            shared = kwargs.pop(SHARED_KWARG, ())
            kwargs.pop(STORE_KWARG, None)  # a stream's parts are cut as they come: no row positions to align to
            args, resolved = _split_refs(args, kwargs)
            start, fetched = time.time(), ([] if self.tracing else None)
            (args, kwargs), pad, _ = self._resolve(args, kwargs, resolved, tally, spec, fetched, shared)
            if pad:
                raise ValueError("a streaming endpoint cannot take padded input; drop pad from its dispatch")
            t0 = time.perf_counter()
            gen = fn(*args, **kwargs)
            seconds = time.perf_counter() - t0
            loop = self._aloop() if hasattr(gen, "__anext__") else None
            seq = 0
            while not self.is_cancelled():
                t0 = time.perf_counter()
                try:
                    if loop is not None:
                        try:
                            item = loop.run_until_complete(gen.__anext__())
                        except StopAsyncIteration:
                            break
                    else:
                        item = next(gen, _DONE)
                        if item is _DONE:
                            break
                finally:
                    seconds += time.perf_counter() - t0
                out = self._store_output(item, tally)
                held = self.stats_.commit(role, name, tally, held, seconds)
                tally, seconds = collections.defaultdict(int), 0.0
                if fetched is not None:  # one span per yielded part
                    now = time.time()
                    self._event(role, f"{name}[{seq}]", start, now, fetched, out)
                    start, fetched, seq = now, [], seq + 1
                yield self._reply(out, role, name)
        except BaseException as e:
            if tally is not None:
                self._ended_badly(e, role, name, tally, held, seconds, fetched,
                                  start if fetched is not None else 0.0, f"{name}[{seq}]")
            if isinstance(e, (WorkerError, GeneratorExit)):  # GeneratorExit: Ray closed the stream (its consumer
                raise  # went away)
            raise self._error(e, role, name) from None
        if self.is_cancelled():  # it stopped between two parts: the stream ends here, as cancelled
            self._ended_badly(None, role, name, tally, held, seconds, fetched, start, f"{name}[{seq}]")
        else:
            self.stats_.commit(role, name, tally, held, seconds)

    def _begin(self, role: str, name: str) -> tuple[EndpointSpec, Any, _Context, collections.defaultdict, dict]:
        """Check that the call may run; count it begun: its tally (what it adds as it runs) and the counters it was
        counted in, for ``_Stats.commit`` when it ends."""
        if self.is_cancelled():
            raise CallCancelled("cancelled before it started")
        if self._declared is not None:  # sent before the controller learned it: it does not run, and it is a death
            raise WorkerDiedError(f"rank {self.rank} was declared dead by its worker ({self._declared}); it runs no "
                                  f"more calls: recreate the group", group=self.group, role=role, rank=self.rank,
                                  endpoint=name, exc_type=DECLARED_DEAD)
        if role not in self.roles:
            raise RuntimeError(f"role {role!r} is not hosted on rank {self.rank} (hosted: {list(self.roles)})")
        spec = self.specs[role].get(name)
        if spec is None:
            raise AttributeError(f"{type(self.roles[role]).__name__} has no endpoint {name!r}")
        tally, held = self.stats_.begin(role, name)
        return spec, getattr(self.roles[role], name), self.contexts[role], tally, held

    def _resolve(self, args: tuple, kwargs: dict, resolved: tuple, counters: dict, spec: EndpointSpec,
                 trace: list | None = None, shared: tuple[int | str, ...] = (),
                 given: Span | None = None) -> tuple[tuple[tuple, dict], int, Span | None]:
        """The endpoint's arguments with data descriptors replaced by Batches it owns, the padding rows, and
        where this rank's input rows sit in the call's (None when not known, or the arguments disagree);
        ``shared``: the arguments (positions, keyword names) other readers share — a controller-made shard the
        ranks of a mesh replica all read, a caller's own ref that Ray resolves to the stored object — copied
        before the endpoint may write into them (the others are this rank's alone: no copy); ``given``: where a
        controller-made shard's rows sit (the controller split the batch)."""
        if not shared and len(args) + len(kwargs) == 1:  # one argument, this rank's own: the usual shard call
            a = args[0] if args else next(iter(kwargs.values()))
            if type(a) is Batch:  # unpickled from this rank's own frame (a controller-made shard, or a concrete
                # argument): counted, nothing to resolve or copy; the general branch below does the same for it
                n = len(a)
                counters["parts_in"] += 1
                counters["rows_in"] += n
                counters["rows_used"] += n
                counters["bytes_in"] += a.nbytes
                if spec.requires:
                    _require(spec, a)
                return (args, kwargs), 0, given
        if not shared and not any(isinstance(a, (DataArg, Batch)) for a in (*args, *kwargs.values())):
            return (args, kwargs), 0, None
        pads: list[int] = []
        spans: list[Span | None] = []
        padded: list[int] = []  # the DP pieces of each pad read among the arguments (the call's, every one alike)

        def one(key: int | str, a: Any) -> Any:
            if isinstance(a, DataArg):
                if a.layout.kind == "balanced" and a.layout.pad:
                    padded.append(a.layout.count)
                batch, p, where = self._materialize(a, resolved, counters, trace, spec.zero_copy_inputs)
                pads.append(p)
                spans.append(where)
            elif isinstance(a, Batch):  # a controller-made shard, passed as is (or resolved by Ray from its ref)
                # one other readers share may be shared memory whatever its nbytes says (object columns count 8
                # bytes a row there): a private copy, unless the endpoint promised not to write
                nbytes = a.nbytes
                batch = a if key not in shared or spec.zero_copy_inputs else a.clone()
                counters["parts_in"] += 1
                counters["rows_in"] += len(a)
                counters["rows_used"] += len(a)
                counters["bytes_in"] += nbytes
                spans.append(given)
            else:  # a caller's ref to a list/dict holding Batches: their columns are the stored object's too
                return _own_batches(a) if key in shared and not spec.zero_copy_inputs else a
            if not isinstance(batch, Batch):  # a forwarded plain value (e.g. a state dict from rank 0)
                return batch
            if spec.requires:
                _require(spec, batch)
            return batch

        new_args = tuple([one(i, a) for i, a in enumerate(args)])
        new_kwargs = {k: one(k, v) for k, v in kwargs.items()}
        refusal = padded_apart([w.total for w in spans if w is not None], padded[0]) if padded else None
        if refusal is not None:  # the controller's rule for the rows it knew: every rank alike, before the endpoint
            raise ValueError(refusal)
        if len(set(pads)) > 1:
            raise ValueError(f"data arguments were padded differently ({pads}); pass them as one union a | b")
        span = spans[0] if spans and all(w == spans[0] for w in spans) else None
        return (new_args, new_kwargs), (pads[0] if pads else 0), span

    def _materialize(self, arg: DataArg, resolved: tuple, counters: dict,
                     trace: list | None = None, zero_copy: bool = False) -> tuple[Any, int, Span | None]:
        """Fetch the parts overlapping this rank's rows from every source, slice, concatenate, and union; also
        the padding rows, and where this rank's rows sit in the rows of the call (None when not known).

        A future whose outputs are plain values (not Batches), read by a broadcast call, arrives as ``await`` gives
        it: a list with one entry per collecting rank, or the kept rank's entry alone (``Layout.slots``/``one``).
        A "per_rank" layout (a future of one value per rank) arrives as that list: one entry per source (rank),
        its Batch outputs joined into one Batch, as ``await`` gives it."""
        if arg.layout.kind == "per_rank":
            return [self._rank_value([resolved[o] if isinstance(o, RefAt) else o for o in src.outputs], counters, trace)
                    for src in arg.sources], 0, None
        if arg.values_ok and len(arg.sources) == 1:
            outs = [resolved[o] if isinstance(o, RefAt) else o for o in arg.sources[0].outputs]
            if outs and any(_is_value(o) for o in outs):  # not rows: what await gives (see Layout.slots)
                values, at = [], 0
                for n in arg.layout.slots or (len(outs),):
                    values.append(self._rank_value(outs[at:at + n], counters, trace))
                    at += n
                return (values[0] if arg.layout.one else values), 0, None
        for i, src in enumerate(arg.sources):  # the rule the controller applies to the headers it has: every rank
            refusal = columns_apart([resolved[o] if isinstance(o, RefAt) else o for o in src.outputs])  # alike
            if refusal is not None:
                named = arg.layout.sources[i] if i < len(arg.layout.sources) else ""
                raise ValueError(f"the future of {named or 'the upstream call'} is not one Batch: {refusal}")
        part_lists = [self._parts(src, resolved) for src in arg.sources]
        totals = [sum(p.rows for p in parts) for parts in part_lists]
        if len(set(totals)) > 1:
            raise ValueError(f"the futures joined with | have different row counts {totals}; a union needs "
                             f"row-aligned inputs (read part by part, under stream(), each part of one must hold "
                             f"the rows of the other's part: yield the same parts, or drop stream=True)")
        n = totals[0]
        start, stop, pad = row_range(n, arg.layout)
        # no rows at all in a pad call: every rank gets none, as from a Batch of none (there is no row to repeat)
        empty_ok = arg.layout.allow_empty or (arg.layout.pad and n == 0)
        if arg.layout.kind == "balanced" and n < arg.layout.count and not (empty_ok or arg.layout.pad):
            # every rank alike (each sees n), not only those whose share is empty: none runs the endpoint
            raise ValueError(f"{n} rows cannot be split into {arg.layout.count} shards without leaving some empty; "
                             f"pass at least {arg.layout.count} rows, or use shard(pad=True) / shard(allow_empty=True)")
        for parts in part_lists:  # the rule the controller applies when it has the headers: every rank alike
            refusal = padded_again(n, arg.layout, sum(p.pad for p in parts))
            if refusal is not None:
                raise ValueError(refusal)
        wanted = _wanted(start, stop, n) if arg.layout.kind == "balanced" else [(0, n)]
        out = None
        for parts in part_lists:
            b = self._read(parts, wanted, counters, trace, zero_copy)
            out = b if out is None else out.union(b)
        counters["rows_used"] += len(out)
        if arg.layout.kind == "balanced":  # this rank's share of the upstream rows
            where = Span(start, max(0, min(stop, n) - start), n)
        elif arg.layout.span is not None:  # a padded shard the controller made: it says where the rows sit
            where = arg.layout.span
        else:  # all of them: they sit where the upstream parts say (one DP replica's rows read by the same replica)
            where = _span_of(part_lists[0])
            where = where if all(_span_of(p) == where for p in part_lists[1:]) else None
        return out, pad, where

    def _rank_value(self, resolved_outs: list[Any], counters: dict, trace: list | None) -> Any:
        """One upstream rank's value from its (resolved) outputs, as the controller's ``await`` makes it
        (``Invocation._join``): its Batch outputs joined into one private Batch, one plain value as is, several
        outputs as a list."""
        outs = [o if isinstance(o, Output) else Output(-1, value=o) for o in resolved_outs]

        def rows(o_parts: list[PartInfo]) -> Batch:
            b = self._read(o_parts, [(0, sum(p.rows for p in o_parts))], counters, trace)
            counters["rows_used"] += len(b)
            return b

        return rank_value(outs, rows)

    @staticmethod
    def _parts(src: Source, resolved: tuple) -> list[PartInfo]:
        parts: list[PartInfo] = []
        for o in src.outputs:
            out = resolved[o] if isinstance(o, RefAt) else o
            if isinstance(out, PartInfo):
                parts.append(out)
            elif isinstance(out, Output):
                if out.parts is None:
                    raise TypeError(f"rank {out.rank} of the upstream call returned {type(out.value).__name__}, not a "
                                    f"Batch; only Batch results can be split by rows (a plain value can be forwarded "
                                    f"to a broadcast call)")
                parts.extend(out.parts)
            else:
                raise TypeError(f"the upstream call returned {type(out).__name__}, not a Batch; only Batch results "
                                f"can be split by rows (a plain value can be forwarded to a broadcast call)")
        return parts

    @staticmethod
    def _read(parts: list[PartInfo], wanted: list[tuple[int, int]], counters: dict,
              trace: list | None = None, zero_copy: bool = False) -> Batch:
        """The rows ``wanted`` of ``parts``, fetched and joined. The result is private to this call: a single
        piece read from the object store (shared memory other readers see) is copied unless ``zero_copy``."""
        plan = [ov for lo, hi in wanted for ov in overlapping([p.rows for p in parts], lo, hi)]
        need = sorted({i for i, _, _ in plan})
        remote = [i for i in need if _backend.is_ref(parts[i].ref)]
        fetched = dict(zip(remote, _backend.get([parts[i].ref for i in remote]))) if remote else {}
        for i in need:
            counters["parts_in"] += 1
            counters["rows_in"] += parts[i].rows
            counters["bytes_in"] += parts[i].nbytes
            if trace is not None and parts[i].key:
                trace.append((parts[i].key, parts[i].nbytes))
        pieces = []
        for i, lo, hi in plan:
            b = fetched.get(i, parts[i].ref)
            pieces.append(b if (lo, hi) == (0, len(b)) else b.slice(lo, hi))
        if len(pieces) == 1:  # a view of one stored part (or of a reply other calls here may read too): copy it
            return pieces[0] if zero_copy else pieces[0].clone()
        if pieces:  # (a pad read wrapping around reads no padding of the producer's own: _materialize refused it)
            return Batch.concat(pieces)
        if not parts:
            return Batch.from_dict({})
        first = _backend.get([parts[0].ref])[0] if _backend.is_ref(parts[0].ref) else parts[0].ref
        return first.slice(0, 0)

    def _store(self, result: Any, pad: int, counters: dict, span: Span | None = None,
               readers: tuple[int, ...] = ()) -> Output:
        """Put a Batch result into the object store as parts; other values travel inline.

        Parts are sized by what readers will fetch. When the rows are known to sit at ``span`` of the call's rows
        (one output row per input row, or k per input row: then at k times the input's place), they are cut where
        any reader of a DP size in ``readers`` (every group's on the controller) starts or ends, and at PART_BYTES:
        each such reader fetches exactly its rows, in as few objects as that allows. Otherwise into ``part_count``
        parts (at least 8 for a large output), so that a reader of any split fetches little beyond its rows. A
        result under INLINE_BYTES is one part in the reply."""
        if not isinstance(result, Batch):
            return result
        if pad:  # one row per input row (checked in _call): the last ``pad`` rows are the padding's
            result = result.slice(0, len(result) - pad)
        n, nbytes = len(result), result.nbytes
        if span is not None and span.rows != n:
            # n rows per input row (a rollout of n samples a prompt): at n times the input's place, if every rank of
            # the call returns n per row (a rank cannot know; a wrong guess costs readers extra parts, not rows)
            k = n // span.rows if span.rows and n % span.rows == 0 else 0
            span = Span(span.start * k, n, span.total * k) if k else None
        sizes = _part_sizes(n, nbytes, span, readers)
        parts, offset = [], 0
        for piece in (result.split(sizes) if len(sizes) > 1 else [result]):
            size = piece.nbytes
            where = (span.start + offset, span.total) if span is not None else (-1, -1)
            offset += len(piece)
            # a small result rides inside the call's reply (no object of its own, no second fetch by readers)
            if nbytes < INLINE_BYTES:
                self._inline_parts += 1
                parts.append(PartInfo(piece, len(piece), size, tag=f"{self._inline_tag}:{self._inline_parts}",
                                      start=where[0], total=where[1], pad=piece.pad_count))
            else:
                parts.append(PartInfo(self.runtime.put(piece), len(piece), size, start=where[0], total=where[1],
                                      pad=piece.pad_count))
            counters["parts_out"] += 1
            counters["rows_out"] += len(piece)
            counters["bytes_out"] += size
        return Output(self.rank, parts=tuple(parts), keys=tuple(result.keys()), schema=result._schema())

    def _event(self, role: str, name: str, start: float, end: float, fetched: list, out: Any,
               mark: dict[str, Any] | None = None) -> None:
        """Record a call's span (``mark``: ``{"error": type}`` or ``{"cancelled": True}`` for one that ended so)."""
        produced = ([(p.key, p.nbytes, p.rows) for p in out.parts if p.key]
                    if isinstance(out, Output) and out.parts else [])
        event = {"role": role, "endpoint": name, "start": start, "end": end, "fetched": fetched, "produced": produced}
        if mark:
            event.update(mark)
        self.events.add(event)

    def _store_output(self, item: Any, counters: dict) -> Output:
        out = self._store(item, 0, counters)
        return out if isinstance(out, Output) else Output(self.rank, value=out)

    def _error(self, e: BaseException, role: str, name: str) -> WorkerError:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return WorkerError(str(e), group=self.group, role=role, rank=self.rank, endpoint=name,
                           remote_traceback=tb, exc_type=type(e).__name__)
