"""Frame templates: a repeated shard call's frames, made by writing its Batch's column bytes into those of an earlier
call of the same shape.

A training loop calls the same endpoint with a Batch of the same columns, dtypes and row count again and again
(``await g.step(batch)``). Each rank's frame of such a call differs from the last call's only in the bytes of its
shard's columns; making it the usual way (split the Batch into shard Batches, describe each, pickle each rank's
arguments) is most of what the controller spends sending a small step on the fast path. So a group learns, per
endpoint, a template from the second call in a row of one shape (``shape_of``): its frames, made the usual way, and
those of the same call with random bytes for its columns, which show where each rank's column bytes lie. It is kept
only when writing the call's own bytes there gives back its frames exactly, byte for byte. A later call of that
shape writes its column bytes into the template: the frames it would have pickled, without splitting or pickling
(byte for byte but for pickle's back-references to a string object already in the frame: a column named like the
keyword the Batch is passed by may be written out where pickling would refer back to it, or the reverse; it
unpickles to the same).

What a frame holds besides column bytes is all in the shape: endpoint, executing ranks, argument name, shard spec,
the reader sizes a shard call tells each rank, row count, each column's name, dtype and row shape, and the
reduction a custom serializer could change (``Batch``'s; no numpy array is in such a frame, and a shard's Span
travels as a plain tuple). A call
that differs in any of them (another row count, a ``meta`` or non-tensor column, another argument) is made the
usual way, and so is one with a column that is not contiguous (each shard of it is copied on its own) or that
cannot travel (its error comes from there). Only one concrete Batch argument of flat tensor columns is templated.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from . import _frame
from ._batch import SMALL_COLUMN_BYTES, Batch, _memory_of, _wire_array, balanced_sizes
from .dispatch import Plan

__all__ = ["FrameTemplate", "Templates", "shape_of"]

log = logging.getLogger("orchestra")

MIN_PIECE_BYTES = 8  # a rank's column bytes are found in its frame only when at least this long (else no template)
MAX_COLUMNS = 64  # learning searches each rank's frame once per column: a Batch of more columns is pickled as usual
MAX_COLUMN_READ = 1 << 30  # a column read from memory at once is at most this (send-now batches are far smaller)

Frames = dict[int, tuple[bytes, list, tuple]]  # rank -> (frame, refs lifted out of it, refs as arguments): _encode's


def shape_of(plan: Plan, readers: tuple[int, ...], base: Mapping[type, Any]) -> tuple | None:
    """What the frames of ``plan`` depend on besides its columns' bytes (``readers``: the reader sizes its ranks are
    told; ``base``: the reductions registered now, ``_frame.reductions()`` or ``_frame.registered_for(Batch)``), or None
    when no template can make them: the call must be a shard call whose one argument is a concrete Batch of at most
    ``MAX_COLUMNS`` flat tensor columns, each shard's column inside the pickle (``SMALL_COLUMN_BYTES``: a larger one
    is a numpy array there, whose reductions a serializer could change), without non-tensor columns, meta or
    padding; and no module may be pickled by value (cloudpickle would write the module's globals into the frame)."""
    spec = plan.shard
    if spec is None or plan.per_rank or len(plan.args) + len(plan.kwargs) != 1:
        return None
    b = plan.args[0] if plan.args else next(iter(plan.kwargs.values()))
    if type(b) is not Batch or b._nt or b.meta or b._pad:
        return None
    td = b._td
    if type(td) is not TensorDict or _frame._by_value_modules():
        return None
    rows = td.batch_size[0]
    if spec.pad and rows % spec.dp_size:  # pad()'s filler rows are not the Batch's bytes
        return None
    most = -(-rows // spec.dp_size)  # the rows of the largest shard
    columns = []
    for k, v in td.items():
        if type(k) is not str or type(v) is not torch.Tensor or v.is_nested:
            return None
        row = v.shape[1:]
        if most * row.numel() * v.element_size() > SMALL_COLUMN_BYTES:
            return None
        columns.append((k, v.dtype, row))
        if len(columns) > MAX_COLUMNS:
            return None
    return (plan.endpoint, plan.ranks, tuple(plan.kwargs), spec, readers, rows, tuple(columns),
            base.get(Batch))


def _batch_of(plan: Plan) -> Batch:
    return plan.args[0] if plan.args else next(iter(plan.kwargs.values()))


def _column_bytes(b: Batch) -> list[memoryview] | None:
    """Each column's elements as the wire carries them (``_wire_array``), as flat bytes in row order; None when a
    column is not contiguous (a shard of it is copied on its own, and torch's copy of a bool column rewrites
    bytes that are not 0 or 1: only a contiguous column's bytes are the same whole and cut); a TypeError for one
    that cannot travel."""
    out = []
    for v in b._td.values():
        if type(v) is not torch.Tensor or v.layout is not torch.strided:  # (a sparse CSR one has no is_contiguous)
            _wire_array(v)  # raises the TypeError of a column that cannot travel
            return None  # a subclass that may: as usual
        if not v.is_contiguous():
            return None
        data = _memory_of(v, MAX_COLUMN_READ)  # (cheaper than numpy(): bench.rank_path)
        if data is not None:
            out.append(memoryview(data))
            continue
        arr = _wire_array(v)[0]  # converted first (another device, a conjugate or negative bit), or refused
        out.append(memoryview(arr.reshape(-1).view(np.uint8)))  # (contiguous: reshape is a view)
    return out


def _random_bytes(n: int) -> torch.Tensor:
    """``n`` random bytes as a uint8 tensor: a column's bytes no frame holds by chance."""
    return torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)


class FrameTemplate:
    """The frames of one call shape, with the places of each rank's column bytes cut out (see the module
    docstring). ``frames(batch)`` writes a Batch's column bytes into them."""

    __slots__ = ("cuts", "ranks")

    def __init__(self, cuts: list[list[tuple[int, int]]],
                 ranks: dict[int, tuple[int, tuple[int, ...], tuple[bytes, ...]]]) -> None:
        self.cuts = cuts  # per column, per DP piece: its (start, stop) in the column's bytes
        self.ranks = ranks  # per rank: its DP piece, the columns in the order the frame holds them, the pieces between

    @classmethod
    def learn(cls, plan: Plan, frames: Frames, encode: Callable[[Plan], Frames | None]) -> FrameTemplate | None:
        """The template of ``plan``'s shape (``shape_of``), from its ``frames`` (made the usual way) and those
        ``encode`` makes of the same call with random column bytes; None when they do not show where every rank's
        column bytes lie (a piece shorter than ``MIN_PIECE_BYTES``, found more than once, or a frame it does not give
        back)."""
        batch = _batch_of(plan)
        spec = plan.shard
        rows = len(batch)
        real = _column_bytes(batch)
        if real is None or not rows or not all(real):
            return None
        cuts = []
        for data in real:
            width = len(data) // rows
            at, spans = 0, []
            for n in balanced_sizes(rows, spec.dp_size):
                spans.append((at * width, (at + n) * width))
                at += n
            cuts.append(spans)
        noise = Batch({k: _random_bytes(len(d)).view(v.dtype).view(v.shape)
                       for (k, v), d in zip(batch._td.items(), real)})
        fake_frames = encode(plan.with_(args=(noise,) if plan.args else (),
                                        kwargs={k: noise for k in plan.kwargs}))
        if fake_frames is None:
            return None
        fake_bytes = _column_bytes(noise)
        if fake_bytes is None:
            return None
        ranks = {}
        for r, (frame, refs, top) in frames.items():
            fake, fake_refs, fake_top = fake_frames[r]
            if frame is None or fake is None or refs or top or fake_refs or fake_top or len(frame) != len(fake):
                return None
            d = spec.dp_of_rank[r]
            found = []
            for j, spans in enumerate(cuts):
                lo, hi = spans[d]
                if hi - lo < MIN_PIECE_BYTES:
                    return None
                piece = bytes(fake_bytes[j][lo:hi])
                at = fake.find(piece)
                if at < 0 or fake.find(piece, at + 1) >= 0:
                    return None
                found.append((at, hi - lo, j))
            found.sort()
            pieces, end = [], 0
            for at, n, _ in found:
                if at < end:
                    return None
                pieces.append(fake[end:at])
                end = at + n
            pieces.append(fake[end:])
            ranks[r] = (d, tuple(j for _, _, j in found), tuple(pieces))
        template = cls(cuts, ranks)
        if template.frames(batch) != frames:  # the call's own bytes must give back its own frames
            return None
        return template

    def frames(self, batch: Batch) -> Frames | None:
        """The frames of a call of this shape with ``batch`` as its argument; None when a column is not contiguous
        (``_column_bytes``), a TypeError for one that cannot travel."""
        data = _column_bytes(batch)
        if data is None:
            return None
        cuts = self.cuts
        out: Frames = {}
        for r, (d, order, pieces) in self.ranks.items():
            parts = [pieces[0]]
            for i, j in enumerate(order):
                lo, hi = cuts[j][d]
                parts.append(data[j][lo:hi])
                parts.append(pieces[i + 1])
            out[r] = (b"".join(parts), [], ())
        return out


class _Seen:
    """The last shape an endpoint was called with, and its template once learnt (None: not yet, or none)."""

    __slots__ = ("shape", "template", "learnt")

    def __init__(self, shape: tuple) -> None:
        self.shape, self.template, self.learnt = shape, None, False


class Templates:
    """A group's frame templates, one per endpoint: learnt from the second call in a row of one shape (so that a
    loop whose shapes keep changing pays only for reading them), dropped when another shape comes."""

    def __init__(self) -> None:
        self._by_endpoint: dict[tuple[str, str], _Seen] = {}
        self.used = 0  # calls whose frames a template made

    def frames(self, role: str, plan: Plan, readers: tuple[int, ...]) -> tuple[tuple | None, Frames | None]:
        """(the call's shape, its frames made from its endpoint's template), the frames None when no template of
        this shape is known; a column that cannot travel leaves them to the usual path, which says why."""
        shape = shape_of(plan, readers, _frame.registered_for(Batch))
        if shape is None:
            return None, None
        seen = self._by_endpoint.get((role, plan.endpoint))
        if seen is None or seen.template is None or seen.shape != shape:
            return shape, None
        try:
            frames = seen.template.frames(_batch_of(plan))
        except (TypeError, ValueError, RuntimeError) as e:  # a column that cannot travel (or torch refuses to read,
            # a ZeroTensor's numpy()): the usual path raises the error that names it
            log.debug("%s: this call's frames are made as usual (%r)", plan.where(), e)
            return shape, None
        if frames is not None:
            self.used += 1
        return shape, frames

    def saw(self, role: str, shape: tuple | None, plan: Plan, frames: Frames | None,
            encode: Callable[[Plan], Frames | None]) -> None:
        """A call of ``shape`` was made the usual way into ``frames``: the second in a row of its shape learns the
        template (``encode`` makes another call's frames the usual way)."""
        if shape is None or frames is None:
            return
        key = (role, plan.endpoint)
        seen = self._by_endpoint.get(key)
        if seen is None or seen.shape != shape:
            self._by_endpoint[key] = _Seen(shape)
            return
        if seen.learnt:
            return
        seen.learnt = True
        try:
            seen.template = FrameTemplate.learn(plan, frames, encode)
        except Exception as e:  # noqa: BLE001 - the call was sent: without a template its shape is made as usual
            log.debug("%s: no frame template for its calls of this shape (%r)", plan.where(), e)
        if seen.template is None:
            log.debug("%s: its calls of this shape are pickled as usual (no frame template)", plan.where())
