"""Routing arithmetic: which rows a consumer rank reads (``row_range``, ``_wanted``) and which producer parts overlap
them (``overlapping``); then the host's read path over in-memory parts (no Ray cluster: parts hold Batches).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestra import Batch
from orchestra._batch import balanced_sizes
from orchestra._host import PART_BYTES, Host, _counters, _part_sizes, _span_of, _wanted, part_count
from orchestra._wire import (INLINE_BYTES, DataArg, Layout, Output, PartInfo, RefAt, Source, Span, overlapping,
                             reader_cuts, row_range)

FAST = settings(deadline=None, max_examples=80)


def balanced(i: int, count: int, pad: bool = False) -> Layout:
    return Layout("balanced", i, count, pad)


# -- row_range ----------------------------------------------------------------------------------------------------
def test_row_range_whole():
    assert row_range(10, Layout()) == (0, 10, 0)
    assert row_range(12, Layout("whole", pad_rows=2)) == (0, 12, 2)
    assert row_range(0, Layout()) == (0, 0, 0)


def test_row_range_balanced_larger_first():
    assert [row_range(10, balanced(i, 4)) for i in range(4)] == [(0, 3, 0), (3, 6, 0), (6, 8, 0), (8, 10, 0)]
    assert [row_range(2, balanced(i, 4)) for i in range(4)] == [(0, 1, 0), (1, 2, 0), (2, 2, 0), (2, 2, 0)]
    assert row_range(0, balanced(0, 3)) == (0, 0, 0)


def test_row_range_balanced_padded_wraps_past_the_end():
    # 10 rows over 4 with padding: 4 equal shards of 3; the last reads row 9 then wraps to rows 0, 1
    assert [row_range(10, balanced(i, 4, pad=True)) for i in range(4)] == [(0, 3, 0), (3, 6, 0), (6, 9, 0),
                                                                           (9, 12, 2)]
    # 5 over 4: shards of 2; rank 2 reads row 4 and one padding row, rank 3 two padding rows
    assert [row_range(5, balanced(i, 4, pad=True)) for i in range(4)] == [(0, 2, 0), (2, 4, 0), (4, 6, 1),
                                                                          (6, 8, 2)]
    assert row_range(8, balanced(1, 4, pad=True)) == (2, 4, 0)  # divisible: no padding
    assert row_range(0, balanced(2, 4, pad=True)) == (0, 0, 0)


def test_row_range_unknown_layout():
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        row_range(4, Layout("diagonal"))


# -- overlapping --------------------------------------------------------------------------------------------------
def test_overlapping_hand_cases():
    parts = [3, 3, 2, 2]  # global rows [0,3) [3,6) [6,8) [8,10)
    assert overlapping(parts, 0, 5) == [(0, 0, 3), (1, 0, 2)]
    assert overlapping(parts, 5, 10) == [(1, 2, 3), (2, 0, 2), (3, 0, 2)]
    assert overlapping(parts, 3, 6) == [(1, 0, 3)]  # exactly one part
    assert overlapping(parts, 7, 7) == []
    assert overlapping([0, 4, 0, 4], 2, 6) == [(1, 2, 4), (3, 0, 2)]  # empty parts are never read
    assert overlapping([], 0, 0) == []


# -- _wanted (padding wrap) ---------------------------------------------------------------------------------------
def test_wanted_hand_cases():
    assert _wanted(0, 3, 10) == [(0, 3)]
    assert _wanted(9, 12, 10) == [(9, 10), (0, 2)]  # row 9, then wrap to rows 0, 1
    assert _wanted(6, 8, 5) == [(1, 3)]  # entirely padding: rows 1, 2
    assert _wanted(4, 6, 5) == [(4, 5), (0, 1)]
    assert _wanted(2, 3, 2) == [(0, 1)]
    assert _wanted(3, 4, 2) == [(1, 2)]
    assert _wanted(0, 0, 5) == []
    assert _wanted(0, 3, 0) == []  # nothing to wrap onto


# -- properties ---------------------------------------------------------------------------------------------------
part_sizes = st.lists(st.integers(0, 7), min_size=1, max_size=8)
consumers = st.integers(1, 7)


def _offsets(parts: list[int]) -> list[int]:
    out, o = [], 0
    for p in parts:
        out.append(o)
        o += p
    return out


def _rows_read(parts: list[int], ranges: list[tuple[int, int]]) -> tuple[list[int], set[int]]:
    offsets = _offsets(parts)
    rows, touched = [], set()
    for lo, hi in ranges:
        for i, a, b in overlapping(parts, lo, hi):
            assert 0 <= a < b <= parts[i]
            rows.extend(range(offsets[i] + a, offsets[i] + b))
            touched.add(i)
    return rows, touched


@FAST
@given(part_sizes, consumers)
def test_every_row_read_once_in_order(parts, count):
    n = sum(parts)
    offsets = _offsets(parts)
    union = []
    for r in range(count):
        start, stop, pad = row_range(n, balanced(r, count))
        assert pad == 0
        rows, touched = _rows_read(parts, [(start, stop)])
        assert rows == list(range(start, stop))
        # a rank touches exactly the non-empty parts that overlap its range
        expected = {i for i, p in enumerate(parts) if p and offsets[i] < stop and offsets[i] + p > start}
        assert touched == expected
        union.extend(rows)
    assert union == list(range(n))


@FAST
@given(part_sizes.filter(lambda p: sum(p) > 0), consumers)
def test_padded_ranks_read_equal_shards_that_wrap(parts, count):
    n = sum(parts)
    per = -(-n // count)
    union, real = [], []
    for r in range(count):
        start, stop, pad = row_range(n, balanced(r, count, pad=True))
        wanted = _wanted(start, stop, n)
        rows, _ = _rows_read(parts, wanted)
        assert len(rows) == per  # every rank gets the same number of rows
        assert rows == [k % n for k in range(start, stop)]
        assert 0 <= pad <= per
        union.extend(rows)
        real.extend(rows[: per - pad])  # what is left once the padding rows are stripped
    assert union == [k % n for k in range(per * count)]
    assert real == list(range(n))


@FAST
@given(part_sizes, consumers, st.booleans())
def test_wanted_without_wrap_is_the_range_itself(parts, count, pad):
    n = sum(parts)
    for r in range(count):
        start, stop, _ = row_range(n, balanced(r, count, pad))
        if stop <= n:
            assert _wanted(start, stop, n) == ([(start, stop)] if stop > start else [])


# -- the host's read path over in-memory parts --------------------------------------------------------------------
def _produce(part_rows: list[int]) -> tuple[Batch, list[PartInfo]]:
    n = sum(part_rows)
    full = Batch.from_dict({"i": torch.arange(n), "s": [f"r{k}" for k in range(n)]})
    infos = [PartInfo(p, len(p), p.nbytes) for p in full.split(part_rows)]
    return full, infos


def _host() -> Host:
    return Host.__new__(Host)  # only the pure read path is used: no actor, no Ray


@FAST
@given(part_sizes.filter(lambda p: sum(p) > 0), consumers, st.booleans())
def test_host_materializes_its_rows_and_counts_only_overlapping_parts(parts, count, pad):
    full, infos = _produce(parts)
    n = len(full)
    got = []
    for r in range(count):
        layout = Layout("balanced", r, count, pad, allow_empty=True)
        counters = _counters()
        batch, pad_rows, _ = _host()._materialize(DataArg((Source(tuple(infos)),), layout), (), counters)
        start, stop, expected_pad = row_range(n, layout)
        assert pad_rows == expected_pad
        assert batch["i"].tolist() == [k % n for k in range(start, stop)]
        assert list(batch["s"]) == [f"r{k % n}" for k in range(start, stop)]
        read = {i for lo, hi in _wanted(start, stop, n) for i, _, _ in overlapping(parts, lo, hi)}
        assert counters["parts_in"] == len(read)
        assert counters["rows_in"] == sum(parts[i] for i in read)
        assert counters["rows_used"] == stop - start
        got.extend(batch["i"].tolist()[: len(batch) - pad_rows])
    assert got == list(range(n))


def test_host_union_of_two_sources_with_different_part_boundaries():
    _, left = _produce([4, 6])
    right_full = Batch.from_dict({"y": torch.arange(10) * 10})
    right = [PartInfo(p, len(p), p.nbytes) for p in right_full.split(balanced_sizes(10, 3))]  # 4, 3, 3
    outs = (Output(0, parts=tuple(left[:1])), Output(1, parts=tuple(left[1:])))
    arg = DataArg((Source((RefAt(0), RefAt(1))), Source(tuple(right))), Layout("balanced", 1, 2))
    b, pad, _ = _host()._materialize(arg, outs, _counters())  # RefAt: the place of a resolved header ref
    assert pad == 0
    assert b["i"].tolist() == [5, 6, 7, 8, 9] and b["y"].tolist() == [50, 60, 70, 80, 90]
    assert list(b["s"]) == ["r5", "r6", "r7", "r8", "r9"]


def test_host_rejects_misaligned_union_and_empty_shard():
    _, a = _produce([5])
    _, b = _produce([4])
    with pytest.raises(ValueError, match=r"different row counts \[5, 4\]"):
        _host()._materialize(DataArg((Source(tuple(a)), Source(tuple(b))), Layout()), (), _counters())
    for index in range(4):  # every rank alike, also those whose share would hold a row (they ran, before)
        with pytest.raises(ValueError, match="2 rows cannot be split into 4 shards"):
            _host()._materialize(DataArg((Source(tuple(_produce([2])[1])),), balanced(index, 4)), (), _counters())


# -- parts sized by their readers (Host._store) ------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.lists(st.integers(1, 8), min_size=1, max_size=3), st.data())
def test_parts_cut_at_reader_boundaries_are_read_whole_by_every_reader(total, readers, data):
    """A producer's rows [start, start + rows) cut at ``reader_cuts``: every reader of a DP size in ``readers``
    (balanced or padded shares) reads only whole parts, i.e. exactly its rows."""
    start = data.draw(st.integers(0, total - 1))
    span = Span(start, data.draw(st.integers(1, total - start)), total)
    bounds = [span.start, *[span.start + c for c in reader_cuts(span, tuple(readers))], span.start + span.rows]
    assert bounds == sorted(set(bounds))  # strictly increasing: no empty part
    for d in readers:
        shares = [row_range(total, Layout("balanced", i, d, pad)) for i in range(d) for pad in (False, True)]
        for start, stop, _ in shares:
            for lo, hi in _wanted(start, stop, total):  # a padded share past the end wraps to the first rows
                for a, b in zip(bounds, bounds[1:]):  # a part either lies inside the rows read or outside them
                    assert b <= lo or a >= hi or (lo <= a and b <= hi), (d, (start, stop), (lo, hi), (a, b))


def test_part_sizes_follow_readers_when_the_rows_place_is_known():
    big = 64 << 20
    # not known where the rows sit: at least 8 parts, so that any reader fetches little beyond its rows
    assert len(_part_sizes(1000, big, None, (2, 4))) == part_count(big) >= 8
    # rows 0..250 of 1000, readers of 4 (and 2): this rank's rows are one reader's share -> split only at PART_BYTES
    sizes = _part_sizes(250, big // 4, Span(0, 250, 1000), (2, 4))
    assert sum(sizes) == 250 and len(sizes) == -(-(big // 4) // PART_BYTES) == 2
    # a reader of 3 needs a cut at row 334 inside rows 250..500
    assert _part_sizes(250, 1 << 20, Span(250, 250, 1000), (3, 4)) == [84, 166]
    # small: one part in the reply, wherever its readers start
    assert _part_sizes(250, INLINE_BYTES - 1, Span(250, 250, 1000), (3, 4)) == [250]
    assert _part_sizes(0, 0, Span(0, 0, 10), (2,)) == [0]


def test_span_of_parts_needs_every_part_placed_and_contiguous():
    def p(start: int, rows: int, total: int = 10) -> PartInfo:
        return PartInfo(None, rows, rows, start=start, total=total)

    assert _span_of([p(3, 2), p(5, 3)]) == Span(3, 5, 10)
    assert _span_of([p(3, 2), p(6, 3)]) is None  # a gap
    assert _span_of([p(-1, 2, -1)]) is None  # a producer that did not know
    assert _span_of([p(0, 2), p(2, 3, 11)]) is None  # parts of different calls
    assert _span_of([]) is None
