"""DataFuture: what every group call returns at once — a thin public view of the call's ``Invocation``.

A call's result is an ordered list of *slots* (one per collected rank, in row order; for a ``stream()`` call, one per
upstream slot, run by replica i mod D); each slot holds the outputs that rank produced (one for a plain endpoint,
one per yield for a streaming one). An output is a small header (row count, columns, part refs) whose payload
parts stay in the object store. ``await`` materializes the value (a private copy); passing the future into
another call forwards the header refs so that the next workers read the parts directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from . import _backend, _stats
from ._batch import Batch
from ._errors import DispatchError
from ._invocation import Invocation, components
from ._wire import Output, PartInfo, private_part

__all__ = ["DataFuture", "Part"]


@dataclass(frozen=True)
class Part:
    """One stored piece of a result: its rows, columns and bytes, readable with ``await part.get()``. ``slot`` is
    the output slot it belongs to (for a ``stream()`` call, the upstream slot whose part it maps); ``rank`` is the
    rank of this group that produced it."""

    slot: int
    seq: int
    rank: int
    rows: int
    nbytes: int
    keys: tuple[str, ...]
    info: PartInfo

    async def get(self) -> Batch:
        """Fetch this part's rows into the controller (a private copy; counted in ``controller_stats()``)."""
        b = await self.info.ref if _backend.is_ref(self.info.ref) else self.info.ref
        _stats.add_materialized(self.nbytes)
        return b.clone()


class DataFuture:
    """The result of a group call, available at once: ``await`` it, ``async for`` its parts, or pass it on.

    Passed into another call its parts travel worker to worker: each receiving rank fetches only the parts that
    overlap its rows. ``fut_a | fut_b`` is the row-aligned union of two futures' columns, still unmaterialized.
    ``cancel()`` ends the call everywhere; every awaiter then gets ``CallCancelledError``.
    """

    __slots__ = ("_inv",)

    def __init__(self, invocation: Invocation) -> None:
        self._inv = invocation

    @property
    def group(self) -> str:
        """The name of the group that runs the call."""
        return self._inv.group

    @property
    def endpoint(self) -> str:
        """The endpoint called."""
        return self._inv.endpoint

    @property
    def _orc_sources(self) -> list[Any]:  # what a call that takes this future reads
        return [self._inv]

    def rows_if_known(self) -> int | None:
        """The row count once every producing rank has reported it (None before, or for non-Batch results)."""
        return self._inv.rows_if_known()

    def done(self) -> bool:
        """True once every rank finished (successfully or not), or the call was cancelled."""
        return self._inv.finished()

    def __repr__(self) -> str:
        return f"<DataFuture {self.group}.{self.endpoint} {'done' if self.done() else 'pending'}>"

    def __reduce__(self) -> Any:
        """A future is the controller's handle on a call, not data: it travels only as a call's argument itself."""
        raise TypeError(f"{self!r} cannot be serialized: a DataFuture is forwarded only as a top-level argument of a "
                        f"call (or a union of futures), not inside a list, dict, object column or other value. "
                        f"Pass it as an argument of its own, or await it and pass the value")

    async def wait(self) -> None:
        """Wait until every rank has finished; raise the first failure at once, cancelling the other ranks."""
        await self._inv.wait()

    async def outputs(self) -> list[list[Output]]:
        """Per collected slot, its output headers (waiting for every rank to finish)."""
        return await self._inv.outputs()

    async def result(self) -> Any:
        """The materialized value: a Batch (rows in input order) or, for non-Batch endpoints, per-rank values."""
        return await self._inv.result()

    def __await__(self):
        return self.result().__await__()

    async def parts(self) -> AsyncIterator[Part]:
        """Yield parts as they finish: each rank's in the order it produced them, ranks interleaved as they arrive
        (not in row order overall: each Part says its slot and sequence number).

        The call counts as seen (``failed_calls_not_awaited``) only once this iteration reaches the end or raises the
        call's error; one left before its end (``break``) has seen nothing of what came after, and the call is a
        stream not drained (``WorkerGroup.streams_not_drained``) until something awaits it."""
        inv = self._inv
        inv.iterating()
        try:
            await inv.wait_submitted()  # cancelled here, before the call is sent: the call is cancelled too
            slots = inv.slots
            pending: dict[asyncio.Future, tuple[Any, int, int]] = {}  # at most one per slot: its next output
            waiting: set[int] = set()  # slots with an output in pending
            seen = {i: 0 for i in range(len(slots))}
            while True:
                watchers = [s.watch() for s in slots if s.collected and not s.done.done()]
                for i, s in enumerate(slots):
                    if s.collected and i not in waiting and seen[i] < len(s.outputs):
                        pending[s.outputs[seen[i]]] = (s, i, seen[i])
                        waiting.add(i)
                        seen[i] += 1
                if not pending and not watchers:
                    await inv.wait()  # surface errors of non-collector ranks
                    return
                # the call's early end too: a death ends this loop even while another rank still blocks
                done, _ = await asyncio.wait({*pending, *watchers, inv.ended()}, timeout=inv.remaining(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if inv.error is not None:
                    inv.looked_at()
                    raise inv.error
                if not done:
                    inv.looked_at()
                    raise inv.fail(inv._timeout_error(inv._running_ranks()))
                for s in slots:
                    if s.collected and s.done.done() and s.done.exception() is not None:
                        raise inv.fail(await inv.converted(s.done.exception(), s))
                for d in sorted((d for d in done if d in pending), key=lambda d: pending[d][1]):
                    slot, i, seq = pending.pop(d)
                    waiting.discard(i)
                    if d.exception() is not None:
                        raise inv.fail(await inv.converted(d.exception(), slot))
                    if inv._apart_pending():  # rows read rank by rank upstream: refused by the headers here
                        refusal = inv.apart_refusal_known()  # (and by all of them at the end: inv.wait())
                        if refusal is not None:
                            inv.looked_at()
                            raise inv.fail(DispatchError(refusal))
                    out = d.result()
                    out = out if isinstance(out, Output) else Output(slot.rank, value=out)
                    if out.parts is None:  # a plain value has no rows to hand out as parts: say so, not end empty
                        raise TypeError(f"{inv.where()}: rank {slot.rank} returned {type(out.value).__name__}, not "
                                        f"a Batch: only rows come as parts; await the future for its values")
                    for p in out.parts:  # rows that rode in the reply: the Part's own copy
                        yield Part(i, seq, slot.rank, p.rows, p.nbytes, out.keys, private_part(p))
        except asyncio.CancelledError:  # the caller ended the iteration, and the call with it
            inv.iteration_ended()
            if not inv.finished():
                from ._errors import CallCancelledError

                inv.cancel(CallCancelledError(f"{inv.where()}: the task iterating its parts was cancelled"))
            raise
        except GeneratorExit:  # left before its end (``break``): nothing after the last part was seen
            raise
        except BaseException:  # the call's error (seen: handed out here), or one of this iteration's own
            inv.iteration_ended()
            raise

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
        """Cancel the call: its queued sends, streams and the Ray work of every rank still running."""
        self._inv.cancel()


def _sources(x: Any) -> list[Any]:
    return list(x._parts_of) if isinstance(x, UnionFuture) else [x]


class UnionFuture(DataFuture):
    """Row-aligned union of several futures' (or batches') columns; later sources win on a name clash."""

    __slots__ = ("_parts_of",)

    def __init__(self, sources: list[Any]) -> None:
        self._parts_of = sources
        first = next(s for s in sources if isinstance(s, DataFuture))
        super().__init__(first._inv)

    @property
    def group(self) -> str:
        return " | ".join(getattr(s, "group", "batch") for s in self._parts_of)

    @property
    def endpoint(self) -> str:
        return "union"

    @property
    def _orc_sources(self) -> list[Any]:
        return [c for s in self._parts_of for c in components(s)]

    def rows_if_known(self) -> int | None:
        rows = [len(s) if isinstance(s, Batch) else s.rows_if_known() for s in self._parts_of]
        return rows[0] if rows and all(r is not None and r == rows[0] for r in rows) else None

    def done(self) -> bool:
        return all(s.done() for s in self._parts_of if isinstance(s, DataFuture))

    async def wait(self) -> None:
        await asyncio.gather(*[s.wait() for s in self._parts_of if isinstance(s, DataFuture)])

    async def outputs(self) -> list[list[Output]]:
        raise TypeError("a union of futures has no outputs of its own; await it, or look at its sources")

    async def result(self) -> Batch:
        """The joined value, a private copy for each await (as a plain future's): every future's part is its own
        await's copy, and a Batch of the caller's is copied, so writing into the result changes nothing the caller,
        another reader or a later await sees."""
        vals = await asyncio.gather(*[s.result() if isinstance(s, DataFuture) else _const(s.clone())
                                      for s in self._parts_of])
        for v, s in zip(vals, self._parts_of):
            if not isinstance(v, Batch):
                raise TypeError(f"{getattr(s, 'group', '?')}.{getattr(s, 'endpoint', '?')} returned "
                                f"{type(v).__name__}; only Batch results can be joined with |")
        if len({len(v) for v in vals}) > 1:
            names = [f"{s.group}.{s.endpoint}" if isinstance(s, DataFuture) else "a Batch" for s in self._parts_of]
            raise ValueError("a union joins row-aligned sources, but " + ", ".join(
                f"{name} has {len(v)} rows" for name, v in zip(names, vals)) + ": join results of the same rows")
        out = vals[0]
        for v in vals[1:]:
            out = out.union(v)
        return out

    async def parts(self) -> AsyncIterator[Part]:
        raise TypeError("a union of futures has no parts of its own; iterate its sources, or await it")
        yield  # pragma: no cover

    def cancel(self) -> None:
        for s in self._parts_of:
            if isinstance(s, DataFuture):
                s.cancel()


async def _const(x: Any) -> Any:
    return x
