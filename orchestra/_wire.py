"""What travels between controller and workers: part headers, call outputs and data-argument descriptors.

All of it is small. Payloads stay in the object store and are named here only by ObjectRef.
Routing (which rows a rank reads, which parts overlap them) is pure arithmetic over headers and lives here too,
so that it is unit-testable without Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ._batch import Batch, balanced_sizes, schemas_apart

__all__ = ["PartInfo", "Output", "Source", "DataArg", "Layout", "Span", "row_range", "padded_again", "padded_apart",
           "columns_apart", "overlapping", "reader_cuts", "private_part", "RefAt",
           "REFS_KWARG", "SHARED_KWARG", "FRAME_KWARG", "FRAME_REFS_KWARG", "STORE_KWARG", "INLINE_BYTES"]

REFS_KWARG = "_orc_refs"  # the keyword under which a call's upstream header refs travel (fetched by the worker)
SHARED_KWARG = "_orc_shared"  # the arguments (positions, keyword names) other readers share: each rank copies them
# a shard call's (reader DP sizes, a controller-made shard's Span as (start, rows, total), or None)
STORE_KWARG = "_orc_store"
FRAME_KWARG = "_orc_frame"  # a Ray call's arguments for one rank, pickled into one frame (see _frame)
FRAME_REFS_KWARG = "_orc_frame_refs"  # refs and actor handles lifted out of that frame, in order (Ray tracks them)
INLINE_BYTES = 64 << 10  # controller-made shards below this travel inside the call instead of via ray.put


@dataclass(frozen=True)
class Span:
    """Where a rank's rows sit in the row sequence of a whole call: rows [start, start + rows) of ``total``."""

    start: int
    rows: int
    total: int


@dataclass(frozen=True)
class PartInfo:
    """One stored object of rows: its ref (or, for tiny controller-made shards, the Batch itself) and size."""

    ref: Any
    rows: int
    nbytes: int
    tag: str = ""  # names a part that rides inline (no ref) so traces can follow it from producer to reader
    start: int = -1  # its first row's index in the rows of the whole call (-1: not known)
    total: int = -1  # how many rows the whole call has (-1: not known)
    pad: int = 0  # how many of its last rows are padding of the producer's own (``Batch.pad_to_multiple``)

    @property
    def key(self) -> str:
        """A stable name for this part: its object id, or its tag when it rides inline."""
        return self.tag or (self.ref.hex() if hasattr(self.ref, "hex") and not isinstance(self.ref, (bytes, str))
                            else "")


@dataclass(frozen=True)
class Output:
    """What one rank call (or one yield of a streaming endpoint) hands back: part headers, or a plain value."""

    rank: int
    parts: tuple[PartInfo, ...] | None = None
    value: Any = None
    keys: tuple[str, ...] = ()
    schema: tuple = ()  # Batch._schema() of the rows: what the rows of other outputs must match to join them

    @property
    def is_batch(self) -> bool:
        return self.parts is not None

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts) if self.parts is not None else 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) if self.parts is not None else 0


@dataclass(frozen=True)
class Layout:
    """Which rows of the (unioned) input a rank reads.

    kind "whole": all rows; "balanced": piece ``index`` of ``count`` near-equal pieces (``pad`` makes the pieces
    equal by wrapping around to the first rows, and those rows are stripped from the result again); "per_rank":
    no rows at all — each source is one upstream rank's outputs, read as the list of their values that ``await``
    gives (a ``broadcast()`` future forwarded into a broadcast call).
    ``pad_rows``: for "whole", how many trailing rows are padding the controller added.
    ``slots`` / ``one``: for "whole" read by a broadcast call from one future, how many outputs each of its
    collected ranks gave, and whether it keeps one rank (``rank_zero()`` / ``from_rank()``). Plain values (not
    rows) are then read as ``await`` gives them: per rank its value (or the list of the values it yielded), as a
    list over the ranks, or the kept rank's alone.
    ``sources``: for "balanced", the producer of each source (``"group 'g', endpoint 'e'"``), named by a rank that
    refuses to read it.
    """

    kind: str = "whole"
    index: int = 0
    count: int = 1
    pad: bool = False
    pad_rows: int = 0
    allow_empty: bool = False
    span: Span | None = None  # "whole" of a controller-made shard: where its rows sit in the caller's batch
    slots: tuple[int, ...] = ()
    one: bool = False
    sources: tuple[str, ...] = ()  # "balanced": each source's producer, as errors name it ("" for a Batch)


class RefAt(int):
    """The place of an output's ref in the refs a call carries (``REFS_KWARG``): a type of its own, so that a plain
    int forwarded by value is never read as such a place."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"RefAt({int(self)})"


@dataclass(frozen=True)
class Source:
    """The outputs holding one future's rows, in row order: a ``RefAt`` is the place of one in the refs the call
    carries (resolved on the rank); anything else is the output itself (an Output, a PartInfo, a plain value)."""

    outputs: tuple[Any, ...]


@dataclass(frozen=True)
class DataArg:
    """A data argument: one or more row-aligned sources (a union) and the rows this rank reads."""

    sources: tuple[Source, ...]
    layout: Layout = field(default_factory=Layout)
    values_ok: bool = False  # a broadcast argument may be a forwarded plain value instead of rows


def private_part(p: PartInfo) -> PartInfo:
    """``p`` with its rows copied when they ride inline (a Batch the controller holds, not a ref): what is handed
    to a caller, so that writing into it reaches no other reader (an await, a call the future is forwarded into)."""
    return replace(p, ref=p.ref.clone()) if isinstance(p.ref, Batch) else p


def rank_value(outs: list[Output], rows: Callable[[list[PartInfo]], Any]) -> Any:
    """What ``await`` gives for one rank's outputs — the one rule, used by the controller (``Invocation._join``)
    and by a worker reading a forwarded future (``Host``): its Batch outputs joined into one Batch (``rows`` of
    all their parts), one plain value as is, several outputs as a list."""
    if outs and all(o.is_batch for o in outs):
        return rows([p for o in outs for p in o.parts])
    if len(outs) == 1:
        return outs[0].value
    return [rows(list(o.parts)) if o.is_batch else o.value for o in outs]


def padded_again(rows: int, layout: Layout, own: int) -> str | None:
    """Why a pad read of ``layout`` cannot take rows that hold ``own`` padding rows of their own (``PartInfo.pad``,
    ``rows`` rows in all), or None when it can: ``rows`` is not a multiple of the read's pieces, so pad() would pad
    them again, and no piece could say which rows are whose. The controller asks when it has the part headers
    (before sending), every rank when it reads them: the same answer everywhere, so the call runs on every rank or
    on none."""
    if not own or layout.kind != "balanced" or not layout.pad or rows % layout.count == 0:
        return None
    return (f"shard(pad=True) / pad() would pad forwarded rows that hold {own} padding row(s) of their own "
            f"(pad_to_multiple), {rows} rows over {layout.count} pieces, and no piece could say which rows are whose: "
            f"unpad() them in the upstream endpoint first, or read them with a call without pad()")


def padded_apart(rows: list[int], pieces: int) -> str | None:
    """Why a pad call over ``pieces`` DP pieces cannot take data arguments of these row counts, or None when it can:
    pad() pads each to equal shards on its own, so arguments of different rows, one of them padded, would be padded
    differently, and a rank's rows of one would not be its rows of the other (with no padding they split as a
    call without pad splits them). Asked by the controller of the counts it knows, and by every rank of all."""
    if len(set(rows)) < 2 or not any(n % pieces for n in rows):
        return None
    counts = " and ".join(str(n) for n in sorted(set(rows)))
    return (f"shard(pad=True) / pad() would pad data arguments of {counts} rows differently, and a rank's rows of one "
            f"would not be the same rows of another: pass row-aligned inputs as one union a | b, or give each "
            f"argument the same rows")


def columns_apart(outputs: Sequence[Any], names: Sequence[str] | None = None) -> str | None:
    """Why the rows of these outputs (Outputs and PartInfos, in row order) cannot be read as one Batch, or None when
    they can: ``Batch.concat`` refuses outputs with rows whose columns differ in name, kind or row shape (``await``
    of their future does). Outputs without rows, or without a schema (rows the controller split from a caller's
    Batch), are skipped. Asked by the controller of the headers it has and by every reading rank of all of them, so a
    future whose ranks' results do not join is read by no rank. ``names``: each output's name in the error."""
    first: tuple[int, Any] | None = None

    def name(k: int, out: Output) -> str:  # (the failure path only)
        if names is not None:
            return names[k]
        same = [i for i, p in enumerate(outputs) if isinstance(p, Output) and p.rank == out.rank]
        return (f"rank {out.rank}'s result" if len(same) < 2 else
                f"rank {out.rank}'s output {same.index(k)} (of a generator)")

    for i, o in enumerate(outputs):
        if not (isinstance(o, Output) and o.schema and o.parts and any(p.rows for p in o.parts)):
            continue
        if first is None:
            first = (i, o)
            continue
        j, f = first
        why = schemas_apart(f.schema, o.schema)
        if why is not None:
            return (f"{name(i, o)} and {name(j, f)} {why}, so they do not join into one Batch (await of the future "
                    f"refuses them too) and no reader could read its rows as the others read theirs: make every rank "
                    f"return the same columns, of one kind and row shape")
    return None


def row_range(n: int, layout: Layout) -> tuple[int, int, int]:
    """(start, stop, pad) of the rows a rank reads from ``n`` rows; rows past ``n`` wrap to the start (padding)."""
    if layout.kind == "whole":
        return 0, n, layout.pad_rows
    if layout.kind != "balanced":
        raise ValueError(f"unknown layout {layout.kind!r}")
    if layout.pad:
        per = -(-n // layout.count) if n else 0
        start = layout.index * per
        stop = start + per
        return start, stop, max(0, stop - max(n, start))
    sizes = balanced_sizes(n, layout.count)
    start = sum(sizes[: layout.index])
    return start, start + sizes[layout.index], 0


def overlapping(part_rows: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(part index, local start, local stop) of every part that overlaps global rows [start, stop)."""
    out, offset = [], 0
    for i, rows in enumerate(part_rows):
        lo, hi = max(start, offset), min(stop, offset + rows)
        if lo < hi:
            out.append((i, lo - offset, hi - offset))
        offset += rows
        if offset >= stop:
            break
    return out


def reader_cuts(span: Span, readers: tuple[int, ...]) -> list[int]:
    """Local row offsets (0 < c < span.rows) at which rows [span.start, span.start + span.rows) of a
    ``span.total``-row sequence cross a boundary between two readers' shares, for a reader of each DP size in
    ``readers`` (balanced shares, and the equal shares of ``shard(pad=True)``, whose last ones wrap around to the
    first rows). Parts cut there are read whole by every such reader: no reader fetches another's rows."""
    lo, hi, total = span.start, span.start + span.rows, span.total
    cuts: set[int] = set()
    for d in readers:
        if d <= 1 or total <= 0:
            continue
        acc = 0
        for size in balanced_sizes(total, d)[:-1]:
            acc += size
            if lo < acc < hi:
                cuts.add(acc - lo)
        per = -(-total // d)
        for k in range(1, d + 1):  # padded shares past the end read the first rows again: their bounds wrap too
            at = (k * per) % total
            if lo < at < hi:
                cuts.add(at - lo)
    return sorted(cuts)
