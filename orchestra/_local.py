"""The in-process backend (``orc.init(backend="local")``): every rank of every group runs in the controller's
process, so a test starts in milliseconds and ``breakpoint()`` inside an endpoint works.

Each rank is the same ``Host`` a Ray actor runs, served by three threads — its lanes: compute (endpoint bodies,
one at a time, in the order calls were sent), control (ping, stats, cancellation; answers while compute is busy)
and watch (the supervision call). What crosses the boundary is serialized as Ray would serialize it: a call's
arguments are pickled when it is sent (so an unpicklable argument fails at once, and a caller's later writes do not
reach the call); replies, yields and stored objects (``put``) are pickled when produced, and every read of a
reference unpickles a copy of its own. ``kill`` is a process death as the controller sees it: the rank's queued,
running and later calls fail with ``RankDied`` (a ``WorkerDiedError`` for the caller), its supervision call fails,
and a running endpoint that polls ``Worker.cancelled()`` stops (a thread cannot be killed: one that never polls
runs to its end, its result dropped). Closing the group waits for the threads to end (``LocalBackend.wait_stopped``,
as a Ray close waits for the processes to exit), so such an endpoint does not run on past the close.

What differs from Ray on purpose: ranks share one process, so ``os.environ``, the global random generators
(``torch.manual_seed``, ``numpy.random``, ``random``) and module or class globals are shared by every rank (seed
and keep state per rank on ``self``, e.g. a ``torch.Generator``), and a ``torch.distributed`` process group cannot
span ranks; GPUs are not assigned. Use the Ray backend for collectives and real jobs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import itertools
import logging
import os
import pickle
import queue
import re
import threading
import time
import traceback
from typing import Any

from ray import cloudpickle

from . import _backend
from ._backend import Backend, RankDied, ReplyUnreadable, Slot, TaskFailed
from ._errors import OrchestraError, PlacementError

__all__ = ["LocalBackend", "LocalRef"]

log = logging.getLogger("orchestra")

_ids = itertools.count()
_thread = threading.local()  # .task: the id of the call the current lane thread runs; .host: that lane's Host


def _new_id() -> str:
    return f"{os.getpid():x}{next(_ids):012x}"


# -- serialization: what Ray would copy is copied; in-process handles travel by reference -------------------------
class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file: io.BytesIO, kept: list[Any], buffers: list[pickle.PickleBuffer]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffers.append)
        self.kept = kept

    def persistent_id(self, obj: Any) -> Any:
        if getattr(type(obj), "_orc_in_process", False):  # refs, actor handles, in-process sequencer state
            self.kept.append(obj)
            return len(self.kept) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, kept: list[Any], buffers: tuple[bytes, ...]) -> None:
        super().__init__(file, buffers=buffers)
        self.kept = kept

    def persistent_load(self, pid: Any) -> Any:
        return self.kept[pid]


def _dumps(obj: Any) -> tuple[bytes, list[Any], tuple[bytes, ...]]:
    """The pickle, the in-process objects it refers to, and its out-of-band buffers copied into immutable bytes."""
    buf, kept, buffers = io.BytesIO(), [], []
    _Pickler(buf, kept, buffers).dump(obj)
    return buf.getvalue(), kept, tuple(b.raw().tobytes() for b in buffers)


def _loads(data: tuple[bytes, list[Any], tuple[bytes, ...]]) -> Any:
    """A fresh object from ``_dumps``'s output; out-of-band buffers (numpy arrays) are read-only views of the
    stored bytes, as Ray hands them out of its object store."""
    return _Unpickler(io.BytesIO(data[0]), data[1], data[2]).load()


def _describe(e: BaseException) -> str:
    """``str(e)`` (its type is reported separately), or a placeholder when ``__str__`` itself fails."""
    try:
        return str(e) or type(e).__name__
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error itself
        return f"<{type(e).__name__}: str() failed>"


def copy(obj: Any) -> Any:
    """``obj`` as a reader in another process would get it: a deep copy through pickle."""
    return _loads(_dumps(obj))


# -- references -----------------------------------------------------------------------------------------------------
class LocalRef:
    """An in-process object reference: awaitable, ``future()``, ``task_id()``, ``get()`` (blocking).

    It holds the object pickled (as Ray's object store holds it serialized) and every read unpickles a fresh copy,
    so no reader — the controller awaiting it, a rank fetching it — can change what another reader gets. (Ray
    shares the numeric buffers of large objects between readers on one node; copying them too only removes that
    hazard, which the core guards against anyway.)"""

    _orc_ref = True
    _orc_in_process = True
    __slots__ = ("_src", "_task", "_id")

    def __init__(self, task: str) -> None:
        self._task = task
        self._src: concurrent.futures.Future = concurrent.futures.Future()  # resolves to the pickled payload
        self._id = _new_id()

    def _set(self, obj: Any) -> None:
        """Store ``obj`` (pickled now: later writes to it do not reach readers)."""
        _resolve(self._src, _dumps(obj))

    def future(self) -> concurrent.futures.Future:
        """A future of a fresh copy of the object (each call its own copy)."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(src: concurrent.futures.Future) -> None:
            if out.cancelled():  # the reader went away
                return
            try:
                data = src.result()
            except BaseException as e:  # noqa: BLE001 - the call's failure, handed to this reader
                _resolve(out, error=e)
                return
            try:
                value = _loads(data)
            except Exception as e:  # noqa: BLE001 - a reply that cannot be rebuilt here fails this read, as on Ray
                _resolve(out, error=ReplyUnreadable(e))
            else:
                _resolve(out, value)
        self._src.add_done_callback(done)
        return out

    def task_id(self) -> _backend.TaskId:
        return _backend.TaskId(self._task)

    def hex(self) -> str:
        return self._id

    def get(self, timeout: float | None = None) -> Any:
        return _loads(self._src.result(timeout))

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.future()).__await__()

    def __repr__(self) -> str:
        return f"LocalRef({self._id})"


class _End:
    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class LocalGenerator:
    """The refs a streaming call yields, as an async iterator on the loop that sent the call."""

    _orc_in_process = True

    def __init__(self, completed: LocalRef) -> None:
        self._loop = asyncio.get_running_loop()
        self._q: asyncio.Queue = asyncio.Queue()
        self._completed = completed
        self._ended = False

    def completed(self) -> LocalRef:
        """A ref resolved when the whole call has ended (its task id names the call for cancellation)."""
        return self._completed

    def _push(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)
        except RuntimeError:  # the controller's loop is closed: nobody is left to read the stream
            log.debug("orchestra local backend: stream item dropped, its event loop is closed")

    def __aiter__(self) -> LocalGenerator:
        return self

    async def __anext__(self) -> LocalRef:
        if self._ended:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, _End):
            self._ended = True
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        return item


# -- ranks ----------------------------------------------------------------------------------------------------------
class _Job:
    __slots__ = ("task", "name", "payload", "ref", "gen")

    def __init__(self, task: str, name: str, payload: Any, ref: LocalRef, gen: LocalGenerator | None) -> None:
        self.task, self.name, self.payload, self.ref, self.gen = task, name, payload, ref, gen


def _resolve(fut: concurrent.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
    try:
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:  # already failed by kill(): the late outcome is dropped
        pass


class _Runtime:
    """What a Host asks of its process, in-process (see ``orchestra._host.RayRuntime``)."""

    own_process = False

    def __init__(self, actor: LocalActor) -> None:
        self._actor = actor

    def task_id(self) -> str | None:
        return getattr(_thread, "task", None)

    def runtime_cancelled(self) -> bool:
        return self._actor._dead is not None

    def put(self, obj: Any) -> Any:
        return self._actor._backend.put(obj)

    def node_ip(self) -> str:
        return "127.0.0.1"

    def log_path(self) -> str | None:
        return None  # in-process: the controller's own output

    def placement(self) -> tuple[list[Any], str | None]:
        return [], LocalBackend.NODE_ID


class _Method:
    _orc_in_process = True
    __slots__ = ("_actor", "_name", "_lane", "_streaming")

    def __init__(self, actor: LocalActor, name: str, lane: str, streaming: bool = False) -> None:
        self._actor, self._name, self._lane, self._streaming = actor, name, lane, streaming

    def options(self, *, num_returns: Any = None, **_ignored: Any) -> _Method:
        return _Method(self._actor, self._name, self._lane, num_returns == "streaming")

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._actor._submit(self._name, self._lane, args, kwargs, self._streaming)


class LocalActor:
    """One rank: a Host served by one thread per lane. ``handle.method.remote(...)`` as on a Ray actor handle."""

    _orc_in_process = True

    def __init__(self, backend: LocalBackend, host_cls: type, args: tuple, name: str,
                 lanes: dict[str, int]) -> None:
        self._backend, self._name = backend, name
        self._dead: str | None = None
        self._lock = threading.Lock()
        self._running: dict[str, _Job] = {}
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._host = host_cls(*args, runtime=_Runtime(self))
        for lane in lanes:
            q: queue.SimpleQueue = queue.SimpleQueue()
            self._queues[lane] = q
            t = threading.Thread(target=self._serve, args=(lane, q), name=f"orchestra-local:{name}:{lane}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        fn = getattr(type(self._host), name, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{type(self._host).__name__} has no method {name!r}")
        lane = getattr(fn, "__ray_concurrency_group__", None) or "compute"
        return _Method(self, name, lane)

    def __repr__(self) -> str:
        return f"<LocalActor {self._name}{' (dead)' if self._dead else ''}>"

    def _submit(self, name: str, lane: str, args: tuple, kwargs: dict, streaming: bool) -> Any:
        task = _new_id()
        if name == "cancel_calls" and self._dead is None:
            # marked at once, in the caller's thread: when ``fut.cancel()`` returns, the rank's ``cancelled()`` is
            # True (a Sequencer wait in the cancelled endpoint gives its position back before any later position
            # the caller enters can take its turn); Ray's control lane does the same a moment later
            ref = LocalRef(task)
            try:
                ref._set(self._host.cancel_calls(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, as from the control lane
                _resolve(ref._src, error=TaskFailed(_describe(e), cause=e))
            return ref
        payload = _dumps((args, kwargs))  # now, as Ray does: a bad argument fails here; later writes do not reach it
        ref = LocalRef(task)
        gen = LocalGenerator(ref) if streaming else None
        job = _Job(task, name, payload, ref, gen)
        with self._lock:
            dead = self._dead
            if dead is None:
                self._queues[lane].put(job)
        if dead is not None:
            self._fail(job, RankDied(f"{self._name}: {dead}"))
        return gen if streaming else ref

    def _fail(self, job: _Job, error: BaseException) -> None:
        _resolve(job.ref._src, error=error)
        if job.gen is not None:
            job.gen._push(_End(error))

    def running(self) -> list[str]:
        """The endpoints this rank's lanes run now (user code still on a thread, even after the rank was killed:
        a thread cannot be killed)."""
        with self._lock:
            return [_ENDPOINT.sub("", job.name) for lane, job in self._running.items() if lane == "compute"]

    def wait_stopped(self, timeout: float) -> list[str]:
        """After ``_kill``: wait (blocking, up to ``timeout`` s) until every lane thread has ended; returns the
        endpoints still running then (empty once stopped). The in-process counterpart of waiting for a killed
        rank's process to exit."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            return []
        return self.running() or ["(its lanes' threads)"]

    def _serve(self, lane: str, q: queue.SimpleQueue) -> None:
        _thread.host = self._host  # what a Sequencer wait inside an endpoint polls for the call's cancellation
        while True:
            job = q.get()
            if job is None:
                loop = self._host._loop if lane == "compute" else None
                if loop is not None and not loop.is_closed():  # async endpoints' loop, owned by this thread
                    loop.close()
                return
            with self._lock:
                if self._dead is not None:
                    dead = self._dead
                else:
                    dead = None
                    self._running[lane] = job
            if dead is not None:
                self._fail(job, RankDied(f"{self._name}: {dead}"))
                continue
            _thread.task = job.task
            try:
                self._run(job)
            finally:
                _thread.task = None
                with self._lock:
                    self._running.pop(lane, None)

    def _run(self, job: _Job) -> None:
        try:
            args, kwargs = _loads(job.payload)
            # as Ray does: a ref passed as an argument itself (not nested in one) arrives as its value
            if any(isinstance(a, LocalRef) for a in (*args, *kwargs.values())):
                args = tuple(a.get() if isinstance(a, LocalRef) else a for a in args)
                kwargs = {k: (v.get() if isinstance(v, LocalRef) else v) for k, v in kwargs.items()}
            method = getattr(self._host, job.name)
            if job.gen is None:
                job.ref._set(method(*args, **kwargs))
                return
            it = method(*args, **kwargs)
            try:
                for item in it:
                    if self._dead is not None:
                        break
                    out = LocalRef(job.task)
                    out._set(item)
                    job.gen._push(out)
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            if self._dead is None:
                job.gen._push(_End(None))
            job.ref._set(None)
        except OrchestraError as e:  # the host's WorkerError: crosses the boundary as itself (a copy)
            self._fail(job, copy(e))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as Ray's RayTaskError would be
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            self._fail(job, TaskFailed(_describe(e), cause=e, remote_traceback=tb))

    def _kill(self, why: str) -> None:
        """The rank dies: every queued, running and later call fails with RankDied; its lanes stop."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = why
            running = list(self._running.values())
            pending = []
            for q in self._queues.values():
                while True:
                    try:
                        job = q.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        pending.append(job)
                q.put(None)  # the lane thread exits after the job it runs now
        err = RankDied(f"{self._name}: {why}")
        for job in [*running, *pending]:
            self._fail(job, err)
        self._host._watching.set()  # frees the watch lane's thread


_ENDPOINT = re.compile(r"^r\d+_")  # a host method's name: r<role index>_<endpoint> (``_host.method_name``)


def current_host() -> Any:
    """The Host whose lane runs on this thread (an in-process rank), else None."""
    return getattr(_thread, "host", None)


class LocalBackend(Backend):
    """Every rank in this process. ``num_cpus`` (default: this machine's) is what pools reserve from."""

    name = "local"
    own_process = False
    NODE_ID = "local"

    def __init__(self, num_cpus: float | None = None, num_gpus: int | None = None) -> None:
        self._total = {"CPU": float(num_cpus if num_cpus is not None else (os.cpu_count() or 1))}
        if num_gpus:
            self._total["GPU"] = float(num_gpus)
        self._used = {k: 0.0 for k in self._total}
        self._lock = threading.Lock()

    def resources(self) -> dict[str, float]:
        return dict(self._total)

    def _need(self, pool: Any) -> dict[str, float]:
        return {k: v * pool.world_size for k, v in pool.bundle().items()}

    def check_fits(self, pool: Any) -> None:
        problems = [f"{k}: need {v:g}, in-process backend has {self._total.get(k, 0.0):g}"
                    for k, v in self._need(pool).items() if self._total.get(k, 0.0) + 1e-9 < v]
        if problems:
            raise PlacementError(pool.fit_message(problems))

    async def reserve(self, pool: Any, held: list[Any]) -> list[Slot]:
        need = self._need(pool)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + pool.placement_timeout
        while True:  # resources other pools hold are waited for, as Ray's placement groups wait
            with self._lock:
                if all(self._used.get(k, 0.0) + v <= self._total.get(k, 0.0) + 1e-9 for k, v in need.items()):
                    for k, v in need.items():
                        self._used[k] = self._used.get(k, 0.0) + v
                    held.append(need)
                    break
                avail = {k: self._total[k] - self._used.get(k, 0.0) for k in self._total}
            if loop.time() >= deadline:
                raise PlacementError(pool.fit_message(
                    [f"resources not free after {pool.placement_timeout:g} s; the in-process backend has {avail} "
                     f"available"]))
            await asyncio.sleep(0.02)
        return [Slot(r, None, r, "127.0.0.1", self.NODE_ID, r) for r in range(pool.world_size)]

    def unreserve(self, held: list[Any], pool_name: str) -> None:
        with self._lock:
            for need in held:
                for k, v in need.items():
                    self._used[k] = max(0.0, self._used.get(k, 0.0) - v)

    def spawn(self, pool: Any, host_cls: type, slots: list[Slot], group: str,
              concurrency_groups: dict[str, int]) -> list[Any]:
        return [LocalActor(self, host_cls, (group, s.rank, len(slots), s.local_rank,
                                            {"bundle_index": s.bundle_index, "placement_group": None}),
                           f"{group}[{s.rank}]", concurrency_groups)
                for s in slots]

    def kill(self, handle: Any) -> None:
        handle._kill("the rank was killed")

    def wait_stopped(self, handles: list[Any], timeout: float) -> list[str]:
        """After ``kill``: wait (blocking, up to ``timeout`` s in all) until the killed ranks' threads ended — a
        thread cannot be killed, so an endpoint that never polls ``Worker.cancelled()`` runs to its end meanwhile;
        returns ``"group[rank] (endpoint 'name')"`` for each still running then."""
        deadline = time.monotonic() + timeout
        left = []
        for h in handles:
            for what in h.wait_stopped(max(0.0, deadline - time.monotonic())):
                left.append(f"{h._name} (endpoint {what!r})" if not what.startswith("(") else f"{h._name} {what}")
        return left

    def put(self, obj: Any) -> LocalRef:
        ref = LocalRef(_new_id())
        ref._set(obj)
        return ref
