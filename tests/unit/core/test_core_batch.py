"""Batch: row operations (property-tested), column algebra, construction errors, equality and the wire format.

Every batch here is built from row ids: tensor column ``i`` is the id, ``x`` is ``[id, -id, 0.5 * id]``, bf16 column
``h`` is the id, and the non-tensor column ``s`` is ``"r<id>"`` — so after any operation the row order is
``b["i"].tolist()`` and ``aligned(b)`` checks that every column still describes the same row.
"""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestra import Batch
from orchestra._batch import balanced_sizes

FAST = settings(deadline=None, max_examples=60)
META = {"step": 7, "tag": "rollout"}


def make(ids: list[int], meta: dict | None = META) -> Batch:
    t = torch.tensor(ids, dtype=torch.int64)
    return Batch.from_dict({
        "i": t,
        "x": torch.stack([t.float(), -t.float(), 0.5 * t.float()], dim=1) if ids else torch.zeros(0, 3),
        "h": t.to(torch.bfloat16),
        "s": np.array([f"r{k}" for k in ids], dtype=object),
    }, meta=meta)


def ids(b: Batch) -> list[int]:
    return b["i"].tolist()


def aligned(b: Batch) -> bool:
    i = b["i"]
    return (len(b["s"]) == len(b) == len(i)
            and list(b["s"]) == [f"r{k}" for k in i.tolist()]
            and torch.equal(b["x"][:, 0], i.float()) and torch.equal(b["x"][:, 1], -i.float())
            and torch.equal(b["h"], i.to(torch.bfloat16)))


rows = st.integers(min_value=0, max_value=40)


@st.composite
def batch_and_sizes(draw):
    n = draw(rows)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=8)))  # repeated cuts give zero-size pieces
    bounds = [0, *cuts, n]
    return n, [b - a for a, b in itertools.pairwise(bounds)]


# -- split / concat / chunk ---------------------------------------------------------------------------------------
@FAST
@given(batch_and_sizes())
def test_split_concat_round_trip(case):
    n, sizes = case
    b = make(list(range(n)))
    pieces = b.split(sizes)
    assert [len(p) for p in pieces] == sizes
    start = 0
    for p, s in zip(pieces, sizes):
        assert ids(p) == list(range(start, start + s)) and aligned(p)
        assert p.meta == META
        start += s
    assert Batch.concat(pieces) == b


@FAST
@given(batch_and_sizes(), st.booleans())
def test_a_pieces_bytes_are_its_rows_share(case, numeric):
    """``nbytes`` is proportional to rows for every kind of column (tensors of any shape and dtype, numeric and
    object arrays): the controller sizes a shard it cut as rows x bytes per row of the whole (_describe_batch)."""
    n, sizes = case
    b = make(list(range(n)))
    if numeric:
        b["f"] = np.arange(2 * n, dtype=np.float64).reshape(n, 2)
        b["m"] = torch.zeros(n, 2, 3, dtype=torch.float16)
    per_row = b._bytes_per_row()
    assert (per_row is None) == (n == 0)
    assert b.nbytes == (per_row or 0) * n
    assert [p.nbytes for p in b.split(sizes)] == [s * (per_row or 0) for s in sizes]


def test_a_jagged_column_has_no_bytes_per_row():
    """Rows of a jagged (``torch.nested``) tensor differ in size: pieces are sized one by one, not as a share."""
    jagged = torch.nested.nested_tensor([torch.ones(k) for k in range(1, 6)], layout=torch.jagged)
    b = Batch.from_dict({"j": jagged, "i": torch.arange(5)})
    assert b._bytes_per_row() is None
    assert Batch.from_dict({"i": torch.arange(5)})._bytes_per_row() == 8


def test_split_rejects_sizes_that_do_not_add_up():
    b = make(list(range(5)))
    with pytest.raises(ValueError, match=r"add up to the batch's 5 rows"):
        b.split([2, 2])
    with pytest.raises(ValueError, match=">= 0"):
        b.split([6, -1])


def test_concat_rejects_mismatched_columns_and_empty_input():
    with pytest.raises(ValueError, match="at least one batch"):
        Batch.concat([])
    with pytest.raises(ValueError, match="batch 1 has"):
        Batch.concat([make([1]), make([2]).exclude("s")])
    # same names, but "s" is a tensor in one batch and strings in the other
    other = Batch.from_dict({"i": torch.tensor([2]), "x": torch.zeros(1, 3), "h": torch.zeros(1),
                             "s": torch.tensor([0])})
    with pytest.raises(ValueError, match="non-tensor columns"):
        Batch.concat([make([1]), other])


@FAST
@given(rows, st.integers(min_value=1, max_value=12))
def test_chunk_is_balanced_larger_first(n, parts):
    b = make(list(range(n)))
    pieces = b.chunk(parts)
    sizes = [len(p) for p in pieces]
    assert len(pieces) == parts and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert sizes == balanced_sizes(n, parts)
    assert all(aligned(p) and p.meta == META for p in pieces)
    assert Batch.concat(pieces) == b


def test_chunk_examples():
    assert [len(p) for p in make(list(range(10))).chunk(4)] == [3, 3, 2, 2]
    assert [len(p) for p in make(list(range(2))).chunk(4)] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="0 parts"):
        make([1]).chunk(0)


# -- pad / unpad --------------------------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 30), st.integers(1, 9))
def test_pad_to_multiple_then_unpad(n, m):
    b = make(list(range(n)))
    p = b.pad_to_multiple(m)
    pad = (-n) % m
    assert len(p) % m == 0 and p.pad_count == pad
    assert ids(p) == list(range(n)) + [k % n for k in range(pad)]  # padding repeats the first rows
    assert aligned(p) and p.meta == META
    u = p.unpad()
    assert u == b and u.pad_count == 0


def test_pad_count_survives_column_ops_and_accumulates():
    p = make(list(range(5))).pad_to_multiple(4)
    assert p.pad_count == 3
    assert p.select("i").pad_count == 3
    assert p.exclude("s").pad_count == 3
    assert p.clone().pad_count == 3
    assert (p | Batch.from_dict({"y": torch.zeros(8)})).pad_count == 3
    pp = p.pad_to_multiple(5)
    assert len(pp) == 10 and pp.pad_count == 5
    assert pp.unpad() == make(list(range(5)))
    assert make([1, 2]).pad_to_multiple(2) is not None and make([1, 2]).pad_to_multiple(2).pad_count == 0


def test_pad_errors():
    with pytest.raises(ValueError, match="empty batch"):
        make([]).pad_to_multiple(4)
    with pytest.raises(ValueError, match="multiple >= 1"):
        make([1]).pad_to_multiple(0)


# -- repeat -------------------------------------------------------------------------------------------------------
@FAST
@given(st.lists(st.integers(0, 1000), max_size=12), st.integers(1, 4))
def test_repeat_row_order(row_ids, k):
    b = make(row_ids)
    inter = b.repeat(k, interleave=True)
    tiled = b.repeat(k, interleave=False)
    assert ids(inter) == [r for r in row_ids for _ in range(k)]  # a a b b
    assert ids(tiled) == row_ids * k  # a b a b
    assert aligned(inter) and aligned(tiled)
    assert inter.meta == tiled.meta == META


def test_repeat_rejects_n_below_one():
    with pytest.raises(ValueError, match="n >= 1"):
        make([1]).repeat(0)


# -- rows ---------------------------------------------------------------------------------------------------------
def test_row_indexing():
    b = make([10, 11, 12, 13])
    assert ids(b[1:3]) == [11, 12]
    assert ids(b[::2]) == [10, 12]
    assert ids(b[[3, 0]]) == [13, 10] and aligned(b[[3, 0]])
    assert ids(b[np.array([2])]) == [12]
    assert ids(b[torch.tensor([True, False, False, True])]) == [10, 13]  # a mask selects rows
    assert ids(b[[]]) == []
    with pytest.raises(IndexError, match="mask"):
        b[torch.tensor([True, False])]
    with pytest.raises(TypeError, match=r"b\[i:i\+1\]"):
        b[0]
    assert [ids(p) for p in b.iter_slices(3)] == [[10, 11, 12], [13]]


# -- select / exclude / union -------------------------------------------------------------------------------------
def test_select_and_exclude():
    b = make([1, 2, 3])
    s = b.select("s", "i")
    assert set(s.keys()) == {"s", "i"} and list(s["s"]) == ["r1", "r2", "r3"] and s.meta == META
    e = b.exclude("x", "h")
    assert set(e.keys()) == {"i", "s"} and e == s
    with pytest.raises(KeyError, match=r"no column\(s\) \['nope'\]"):
        b.select("i", "nope")
    assert len(b.select()) == 3  # no columns, rows kept


def test_union_right_wins_on_name_clash():
    left = Batch.from_dict({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4]), "t": ["p", "q"]}, meta={"m": 1, "k": 0})
    right = Batch.from_dict({"b": torch.tensor([30, 40]), "c": ["u", "v"], "a": ["A", "B"], "t": torch.tensor([7, 8])},
                            meta={"m": 2})
    u = left | right
    assert u == left.union(right)
    assert set(u.keys()) == {"a", "b", "c", "t"}
    assert u["b"].tolist() == [30, 40]
    assert list(u["a"]) == ["A", "B"]  # tensor on the left, strings on the right: right wins, kind changes
    assert u["t"].tolist() == [7, 8]  # and the other way round
    assert "a" not in u.tensors.keys() and "t" not in u.non_tensors
    assert u.meta == {"m": 2, "k": 0}
    assert left["a"].tolist() == [1, 2]  # operands untouched


def test_union_row_count_mismatch_and_non_batch():
    with pytest.raises(ValueError, match=r"3 rows \| 2 rows"):
        make([1, 2, 3]) | make([1, 2])
    with pytest.raises(TypeError):
        make([1]) | {"y": torch.zeros(1)}


@FAST
@given(st.lists(st.integers(0, 99), min_size=1, max_size=15), st.integers(1, 5))
def test_non_tensor_columns_stay_aligned_through_every_op(row_ids, m):
    b = make(row_ids)
    extra = Batch.from_dict({"y": torch.tensor(row_ids) * 2, "name": [f"n{k}" for k in row_ids]})
    ops = [
        b.chunk(m)[0], b.split([len(row_ids), 0])[0], b.pad_to_multiple(m), b.pad_to_multiple(m).unpad(),
        b.repeat(m), b.repeat(m, interleave=False), b.select("i", "x", "h", "s"), b.exclude("h").union(b.select("h")),
        b | extra, Batch.concat(b.chunk(m)), b[list(reversed(range(len(row_ids))))], b.clone(),
        pickle.loads(pickle.dumps(b, protocol=5)),
    ]
    for out in ops:
        assert aligned(out)
    u = b | extra
    assert list(u["name"]) == [f"n{k}" for k in ids(u)] and u["y"].tolist() == [2 * k for k in ids(u)]


def test_meta_travels_to_every_shard():
    b = make(list(range(9)))
    shards = [*b.chunk(4), *b.split([9]), b.slice(2, 4), *b.iter_slices(4), b.repeat(2), b.pad_to_multiple(4),
              b.select("i"), b.exclude("i"), b.clone(), b[[0]]]
    assert all(s.meta == META for s in shards)
    shards[0].meta["step"] = 99  # each shard has its own meta dict
    assert b.meta["step"] == 7


# -- construction -------------------------------------------------------------------------------------------------
def test_from_dict_mismatched_rows_names_every_column():
    with pytest.raises(ValueError, match=r"different row counts: \{'x': 3, 's': 2\}"):
        Batch.from_dict({"x": torch.zeros(3), "s": ["a", "b"]})


@pytest.mark.parametrize("value, exc, hint", [
    (3, TypeError, "meta="),
    (2.5, TypeError, "meta="),
    ("abc", TypeError, "meta="),
    (torch.tensor(3), ValueError, "0-d tensor"),
    (np.array(3), ValueError, "0-d array"),
])
def test_from_dict_rejects_scalar_columns(value, exc, hint):
    with pytest.raises(exc, match=hint) as e:
        Batch.from_dict({"n": torch.zeros(2), "bad": value})
    assert "'bad'" in str(e.value)


def test_setitem_checks_rows_and_kind():
    b = make([1, 2, 3])
    b["y"] = torch.ones(3)
    b["names"] = ["a", "b", "c"]
    assert set(b.keys()) >= {"y", "names"}
    b["y"] = ["p", "q", "r"]  # a column may change kind
    assert "y" in b.non_tensors and "y" not in b.tensors.keys()
    with pytest.raises(ValueError, match="needs 3 rows"):
        b["z"] = torch.ones(2)
    with pytest.raises(ValueError, match="needs 3 rows"):
        b["z"] = ["a"]
    with pytest.raises(TypeError, match="one entry per row"):
        b["z"] = "abc"  # not split into characters
    with pytest.raises(KeyError, match="no column 'nope'"):
        b["nope"]
    del b["y"]
    assert "y" not in b


def test_constructor_validates_non_tensor_rows():
    with pytest.raises(ValueError, match="has 2 rows but the batch has 3"):
        Batch({"x": torch.zeros(3)}, {"s": ["a", "b"]})
    with pytest.raises(ValueError, match="both a tensor and a non-tensor"):
        Batch({"x": torch.zeros(2)}, {"x": ["a", "b"]})
    assert len(Batch(None, {"s": ["a", "b"]})) == 2
    assert len(Batch.from_dict({})) == 0


# -- equality -----------------------------------------------------------------------------------------------------
def test_eq():
    b = make([1, 2, 3])
    assert b == make([1, 2, 3])
    assert b != make([1, 2, 4])
    assert b != make([1, 2])
    assert b != make([1, 2, 3], meta={"step": 8})
    assert b != b.exclude("s")
    assert b != 3 and b != "b"
    ints = Batch.from_dict({"x": torch.tensor([1, 2])})
    assert ints != Batch.from_dict({"x": torch.tensor([1.0, 2.0])})  # same values, other dtype
    assert ints != Batch.from_dict({"x": [1, 2]})  # same name, other kind: False, not an error
    with pytest.raises(TypeError):
        hash(b)


# -- wire format --------------------------------------------------------------------------------------------------
def _dumps5(b: Batch) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    return data, buffers


def _address(buf: pickle.PickleBuffer) -> int:
    return np.frombuffer(buf.raw(), dtype=np.uint8).ctypes.data


def test_pickle5_sends_tensor_payload_out_of_band_without_copy():
    x = torch.randn(4096, 64)  # 1 MiB
    h = torch.randn(4096, 16).to(torch.bfloat16)  # numpy has no bf16: travels as an int16 view
    b = Batch.from_dict({"x": x, "h": h, "s": [f"r{k}" for k in range(4096)]}, meta={"step": 1})
    data, buffers = _dumps5(b)
    sizes = sorted(memoryview(buf).nbytes for buf in buffers)
    assert sizes == sorted([x.numel() * 4, h.numel() * 2])
    assert len(data) < 64 << 10  # only strings, meta and headers in band (1.1 MiB of tensors is not)
    assert {_address(buf) for buf in buffers} == {x.data_ptr(), h.data_ptr()}  # views of the tensors: no copy
    out = pickle.loads(data, buffers=buffers)
    assert out == b
    assert out["h"].dtype == torch.bfloat16 and torch.equal(out["h"], h)
    assert out["x"].data_ptr() == x.data_ptr()  # in-process round trip maps the same memory


def test_pickle5_of_a_slice_carries_only_its_rows():
    b = Batch.from_dict({"x": torch.randn(1000, 32)})
    part = b.slice(100, 300)
    data, buffers = _dumps5(part)
    assert [memoryview(buf).nbytes for buf in buffers] == [200 * 32 * 4]
    assert pickle.loads(data, buffers=buffers) == part


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64,
                                   torch.bool, torch.float8_e4m3fn])
def test_pickle_round_trip_dtypes(dtype):
    x = (torch.randn(20, 3) * 3).to(dtype)
    b = Batch.from_dict({"x": x, "s": [str(k) for k in range(20)]}, meta={"m": [1, 2]}).pad_to_multiple(8)
    for protocol in (4, 5):
        out = pickle.loads(pickle.dumps(b, protocol=protocol))
        assert out["x"].dtype == dtype
        assert torch.equal(out["x"].view(torch.uint8), b["x"].view(torch.uint8))  # bitwise (float8 has no ==)
        assert list(out["s"]) == list(b["s"]) and out.meta == b.meta and out.pad_count == b.pad_count == 4


def test_pickle_round_trip_non_contiguous_and_empty():
    t = torch.randn(8, 6).t()  # non-contiguous
    b = Batch.from_dict({"t": t, "e": torch.zeros(6, 0)})
    out = pickle.loads(pickle.dumps(b, protocol=5))
    assert out == b and out["e"].shape == (6, 0)
    empty = make([])
    assert pickle.loads(pickle.dumps(empty, protocol=5)) == empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int64, torch.bool])
def test_concat_of_large_columns_matches_torch_cat(dtype):
    # above 1 MiB a column is copied through a numpy buffer (huge pages); the result must be what torch.cat gives
    x = (torch.randn(3000, 128) * 4).to(dtype)
    pieces = [x[:1000], x[1000:1000], x[1000:2999], x[2999:]]
    b = Batch.concat([Batch.from_dict({"x": p, "t": p.t().contiguous().t()}) for p in pieces])  # 2nd non-contiguous
    for k in ("x", "t"):
        assert b[k].dtype == dtype and b[k].shape == x.shape and b[k].is_contiguous()
        assert torch.equal(b[k].view(torch.uint8), torch.cat(pieces).view(torch.uint8))
    before = x.clone()
    b["x"][0] = b["x"][1]  # a private, writable copy: the inputs do not change
    assert torch.equal(x.view(torch.uint8), before.view(torch.uint8))


def _dict_rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n), "info": [{"row": i, "seen": []} for i in range(n)]})


@pytest.mark.parametrize("op", ["repeat", "tile", "pad", "index", "clone_of_repeat", "concat_of_repeat",
                                "wire_of_repeat"])
def test_rows_made_by_repeating_a_row_each_hold_their_own_objects(op):
    """A row repeated by repeat(), pad_to_multiple() or a list of positions shared one dict with the row it copied
    (and with the source batch), and clone() kept that sharing: a write to one row's dict showed in the others.
    Tensor columns are copies there, so object columns must be too."""
    src = _dict_rows(3)
    made = {"repeat": lambda: src.repeat(2), "tile": lambda: src.repeat(2, interleave=False),
            "pad": lambda: src.pad_to_multiple(4), "index": lambda: src[[0, 0, 1]],
            "clone_of_repeat": lambda: src.repeat(2).clone(),
            "concat_of_repeat": lambda: Batch.concat([src.repeat(2), src[0:1]]),
            "wire_of_repeat": lambda: pickle.loads(pickle.dumps(src.repeat(2)))}[op]()
    first = made["info"][0]
    first["seen"].append("written")
    others = [d for d in made["info"][1:]] + list(src["info"])
    assert all(d["seen"] == [] for d in others), [d["seen"] for d in others]
    assert [d["row"] for d in made["info"]][:2] in ([0, 0], [0, 1])


# -- concat keeps every column as it is, or says why it cannot ---------------------------------------------------------
def test_concat_skips_pieces_without_rows_so_their_dtype_changes_nothing():
    """A rank with an empty shard returning torch.tensor([]) (float32) turned the other ranks' int64 ids into float32
    on await, rounding 2**24 + 1; a reader of the same call (which skips 0-row parts) got int64."""
    big = 2 ** 24 + 1
    parts = [Batch.from_dict({"id": torch.tensor([big])}), Batch.from_dict({"id": torch.tensor([])}),
             Batch.from_dict({"id": torch.tensor([big + 2])})]
    out = Batch.concat(parts)
    assert out["id"].dtype == torch.int64 and out["id"].tolist() == [big, big + 2]
    empty = Batch.concat([Batch.from_dict({"id": torch.tensor([])}), Batch.from_dict({"id": torch.tensor([])})])
    assert len(empty) == 0


@pytest.mark.parametrize("other, kind", [(torch.tensor([2, 3]), "int64"), (torch.tensor([[1], [0]]), r"\(1,\)")])
def test_concat_refuses_a_column_whose_dtype_or_row_shape_differs(other, kind):
    """bool + int64 came back int64 without a word (torch.cat promotes)."""
    a = Batch.from_dict({"m": torch.tensor([True, False])})
    with pytest.raises(ValueError, match=rf"Batch.concat: column 'm' of batch 1 is .*{kind}.*, batch 0's is "
                                         r".*bool.*"):
        Batch.concat([a, Batch.from_dict({"m": other})])


def test_concat_refuses_numeric_non_tensor_columns_of_different_dtypes():
    a = Batch.from_dict({"s": np.array([1, 2], dtype=np.int64)})
    b = Batch.from_dict({"s": np.array([0.5], dtype=np.float32)})
    with pytest.raises(ValueError, match=r"Batch.concat: column 's' of batch 1 is float32.*batch 0's is int64"):
        Batch.concat([a, b])
    objs = Batch.concat([Batch.from_dict({"s": ["a"]}), Batch.from_dict({"s": np.array(["b"], dtype=object)})])
    assert list(objs["s"]) == ["a", "b"]


@pytest.mark.parametrize("order", [0, 1])
def test_concat_refuses_batches_whose_nested_columns_differ(order):
    """Only the top-level names were compared: a nested leaf only a later batch had was dropped without a word (or,
    the other way round, an AttributeError on None)."""
    from tensordict import TensorDict

    one = Batch(TensorDict({"a": TensorDict({"b": torch.zeros(2)}, batch_size=[2])}, batch_size=[2]))
    two = Batch(TensorDict({"a": TensorDict({"b": torch.zeros(1), "c": torch.ones(1)}, batch_size=[1])},
                           batch_size=[1]))
    pieces = [one, two] if order == 0 else [two, one]
    with pytest.raises(ValueError, match=r"Batch.concat: batch 1 has .*column.*, batch 0 has"):
        Batch.concat(pieces)


# -- the pad count travels with the rows it counts -----------------------------------------------------------------------
def test_the_pad_count_survives_split_and_concat():
    """split/chunk/slice gave every piece pad 0 and concat kept none, so the filler rows of pad_to_multiple became
    real rows after a round trip (an `await` of a shard call of a padded batch unpadded to 8 rows, not 5)."""
    b = Batch.from_dict({"x": torch.arange(5), "s": list("abcde")}).pad_to_multiple(4)  # 8 rows, 3 of them padding
    pieces = b.chunk(4)
    assert [p.pad_count for p in pieces] == [0, 0, 1, 2]
    assert b.slice(0, 5).pad_count == 0 and b.slice(4, 7).pad_count == 2
    back = Batch.concat(pieces)
    assert back.pad_count == 3 and back.unpad()["x"].tolist() == [0, 1, 2, 3, 4]
    assert pickle.loads(pickle.dumps(pieces[3])).pad_count == 2


def test_concat_refuses_padding_rows_followed_by_real_rows():
    a = Batch.from_dict({"x": torch.arange(3)}).pad_to_multiple(2)
    with pytest.raises(ValueError, match=r"Batch.concat: batch 0 ends in 1 padding row.* batch 1 .* unpad\(\)"):
        Batch.concat([a, Batch.from_dict({"x": torch.arange(2)})])


def test_rows_picked_by_position_keep_the_padding_last_or_are_refused():
    b = Batch.from_dict({"x": torch.arange(3)}).pad_to_multiple(4)  # rows 0 1 2 | 0 (padding)
    two = b.repeat(2)  # interleaved: the padding row's repeats come last
    assert two.pad_count == 2 and two.unpad()["x"].tolist() == [0, 0, 1, 1, 2, 2]
    assert b[torch.tensor([True, False, True, True])].pad_count == 1
    with pytest.raises(ValueError, match=r"row 3 is padding \(pad_to_multiple\), and rows after it in the selection "
                                         r"are not: unpad\(\) first"):
        b.repeat(2, interleave=False)


def test_setting_a_column_takes_what_from_dict_takes():
    """b[key] = {...} stored the dict's keys as the rows (from_dict refuses a dict)."""
    b = Batch.from_dict({"x": torch.arange(3)})
    for bad in ({"cat": 0.9, "dog": 0.1, "eel": 0.0}, {1, 2, 3}, range(3)):
        with pytest.raises(TypeError, match=r"column 'label': expected a tensor, list or numpy array"):
            b["label"] = bad
    b["label"] = ("a", "b", "c")
    assert list(b["label"]) == ["a", "b", "c"]


def test_rows_are_picked_by_a_flat_list_of_positions():
    b = Batch.from_dict({"x": torch.arange(3), "s": list("abc")})
    with pytest.raises(IndexError, match=r"row positions must be one-dimensional, got shape \(2, 2\)"):
        b[[[0, 1], [1, 2]]]
    with pytest.raises(TypeError, match=r"b\[1\]: index rows with a slice"):
        b[torch.tensor(1)]


def test_equality_compares_non_tensor_dtypes_the_pad_count_and_a_meta_holding_tensors():
    assert Batch.from_dict({"s": [1, 2]}) != Batch.from_dict({"s": np.array([1.0, 2.0])})
    p = Batch.from_dict({"x": torch.arange(3)}).pad_to_multiple(4)
    assert p != Batch.from_dict({"x": torch.tensor([0, 1, 2, 0])})
    m = {"w": torch.ones(2)}
    assert Batch.from_dict({"x": torch.arange(2)}, meta=m) == Batch.from_dict({"x": torch.arange(2)}, meta=dict(m))
    assert Batch.from_dict({"x": torch.arange(2)}, meta=m) != Batch.from_dict({"x": torch.arange(2)},
                                                                             meta={"w": torch.zeros(2)})


def test_concat_takes_a_wider_dtype_of_the_same_kind():
    """Refusing every dtype difference refused numpy strings of other widths (each rank's np.array(texts) has its
    own) and int32 next to int64; those widen without losing a value. Another kind stays refused."""
    out = Batch.concat([Batch.from_dict({"s": np.array(["r"]), "i": np.array([1], dtype=np.int32),
                                         "t": torch.tensor([1], dtype=torch.int32)}),
                        Batch.from_dict({"s": np.array(["rr"]), "i": np.array([2], dtype=np.int64),
                                         "t": torch.tensor([2], dtype=torch.int64)})])
    assert list(out["s"]) == ["r", "rr"] and out["i"].dtype == np.int64 and out["t"].dtype == torch.int64
    with pytest.raises(ValueError, match=r"column 'i' of batch 1 is float64, batch 0's is int32"):
        Batch.concat([Batch.from_dict({"i": np.array([1], dtype=np.int32)}), Batch.from_dict({"i": np.array([.5])})])


def test_rows_picked_by_position_share_an_object_that_cannot_be_copied():
    import threading

    lock = threading.Lock()
    b = Batch.from_dict({"x": torch.arange(2), "h": [lock, {"a": 1}]})
    two = b.repeat(2)
    assert two["h"][0] is lock and two["h"][2] == {"a": 1} and two["h"][2] is not b["h"][1]


def test_a_batch_whose_meta_or_column_holds_a_nan_equals_itself():
    b = Batch.from_dict({"x": torch.tensor([1.0, float("nan")]), "s": np.array([float("nan"), 1.0])},
                        meta={"kl": float("nan"), "w": torch.tensor([float("nan")])})
    assert b == b and b == b.clone()
    assert b != Batch.from_dict({"x": torch.tensor([1.0, 2.0]), "s": np.array([float("nan"), 1.0])}, meta=b.meta)


@pytest.mark.parametrize("kind", ["flat", "nested", "named", "locked", "jagged"])
def test_a_split_piece_is_the_tensordict_split_would_make(kind):
    """Batch.split cuts a plain TensorDict of flat columns column by column (its pieces made without the
    constructor's checks); every other TensorDict (nested, named, locked, a jagged column) takes TensorDict.split.
    Either way each piece holds the same rows, keys, batch size and names as TensorDict.split's piece."""
    from tensordict import TensorDict

    n, sizes = 6, [1, 3, 0, 2]
    cols = {"x": torch.arange(n), "y": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)}
    if kind == "nested":
        td = TensorDict({**cols, "n": {"z": torch.arange(n)}}, batch_size=[n])
    elif kind == "named":
        td = TensorDict(cols, batch_size=[n], names=["rows"])
    elif kind == "jagged":
        td = TensorDict({"x": torch.nested.nested_tensor([torch.arange(k % 3 + 1) for k in range(n)],
                                                         layout=torch.jagged)}, batch_size=[n])
    else:
        td = TensorDict(cols, batch_size=[n])
    if kind == "locked":
        td = td.lock_()
    b = Batch(td, {"s": list("abcdef")})
    want = b._td.split(sizes, dim=0)  # TensorDict's own split: what Batch.split took before
    got = b.split(sizes)
    for g, w, s in zip(got, want, sizes):
        assert g._td.batch_size == w.batch_size == torch.Size([s])
        assert g._td.names == w.names and g._td.device == w.device
        assert sorted(g._td.keys(True, True), key=str) == sorted(w.keys(True, True), key=str)
        for k in w.keys(True, True):
            a, c = g._td.get(k), w.get(k)
            if a.is_nested:
                assert [t.tolist() for t in a.unbind()] == [t.tolist() for t in c.unbind()]
            else:
                assert torch.equal(a, c) and (not s or a.data_ptr() == c.data_ptr())  # views, as before
    if kind != "jagged":  # (concat refuses jagged pieces whose ragged sizes differ: unchanged)
        assert Batch.concat(got) == b


def test_a_batch_rebuilt_from_the_wire_is_the_batch_sent():
    """Flat columns are rebuilt without TensorDict's constructor checks; a nested one takes the constructor."""
    from tensordict import TensorDict

    flat = Batch.from_dict({"x": torch.arange(4), "f": torch.ones(4, 2, dtype=torch.bfloat16), "s": list("abcd")},
                           meta={"m": 1})
    nested = Batch(TensorDict({"a": {"b": torch.arange(3)}, "c": torch.zeros(3, 2)}, batch_size=[3]))
    for b in (flat, nested, flat.slice(0, 0)):
        back = pickle.loads(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == b and back.meta == b.meta and back._td.batch_size == b._td.batch_size
        assert sorted(back._td.keys(True, True), key=str) == sorted(b._td.keys(True, True), key=str)


def test_a_batch_off_the_wire_builds_its_tensordict_only_when_asked_and_reads_the_same_before_and_after():
    """A batch of flat columns unpickled keeps them as a dict: its columns, length, bytes, names and membership are
    read from it (no TensorDict built: an endpoint that reads a column pays for none); the first use that needs the
    TensorDict builds it from the same tensors, and every read after is what it was before. Large columns (out of
    band) and a batch with non-tensor columns alike; a nested one is a TensorDict from the start."""
    from tensordict import TensorDict

    big = Batch.from_dict({"x": torch.arange(4), "w": torch.ones(4, 5000), "s": list("abcd")}, meta={"m": 1})
    for sent in (Batch.from_dict({"x": torch.arange(4)}), big, Batch.from_dict({"x": torch.arange(0)})):
        b = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
        x = b["x"]
        facts = (len(b), b.nbytes, b.keys(), "x" in b, "nope" in b, "s" in b)
        with pytest.raises(KeyError, match=r"no column 'nope'; the batch has"):
            b["nope"]
        assert type(b._t) is tuple  # nothing above built the TensorDict
        assert facts == (len(sent), sent.nbytes, sent.keys(), True, False, "s" in sent)
        td = b.tensors
        assert type(td) is TensorDict and td.batch_size == torch.Size([len(sent)]) and b._t is td
        assert b["x"] is x and td["x"] is x  # the same tensor objects, not copies
        assert (len(b), b.nbytes, b.keys(), "x" in b, "nope" in b, "s" in b) == facts
        assert b == sent and b.meta == sent.meta
    b = pickle.loads(pickle.dumps(Batch.from_dict({"x": torch.arange(4)}), protocol=pickle.HIGHEST_PROTOCOL))
    b["y"] = torch.zeros(4)  # a write builds it first, and lands in it
    assert type(b._t) is TensorDict and b.keys() == ["x", "y"] and b.tensors["y"].shape == (4,)
    b = pickle.loads(pickle.dumps(Batch.from_dict({"x": torch.arange(4)}), protocol=pickle.HIGHEST_PROTOCOL))
    again = pickle.loads(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL))  # sent on as it came
    assert again == b and b.split([1, 3])[1]["x"].tolist() == [1, 2, 3]
    nested = Batch(TensorDict({"a": {"b": torch.arange(3)}}, batch_size=[3]))
    assert type(pickle.loads(pickle.dumps(nested, protocol=pickle.HIGHEST_PROTOCOL))._t) is TensorDict


def test_a_batch_off_the_wire_answers_membership_as_its_tensordict_does():
    """Review of the dict form: ``key in b`` answered from the dict said False for ``("x",)`` (a TensorDict takes a
    1-tuple as its one name; ``requires=[("x",)]`` passed at the controller and was refused on the rank) and False for
    a key that is not a name at all (TensorDict raises TypeError): a key that is not a string asks the TensorDict."""
    sent = Batch.from_dict({"x": torch.arange(4), "s": list("abcd")})
    for b in (sent, pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))):
        assert "x" in b and "s" in b and ("x",) in b and ("nope",) not in b and "nope" not in b
        with pytest.raises(TypeError):
            1 in b
        assert b.select(("x",)).keys() == ["x"]


def test_a_batch_off_the_wire_builds_one_tensordict_whichever_threads_ask():
    """Review of the dict form: two threads asking a batch off the wire for its TensorDict at once could each build
    one, and a write through the one the batch did not keep was lost: the build runs under a lock, checked again
    inside it. Then many threads at once, a few thousand times, all get the batch's one TensorDict."""
    import sys
    import threading

    from orchestra import _batch

    seen = []
    built = _batch._built

    def watched(n, columns):
        seen.append(_batch._BUILD_LOCK.locked())
        return built(n, columns)

    src = pickle.dumps(Batch.from_dict({f"c{i}": torch.arange(4) for i in range(20)}), protocol=5)
    b = pickle.loads(src)
    _batch._built, saved = watched, _batch._built
    try:
        assert b.tensors is b.tensors and seen == [True]  # built once, under the lock
    finally:
        _batch._built = saved
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(300):
            b = pickle.loads(src)
            got = [None] * 4
            start = threading.Barrier(4)

            def read(i: int) -> None:
                start.wait()
                got[i] = b.tensors
                got[i][f"new{i}"] = torch.zeros(4)

            threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(g is b.tensors for g in got) and {f"new{i}" for i in range(4)} <= set(b.keys())
    finally:
        sys.setswitchinterval(interval)


def test_rebuilding_a_read_only_column_warns_nowhere_and_leaves_the_users_warning_alone():
    """torch warns once per process when a tensor is made from a read-only array (a frame's large columns are
    such views): orchestra's first such conversion spends that warning, silenced, and later ones convert without a
    warnings filter of their own. A fresh interpreter with warnings as errors reads frames without one (with
    torch's warn-always on, too); and importing orchestra spends nothing: a process whose frames never held such a
    column still gets the warning for its own conversion (a first version spent it at import)."""
    import subprocess
    import sys

    code = ("import numpy as np, torch, warnings\n"
            "from orchestra import Batch, _frame\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    torch.from_numpy(np.frombuffer(b'12345678', dtype=np.uint8))\n"
            "assert any('not writable' in str(w.message) for w in seen), seen\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

    code = ("import torch, warnings\n"
            "from orchestra import Batch, _frame\n"
            "f = _frame.dumps_frame(Batch.from_dict({'x': torch.arange(10_000)}), limit=None)\n"
            "with warnings.catch_warnings():\n"
            "    warnings.simplefilter('error')\n"
            "    for always in (False, True, False):\n"
            "        torch.set_warn_always(always)\n"
            "        _frame.loads_frame(f)\n"
            "        _frame.loads_frame(f)\n"
            "print('clean')\n")
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.bool, torch.complex64, torch.uint8, torch.int16])
def test_a_small_column_travels_inside_the_pickle_and_each_read_owns_its_copy(dtype):
    """A tensor column of at most SMALL_COLUMN_BYTES rides in the pickle as bytes (a frame without out-of-band
    buffers); it comes back bit for bit, of its dtype and shape, and each unpickling owns its memory: a reader that
    writes into its copy changes no other reader's. A larger column still travels out of band (zero-copy)."""
    from orchestra import _frame
    from orchestra._batch import SMALL_COLUMN_BYTES

    if dtype is torch.bool:
        t = torch.arange(12).reshape(4, 3) % 2 == 0
    elif dtype is torch.complex64:
        t = torch.randn(4, 3, dtype=dtype)
    else:
        t = torch.arange(12, dtype=torch.float32).reshape(4, 3).to(dtype)
    b = Batch.from_dict({"t": t, "empty": torch.zeros(4, 0), "s": list("abcd")})
    frame = _frame.dumps_frame(b)
    assert frame[:1] == b"\x00"  # a plain pickle: nothing out of band
    one, two = _frame.loads_frame(frame), _frame.loads_frame(frame)
    assert one["t"].dtype == dtype and one["t"].shape == (4, 3) and one["empty"].shape == (4, 0)
    assert torch.equal(one["t"].view(torch.uint8), t.view(torch.uint8))
    one["t"].view(torch.uint8).fill_(7)  # writable, and its own
    assert torch.equal(two["t"].view(torch.uint8), t.view(torch.uint8))

    big = Batch.from_dict({"x": torch.arange(SMALL_COLUMN_BYTES // 8 + 1)})
    frame = _frame.dumps_frame(big)
    assert frame[:1] == b"\x01"  # its column out of band
    back = _frame.loads_frame(frame)
    assert torch.equal(back["x"], big["x"])


# -- what the wire carries ----------------------------------------------------------------------------------------
_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - _QUANTIZED, key=str)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s raw bits, comparable whatever its dtype, strides or NaNs."""
    if x.dtype.itemsize == 16:
        x = torch.view_as_real(x)
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize]).contiguous()


@pytest.mark.parametrize("rows", [4, 8192], ids=["in-band", "out-of-band"])  # 8192 x 3 x 1 byte > 16 KiB
def test_a_column_of_every_dtype_travels_bit_exact(rows):
    """numpy lacks many torch dtypes (every float8 but two, float4, complex32, the sub-byte and bits ones): such a
    column travels as the integer of its element size and is viewed back (18 dtypes failed to pickle before)."""
    for dtype in _DTYPES:
        raw = torch.randint(0, 256, (rows * 3 * dtype.itemsize,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))
        if dtype == torch.bool:  # (only 0 and 1 are bools: a copy normalizes any other byte to 1)
            raw = raw % 2
        t = raw.view(dtype).view(rows, 3)
        back = pickle.loads(pickle.dumps(Batch.from_dict({"x": t, "i": torch.arange(rows)})))["x"]
        assert back.dtype == dtype and back.shape == (rows, 3), dtype
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8)), dtype
        across = t.transpose(0, 1)  # not contiguous: torch cannot copy the sub-byte dtypes, the integer view can
        back = pickle.loads(pickle.dumps(Batch.from_dict({"x": across})))["x"]
        assert back.dtype == dtype and torch.equal(_bits(back), _bits(across)), dtype
    bits = Batch.from_dict({"x": torch.zeros(3, dtype=torch.uint8).view(torch.bits8)})
    assert Batch.concat([bits, bits])["x"].dtype == torch.bits8  # (its schema had raised 'Bits types are undefined')
    e4, e5 = (Batch.from_dict({"x": torch.zeros(2).to(d)}) for d in (torch.float8_e4m3fn, torch.float8_e5m2))
    with pytest.raises(ValueError, match="column 'x'"):  # torch promotes no float8 to another: refused, named
        Batch.concat([e4, e5])
    halves = [torch.arange(s, s + 300_000).to(torch.float8_e4m3fnuz) for s in (0, 300_000)]  # a large concat too
    joined = Batch.concat([Batch.from_dict({"x": h}) for h in halves])["x"]
    assert joined.dtype == torch.float8_e4m3fnuz and torch.equal(joined.view(torch.uint8),
                                                                 torch.cat([h.view(torch.uint8) for h in halves]))


class _Tagged(torch.Tensor):
    """A tensor subclass of the user's own, adding Python behaviour only: it travels as a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _Wrapped(torch.Tensor):
    """A subclass that redefines its contents (``__torch_dispatch__``, as DTensor does): it cannot travel."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, _Wrapped) else x
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


@pytest.mark.parametrize("column, says", [
    (lambda: torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged), "list of per-row"),
    (lambda: torch.eye(2).to_sparse(), "to_dense()"),
    (lambda: torch.eye(2).to_sparse_csr(), "to_dense()"),
    (lambda: torch.quantize_per_tensor(torch.rand(2, 3), 0.1, 0, torch.quint8), "dequantize()"),
    (lambda: torch.empty(2, 3, device="meta"), "meta device"),
    (lambda: _Wrapped(torch.zeros(2, 3)), "subclass (_Wrapped)"),
], ids=["jagged", "sparse-coo", "sparse-csr", "quantized", "meta", "dispatch-subclass"])
def test_a_column_the_wire_cannot_carry_is_named_with_what_to_pass_instead(column, says):
    """Before, each failed deep in the pickle with torch's own words ('.numpy() is not supported for tensor
    subclasses', 'unsupported memory format option Contiguous', 'Cannot copy out of meta tensor'), naming no column."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (prototype and deprecation notices of the tensors' constructors)
        b = Batch.from_dict({"ok": torch.arange(2), "x": column()})
    b._schema()  # a rank's result header is made before its pickle: it must not fail first, with torch's words
    with pytest.raises(TypeError, match="Batch column 'x'") as info:
        pickle.dumps(b)
    assert says in str(info.value)
    p = torch.nn.Parameter(torch.rand(2, 3))  # a Parameter is a plain tensor on the wire
    assert torch.equal(pickle.loads(pickle.dumps(Batch.from_dict({"p": p})))["p"], p.detach())
    tagged = pickle.loads(pickle.dumps(Batch.from_dict({"t": torch.ones(2, 3).as_subclass(_Tagged)})))["t"]
    assert type(tagged) is torch.Tensor and torch.equal(tagged, torch.ones(2, 3))  # as before: a plain tensor


@pytest.mark.parametrize("kind", ["storage offset", "shares its storage", "a gradient"])
def test_a_small_column_read_from_its_memory_is_its_own_elements(kind):
    """A small contiguous CPU column travels as its memory read in one copy: from its own offset in a shared storage,
    whatever else the storage holds."""
    whole = torch.arange(64, dtype=torch.float32)
    col = {"storage offset": whole[8:24], "shares its storage": whole.view(16, 4)[5],
           "a gradient": (whole[:16] * 1.0).requires_grad_()}[kind]
    back = pickle.loads(pickle.dumps(Batch.from_dict({"x": col.reshape(-1, 1)})))["x"]
    assert torch.equal(back.view(-1), col.detach())
    back[0, 0] = -1.0  # its own memory
    assert col[0] != -1.0


def test_a_zero_tensor_column_is_refused_not_sent_as_whatever_memory_it_points_at():
    """A ZeroTensor (autograd's) has no memory (its data pointer is 0): it never travels as bytes read from there
    (reading address 0 gave the process's heap bytes); numpy() refuses it, as before."""
    zeros = torch._efficientzerotensor(6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="ZeroTensor"):
        pickle.dumps(Batch.from_dict({"x": zeros}))


def test_a_small_column_with_no_bytes_for_its_shape_is_refused_not_made_of_uninitialised_memory():
    from orchestra._batch import _small_from_wire

    with pytest.raises(ValueError, match="no bytes"):
        _small_from_wire(b"", "float32", (4,))
    assert _small_from_wire(b"", "float32", (0, 3)).shape == (0, 3)


def _short_storage(rows: int, how: str) -> torch.Tensor:
    """A column whose elements no longer lie in its storage: freed (FSDP's ``untyped_storage().resize_(0)`` after a
    parameter is used), shrunk under a view, or a strided (not contiguous) view of a freed storage."""
    whole = torch.arange(float(2 * rows + 8))
    col = whole[4:4 + 2 * rows:2] if how == "strided, freed" else whole[4:4 + rows]
    whole.untyped_storage().resize_(8 * whole.element_size() if how == "shrunk" else 0)
    return col


@pytest.mark.parametrize("rows", [8, 100_000], ids=["small", "large"])
@pytest.mark.parametrize("how", ["freed", "shrunk", "strided, freed"])
def test_a_column_whose_storage_does_not_hold_it_is_refused_naming_it_not_sent_as_other_memory(rows, how):
    """Before, such a column travelled as whatever memory its pointer showed (the process's heap bytes), with no
    error: a rank trained on garbage and the controller's memory left the process."""
    from orchestra import _frame

    b = Batch.from_dict({"ok": torch.arange(rows), "x": _short_storage(rows, how)})
    for send in (pickle.dumps, _frame.dumps_frame):
        with pytest.raises(TypeError, match="Batch column 'x'") as info:
            send(b)
        assert "storage" in str(info.value) and "clone()" in str(info.value)
    with pytest.raises(TypeError, match="Batch column 'x'"):
        b._check_tensors()  # the preflight's check (the in-process backend's every call) names it too
    fine = Batch.from_dict({"x": torch.arange(float(rows + 8))[4:4 + rows]})  # a view inside its storage travels
    assert torch.equal(pickle.loads(pickle.dumps(fine))["x"], fine["x"])
    fine._check_tensors()


def test_to_its_own_device_gives_a_batch_of_its_own_not_the_same_columns():
    """``to()`` onto the device a batch is on shared its TensorDict with the original (TensorDict hands itself back):
    deleting or replacing a column of the result did it to the original too."""
    b = Batch.from_dict({"x": torch.arange(3), "s": ["a", "b", "c"]}).to("cpu")
    c = b.to("cpu")
    c["s"] = torch.zeros(3)
    del c["x"]
    assert b.keys() == ["x", "s"] and b["s"].tolist() == ["a", "b", "c"] and torch.equal(b["x"], torch.arange(3))
    assert c.keys() == ["s"]


@pytest.mark.parametrize("kind", ["datetime64", "timedelta64"])
def test_concat_refuses_time_columns_of_other_units_rather_than_overflow_them(kind):
    """numpy joins datetime64[D] and [ns] as [ns], and a value beyond ns's range wraps: year 2300 became 1715, a
    positive duration negative, without an error."""
    if kind == "datetime64":
        a = Batch.from_dict({"t": np.array(["2300-01-01"], dtype="datetime64[D]")})
        b = Batch.from_dict({"t": np.array(["2020-01-01"], dtype="datetime64[ns]")})
    else:
        a = Batch.from_dict({"t": np.array([200_000], dtype="timedelta64[D]")})
        b = Batch.from_dict({"t": np.array([1], dtype="timedelta64[ns]")})
    with pytest.raises(ValueError, match="column 't'.*unit"):
        Batch.concat([a, b])
    same = Batch.concat([a, a])["t"]  # one unit: joined as it is
    assert same.dtype == a["t"].dtype and (same == np.concatenate([a["t"], a["t"]])).all()


@pytest.mark.parametrize("given", [{"apple": 1, "pear": 2}, {"apple", "pear"}], ids=["dict", "set"])
def test_the_constructor_refuses_a_dict_or_set_as_a_column_as_assignment_does(given):
    """A dict's keys (or a set's members, in no fixed order) became the column's rows, silently; ``b[k] = ...``
    refused the same value."""
    with pytest.raises(TypeError, match="column 'gt'"):
        Batch({"x": torch.arange(2)}, non_tensors={"gt": given})
    with pytest.raises(TypeError, match="column 'gt'"):
        Batch.from_dict({"x": torch.arange(2), "gt": given})


@pytest.mark.parametrize("index", [np.array([2**64 - 1], dtype=np.uint64), torch.tensor([2**64 - 5], dtype=torch.uint64),
                                   np.array([2**63], dtype=np.uint64)], ids=["numpy", "torch", "2**63"])
def test_an_unsigned_row_position_past_the_rows_is_refused_not_wrapped_to_a_negative_one(index):
    """A uint64 position converted to int64 wrapped: 2**64 - 1 picked the last row, 2**64 - 5 the first."""
    b = Batch.from_dict({"x": torch.arange(5), "s": list("abcde")})
    with pytest.raises(IndexError):
        b[index]
    assert b[np.array([4], dtype=np.uint64)]["s"].tolist() == ["e"]


def test_iter_slices_refuses_a_row_count_below_one():
    """``iter_slices(-1)`` gave no slices (every row dropped) and ``iter_slices(0)`` range()'s own words."""
    b = Batch.from_dict({"x": torch.arange(5)})
    for rows in (0, -1):
        with pytest.raises(ValueError, match="iter_slices.*at least 1"):
            list(b.iter_slices(rows))


def test_a_batch_with_nat_equals_its_clone_and_its_round_trip():
    b = Batch.from_dict({"t": np.array(["2020-01-01", "NaT"], dtype="datetime64[ns]"),
                         "d": np.array([1, "NaT"], dtype="timedelta64[s]")})
    assert b == b.clone() and b == pickle.loads(pickle.dumps(b))
    assert b != Batch.from_dict({"t": np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[ns]"),
                                 "d": np.array([1, "NaT"], dtype="timedelta64[s]")})


def test_concat_of_columns_numpy_cannot_join_names_the_column():
    """numpy's own error (``DTypePromotionError: field names ...``) named no column."""
    a = Batch.from_dict({"st": np.array([(1, 2.0)], dtype=[("x", "i4"), ("y", "f8")])})
    b = Batch.from_dict({"st": np.array([(1,)], dtype=[("z", "i4")])})
    with pytest.raises(ValueError, match="column 'st'"):
        Batch.concat([a, b])


def test_clone_and_concat_keep_a_meta_value_that_cannot_be_copied_as_an_object_column_does():
    """A lock in meta made clone() and concat raise deepcopy's "cannot pickle '_thread.lock' object", naming nothing;
    the same lock in an object column is kept as it is. Now meta does the same, and copies the rest."""
    import threading

    lock, d = threading.Lock(), {"a": [1]}
    b = Batch.from_dict({"x": torch.arange(2)}, meta={"lock": lock, "d": d})
    for out in (b.clone(), Batch.concat([b, b])):
        assert out.meta["lock"] is lock
        assert out.meta["d"] == d and out.meta["d"] is not d and out.meta["d"]["a"] is not d["a"]


def test_exclude_refuses_a_name_the_batch_lacks_as_select_does():
    """``exclude("advantage")`` on a batch with ``advantages`` kept the column it meant to drop, silently."""
    b = Batch.from_dict({"advantages": torch.zeros(2), "x": torch.arange(2)})
    with pytest.raises(KeyError, match="exclude: no column.*advantage"):
        b.exclude("advantage")
    assert b.exclude("advantages").keys() == ["x"]


def test_a_column_read_by_name_is_what_the_tensordict_holds_for_it():
    """``b[key]`` read a TensorDict entry with ``td[key]`` for a moment (session 38), which unwraps a NonTensorData put
    into ``b.tensors`` past the construction check into its content; it gives what ``b.tensors.get(key)`` gives."""
    from tensordict import NonTensorData

    b = Batch.from_dict({"x": torch.arange(3.0)})
    b.tensors["note"] = "hello"  # stored as NonTensorData (the wire refuses it when sent; in-process it reads)
    assert isinstance(b["note"], NonTensorData)
    assert b["note"] is b.tensors.get("note")
    assert b["x"] is b.tensors.get("x")
    with pytest.raises(KeyError, match="no column 'nope'"):
        b["nope"]
