"""DataFuture: what every group call returns at once.

A DataFuture is an ordered list of *slots* (one per collected rank, in row order); each slot holds the outputs
that rank produced (one for a plain endpoint, one per yield for a streaming one). An output is a small header
(row count, columns, part refs) whose payload parts stay in the object store. ``await`` materializes the value;
passing the future into another call forwards the header refs so that the next workers read the parts directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import ray

from . import _stats
from ._batch import Batch
from ._errors import CallTimeoutError, OrchestraError, WorkerDiedError, WorkerError
from ._wire import Output, PartInfo

__all__ = ["DataFuture", "Part"]


@dataclass(frozen=True)
class Part:
    """One stored piece of a result: its rows, columns and bytes, readable with ``await part.get()``."""

    slot: int
    seq: int
    rank: int
    rows: int
    nbytes: int
    keys: tuple[str, ...]
    info: PartInfo

    async def get(self) -> Batch:
        """Fetch this part's rows into the controller (counted in ``controller_stats()``)."""
        b = await self.info.ref if isinstance(self.info.ref, ray.ObjectRef) else self.info.ref
        _stats.add_materialized(self.nbytes)
        return b


class _Slot:
    """The outputs of one executing rank, in order; grows while a streaming endpoint yields."""

    def __init__(self, rank: int, collected: bool) -> None:
        self.rank, self.collected = rank, collected
        self.refs: list[ray.ObjectRef] = []
        self.outputs: list[asyncio.Future] = []  # each resolves to an Output
        self.done = asyncio.get_running_loop().create_future()
        self._waiters: list[asyncio.Future] = []
        self.call_ref: Any = None  # ObjectRef or ObjectRefGenerator, for cancellation

    def add(self, ref: ray.ObjectRef) -> None:
        self.refs.append(ref)
        out = asyncio.wrap_future(ref.future())
        out.add_done_callback(_swallow)  # a forwarded, never-awaited failure must not log "never retrieved"
        self.outputs.append(out)
        self._notify()

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)
                self.done.exception()  # mark retrieved; errors surface through await
        self._notify()

    def watch(self) -> asyncio.Future:
        """A future resolved at the next new output or at the end (check state after taking it, then await)."""
        w = asyncio.get_running_loop().create_future()
        self._waiters.append(w)
        return w

    def _notify(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()


class DataFuture:
    """The result of a group call, available at once: ``await`` it, ``async for`` its parts, or pass it on.

    Passed into another call its parts travel worker to worker: each receiving rank fetches only the parts that
    overlap its rows. ``fut_a | fut_b`` is the row-aligned union of two futures' columns, still unmaterialized.
    """

    def __init__(self, *, group: str, endpoint: str, collect: Callable[[list[Any]], Any] | None = None,
                 timeout: float | None = None) -> None:
        self.group, self.endpoint = group, endpoint
        self._collect = collect
        self._loop = asyncio.get_running_loop()
        self._submitted: asyncio.Future = self._loop.create_future()
        self._slots: list[_Slot] = []
        self._deadline = None if timeout is None else self._loop.time() + timeout
        self._timeout = timeout
        self._result: Any = _UNSET
        self._task: asyncio.Task | None = None
        self._cancelled = False
        self._known_rows: int | None = None
        self._concat_all = False  # sharded Batch results: collect sees one batch of all rows

    # -- filled in by the group -----------------------------------------------------------------------------------
    def _set_slots(self, slots: list[_Slot]) -> None:
        self._slots = slots
        if not self._submitted.done():
            self._submitted.set_result(None)

    def _fail_submit(self, error: BaseException) -> None:
        if not self._submitted.done():
            self._submitted.set_exception(error)
            self._submitted.exception()

    # -- introspection --------------------------------------------------------------------------------------------
    def rows_if_known(self) -> int | None:
        """The row count when already known without waiting (else None)."""
        return self._known_rows

    def done(self) -> bool:
        """True once every rank finished (successfully or not)."""
        return self._submitted.done() and all(s.done.done() for s in self._slots)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<DataFuture {self.group}.{self.endpoint} {state}>"

    # -- waiting --------------------------------------------------------------------------------------------------
    def _remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    async def _wait_submitted(self) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._submitted), self._remaining())
        except asyncio.TimeoutError:
            raise self._timeout_error([]) from None

    async def wait(self) -> None:
        """Wait until every rank has finished; raise the first failure at once, cancelling the other ranks."""
        if not self._submitted.done():
            await self._wait_submitted()
        elif self._submitted.exception() is not None:
            raise self._submitted.exception()
        pending = {s.done for s in self._slots if not s.done.done()}
        pending |= {o for s in self._slots for o in s.outputs if not o.done()}
        for s in self._slots:  # failures that already happened
            for f in (s.done, *s.outputs):
                if f.done() and not f.cancelled() and f.exception() is not None:
                    self.cancel()
                    raise self._convert(f.exception(), s)
        try:
            if len(pending) == 1 and self._deadline is None:  # the common one-rank case: no asyncio.wait machinery
                (only,) = pending
                try:
                    await asyncio.shield(only)
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001
                    self.cancel()
                    raise self._convert(e, self._slot_of(only)) from None
                pending = {o for s in self._slots for o in s.outputs if not o.done()}
                pending |= {s.done for s in self._slots if not s.done.done()}
            while pending:
                done, pending = await asyncio.wait(pending, timeout=self._remaining(),
                                                   return_when=asyncio.FIRST_EXCEPTION)
                if not done:
                    running = self._running_ranks()
                    self.cancel()
                    raise self._timeout_error(running)
                for d in done:
                    if d.exception() is not None:
                        self.cancel()
                        raise self._convert(d.exception(), self._slot_of(d))
                pending |= {o for s in self._slots for o in s.outputs if not o.done()}
        except asyncio.CancelledError:
            self.cancel()
            raise

    def _running_ranks(self) -> list[int]:
        return sorted({s.rank for s in self._slots if not s.done.done() or not all(o.done() for o in s.outputs)})

    def _slot_of(self, fut: asyncio.Future) -> _Slot | None:
        for s in self._slots:
            if fut is s.done or fut in s.outputs:
                return s
        return None

    def _timeout_error(self, running: list[int]) -> CallTimeoutError:
        return CallTimeoutError(
            f"group {self.group!r}, endpoint {self.endpoint!r}: no result after {self._timeout} s; rank(s) "
            f"{running} still running. Raise the timeout with .options(timeout=...) or look at those ranks.",
            group=self.group, endpoint=self.endpoint, pending_ranks=running)

    def _convert(self, e: BaseException, slot: _Slot | None) -> BaseException:
        return convert_error(e, self.group, self.endpoint, slot.rank if slot else None)

    async def outputs(self) -> list[list[Output]]:
        """Per collected slot, its output headers (waiting for every rank to finish)."""
        await self.wait()
        return [[_as_output(o.result(), s.rank) for o in s.outputs] for s in self._slots if s.collected]

    async def result(self) -> Any:
        """The materialized value: a Batch (rows in input order) or, for non-Batch endpoints, per-rank values."""
        if self._result is not _UNSET:
            return self._result
        per_slot = await self.outputs()
        values = []
        refs, infos = [], []
        for outs in per_slot:
            for o in outs:
                if o.is_batch:
                    for p in o.parts:
                        infos.append(p)
                        if isinstance(p.ref, ray.ObjectRef):
                            refs.append(p.ref)
        fetched = iter(await asyncio.gather(*refs)) if refs else iter(())
        by_info = {id(p): (next(fetched) if isinstance(p.ref, ray.ObjectRef) else p.ref) for p in infos}
        _stats.add_materialized(sum(p.nbytes for p in infos))
        if self._concat_all and per_slot and all(o.is_batch for outs in per_slot for o in outs):
            # rows of a sharded call: one concatenation over every part (not per rank, then again over ranks)
            batches = [by_info[id(p)] for outs in per_slot for o in outs for p in o.parts]
            values.append(Batch.concat(batches) if batches else Batch.from_dict({}))
            per_slot = []
        for outs in per_slot:
            if outs and all(o.is_batch for o in outs):
                batches = [by_info[id(p)] for o in outs for p in o.parts]
                values.append(Batch.concat(batches) if batches else Batch.from_dict({}))
            elif len(outs) == 1:
                values.append(outs[0].value)
            else:
                values.append([o.value if not o.is_batch else Batch.concat([by_info[id(p)] for p in o.parts])
                               for o in outs])
        self._result = self._collect(values) if self._collect else values
        return self._result

    def __await__(self):
        return self.result().__await__()

    async def parts(self) -> AsyncIterator[Part]:
        """Yield parts as they finish (not in row order: each Part says its slot and sequence number)."""
        await self._wait_submitted()
        pending: dict[asyncio.Future, tuple[_Slot, int, int]] = {}
        seen: dict[int, int] = {i: 0 for i in range(len(self._slots))}
        while True:
            watchers = [s.watch() for s in self._slots if s.collected and not s.done.done()]
            for i, s in enumerate(self._slots):
                if not s.collected:
                    continue
                while seen[i] < len(s.outputs):
                    pending[s.outputs[seen[i]]] = (s, i, seen[i])
                    seen[i] += 1
            if not pending and not watchers:
                await self.wait()  # surface errors of non-collector ranks
                return
            done, _ = await asyncio.wait({*pending, *watchers}, timeout=self._remaining(),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                self.cancel()
                raise self._timeout_error(self._running_ranks())
            for s in self._slots:
                if s.collected and s.done.done() and s.done.exception() is not None:
                    self.cancel()
                    raise self._convert(s.done.exception(), s)
            for d in done:
                if d not in pending:
                    continue
                if d.exception() is not None:
                    self.cancel()
                    raise self._convert(d.exception(), self._slot_of(d))
                slot, i, seq = pending.pop(d)
                out = _as_output(d.result(), slot.rank)
                for p in out.parts or ():
                    yield Part(i, seq, slot.rank, p.rows, p.nbytes, out.keys, p)

    def __aiter__(self) -> AsyncIterator[Part]:
        return self.parts()

    # -- composition ----------------------------------------------------------------------------------------------
    def __or__(self, other: Any) -> DataFuture:
        if isinstance(other, (DataFuture, Batch)):
            return UnionFuture([*_sources(self), *_sources(other)])
        return NotImplemented

    def __ror__(self, other: Any) -> DataFuture:
        if isinstance(other, Batch):
            return UnionFuture([other, *_sources(self)])
        return NotImplemented

    # -- cancellation ---------------------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Cancel the Ray work of every rank still running."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for s in self._slots:
            if s.call_ref is not None and (not s.done.done() or not all(o.done() for o in s.outputs)):
                try:
                    ray.cancel(s.call_ref)
                except Exception:
                    pass
        for s in self._slots:  # fetch and drop errors so that Ray does not print "unhandled error" later
            for o in s.outputs:
                o.add_done_callback(_swallow)


def _swallow(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


def _sources(x: Any) -> list[Any]:
    return list(x._parts_of) if isinstance(x, UnionFuture) else [x]


class UnionFuture(DataFuture):
    """Row-aligned union of several futures' (or batches') columns; later sources win on a name clash."""

    def __init__(self, sources: list[Any]) -> None:
        first = next(s for s in sources if isinstance(s, DataFuture))
        super().__init__(group=" | ".join(getattr(s, "group", "batch") for s in sources), endpoint="union")
        self._parts_of = sources
        self._set_slots([])
        self._deadline = first._deadline

    def done(self) -> bool:
        return all(s.done() for s in self._parts_of if isinstance(s, DataFuture))

    async def result(self) -> Batch:
        if self._result is _UNSET:
            vals = await asyncio.gather(*[s.result() if isinstance(s, DataFuture) else _const(s)
                                          for s in self._parts_of])
            for v, s in zip(vals, self._parts_of):
                if not isinstance(v, Batch):
                    raise TypeError(f"{getattr(s, 'group', '?')}.{getattr(s, 'endpoint', '?')} returned "
                                    f"{type(v).__name__}; only Batch results can be joined with |")
            out = vals[0]
            for v in vals[1:]:
                out = out.union(v)
            self._result = out
        return self._result

    async def wait(self) -> None:
        await asyncio.gather(*[s.wait() for s in self._parts_of if isinstance(s, DataFuture)])

    async def parts(self) -> AsyncIterator[Part]:
        raise TypeError("a union of futures has no parts of its own; iterate its sources, or await it")
        yield  # pragma: no cover

    def cancel(self) -> None:
        for s in self._parts_of:
            if isinstance(s, DataFuture):
                s.cancel()


async def _const(x: Any) -> Any:
    return x


def _as_output(x: Any, rank: int) -> Output:
    return x if isinstance(x, Output) else Output(rank, value=x)


class _Unset:
    pass


_UNSET = _Unset()


def convert_error(e: BaseException, group: str, endpoint: str, rank: int | None) -> BaseException:
    """Turn a Ray error into orchestra's: the worker's own WorkerError, or WorkerDiedError for a dead actor."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, WorkerError):
            return _plain(cause)
        if isinstance(cause, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)):
            return _died(cause, group, endpoint, rank)
        return WorkerError(str(cause or e), group=group, rank=rank, endpoint=endpoint,
                           remote_traceback=str(e), exc_type=type(cause or e).__name__)
    if isinstance(e, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError,
                      ray.exceptions.WorkerCrashedError)):
        return _died(e, group, endpoint, rank)
    if isinstance(e, (WorkerError, CallTimeoutError)):
        return e
    if isinstance(e, ray.exceptions.TaskCancelledError):
        return asyncio.CancelledError(f"group {group!r}, endpoint {endpoint!r}: the call was cancelled")
    if isinstance(e, OrchestraError):
        return e
    return e


def _plain(e: WorkerError) -> WorkerError:
    """A WorkerError without Ray's dual-class wrapper, so that ``except orc.WorkerError`` reads naturally."""
    cls = WorkerDiedError if isinstance(e, WorkerDiedError) else WorkerError
    return cls(e.message, group=e.group, role=e.role, rank=e.rank, endpoint=e.endpoint,
               remote_traceback=e.remote_traceback, exc_type=e.exc_type)


def _died(e: BaseException, group: str, endpoint: str, rank: int | None) -> WorkerDiedError:
    return WorkerDiedError(
        f"the worker process died while running this call ({type(e).__name__}); check the worker's log for an OOM "
        f"kill or crash, then recreate the group", group=group, rank=rank, endpoint=endpoint,
        exc_type="WorkerDied")
