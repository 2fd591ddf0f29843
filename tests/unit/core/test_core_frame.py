"""The frame codec (``orchestra._frame``): one pickle per call and rank, with every ObjectRef lifted out for Ray to
carry, so that a call's arguments are serialized once — the bytes checked before any rank is sent anything are the
bytes the ranks unpickle. Ray-free: refs here are made from random ids and never resolved."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import ray
import torch

from orchestra import Batch
from orchestra import _frame


def ref() -> ray.ObjectRef:
    return ray.ObjectRef(os.urandom(28))


def test_refs_are_lifted_out_in_order_once_each_and_put_back_in_their_places():
    r1, r2 = ref(), ref()
    obj = ([r1, "a"], {"k": [r2, r1], "n": 3})
    blob, refs = _frame.dumps_call(obj)
    assert refs == [r1, r2]  # first-seen order, each distinct ref once
    assert r1.binary() not in blob and r2.binary() not in blob  # the frame itself holds no ref
    args, kwargs = _frame.loads_call(blob, ["R1", "R2"])
    assert args == ["R1", "a"] and kwargs == {"k": ["R2", "R1"], "n": 3}


def test_a_resolved_placeholder_becomes_the_value_ray_resolved():
    blob, refs = _frame.dumps_call(([_frame.Resolved(1), _frame.Resolved(0)], {"b": _frame.Resolved(0)}))
    assert refs == []
    assert _frame.loads_call(blob, [], ("v0", "v1")) == (["v1", "v0"], {"b": "v0"})


def test_a_socket_frame_refuses_a_ref_and_any_frame_over_its_limit():
    with pytest.raises(_frame.NeedsRay):
        _frame.dumps_frame({"x": [ref()]})
    with pytest.raises(_frame.NeedsRay):
        _frame.dumps_call(b"x" * 2048, limit=1024)
    with pytest.raises(_frame.NeedsRay):
        _frame.dumps_frame(np.zeros(2048, dtype=np.uint8), limit=1024)  # out-of-band buffers count too


def test_arrays_travel_out_of_band_and_arrive_read_only_as_from_rays_store():
    arr = np.arange(1000, dtype=np.float32)
    blob, _ = _frame.dumps_call({"a": arr})
    got = _frame.loads_call(blob, [])["a"]
    assert np.array_equal(got, arr) and not got.flags.writeable
    batch = Batch.from_dict({"x": torch.arange(6), "s": ["a", "b", "c", "d", "e", "f"]})
    back = _frame.loads_call(_frame.dumps_call(batch)[0], [])
    assert torch.equal(back["x"], batch["x"]) and list(back.non_tensors["s"]) == ["a", "b", "c", "d", "e", "f"]


def test_what_the_c_pickler_cannot_name_goes_by_value_and_still_lifts_its_refs():
    r = ref()
    captured = [r, 5]
    fn = lambda: captured  # noqa: E731 - a lambda is what cloudpickle must carry by value

    blob, refs = _frame.dumps_call((fn,))
    assert refs == [r]
    (back,) = _frame.loads_call(blob, ["R"])
    assert back() == ["R", 5]


def test_loads_on_two_threads_keep_their_own_refs():
    blob, _ = _frame.dumps_call([ref()])
    seen: dict[int, list] = {}
    barrier = threading.Barrier(2)

    def load(i: int) -> None:
        barrier.wait()
        seen[i] = [_frame.loads_call(blob, [f"R{i}"])[0] for _ in range(2000)]

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(seen[0]) == {"R0"} and set(seen[1]) == {"R1"}


def test_a_value_that_cannot_be_pickled_raises_instead_of_being_dropped():
    with pytest.raises(TypeError):
        _frame.dumps_call({"lock": threading.Lock()})


class Secret:
    def __init__(self, text: str) -> None:
        self.text = text


def _redacted(s: Secret) -> tuple:
    return Secret, ("redacted",)


def test_a_reducer_registered_with_ray_or_copyreg_at_any_time_applies_to_the_next_frame():
    """Ray's own serializer honours ``ray.util.register_serializer`` (kept in cloudpickle's dispatch table) and
    copyreg, read when each value is pickled; a frame must too, or a user's redaction silently stops applying."""
    import copyreg

    from ray import cloudpickle

    assert _frame.loads_call(_frame.dumps_call(Secret("password"))[0], []).text == "password"  # a first dump
    cloudpickle.CloudPickler.dispatch[Secret] = _redacted  # what ray.util.register_serializer does
    try:
        assert _frame.loads_call(_frame.dumps_call(Secret("password"))[0], []).text == "redacted"
        assert _frame.loads_frame(_frame.dumps_frame(Secret("password"))).text == "redacted"
        # a frame that cloudpickle carries (it holds a lambda) uses the same reductions
        assert _frame.loads_call(_frame.dumps_call([Secret("password"), lambda: 0])[0], [])[0].text == "redacted"
    finally:
        del cloudpickle.CloudPickler.dispatch[Secret]
    copyreg.pickle(Secret, _redacted)  # registered after the first dump
    try:
        assert _frame.loads_call(_frame.dumps_call([Secret("password")])[0], [])[0].text == "redacted"
    finally:
        del copyreg.dispatch_table[Secret]
    assert _frame.loads_call(_frame.dumps_call(Secret("password"))[0], []).text == "password"


class _Dict(dict):
    def __reduce__(self) -> tuple:
        return dict, ({"as": "plain dict"},)


def test_a_plain_value_pickles_to_the_same_bytes_without_the_reductions_table():
    """A reply such as ``{"loss": 0.5}`` or None is pickled without building the call's reductions table: the C
    pickler writes those types itself, before it looks any reduction up, so the bytes are the ones the general
    pickling writes. Anything else (a subclass, a registered type inside a container, a large or self-holding
    value) takes the general pickling, and a registered reduction inside a dict still applies."""
    import collections

    from ray import cloudpickle

    def general(v: object) -> bytes:
        return _frame._framed(*_frame._pickle(v, _frame._refuse), None)

    for v in (None, True, 3, 2**80, 1.5, float("nan"), "x", "__main__", b"\x00", (), [], {},
              {"loss": 0.5, "rows": 4.0}, [1, (2, "a"), {"k": [None, b"b"]}], {1: 2, (3, "4"): None}):
        assert _frame._plain(v)
        assert _frame.dumps_frame(v) == general(v)
    loop: list = []
    loop.append(loop)
    for v in (_Dict(a=1), collections.OrderedDict(a=1), 1 + 2j, {"s": Secret("x")}, list(range(100)), loop,
              {"k": {1, 2}}):
        assert not _frame._plain(v)
    assert _frame.loads_frame(_frame.dumps_frame(_Dict(a=1))) == {"as": "plain dict"}  # its own reduction
    assert _frame.loads_frame(_frame.dumps_frame(loop))[0][0][0] is not None
    cloudpickle.CloudPickler.dispatch[Secret] = _redacted
    try:
        assert _frame.loads_frame(_frame.dumps_frame({"s": Secret("password")}))["s"].text == "redacted"
    finally:
        del cloudpickle.CloudPickler.dispatch[Secret]
    with pytest.raises(_frame.NeedsRay):  # the limit holds for plain values too
        _frame.dumps_frame("x" * 2048, limit=1024)
    assert _frame.loads_frame(_frame.dumps_frame("x" * 1000, limit=1024)) == "x" * 1000


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float64, torch.int32, torch.uint8])
def test_a_column_read_from_a_frame_is_aligned_for_its_dtype(dtype):
    """A frame's out-of-band buffers sat at whatever offset the header and pickle left (13 + 8 n + the pickle's
    length), so a large column read from a frame was misaligned: a complex128 one 5 bytes off 16, and an indexed
    write into it killed the process (SIGSEGV). Each buffer now starts at a multiple of 16 bytes of the frame."""
    n = 20_000  # every column over SMALL_COLUMN_BYTES: out of band
    b = Batch.from_dict({"a": torch.ones(n, dtype=dtype), "odd": torch.ones(n * 3 + 1, dtype=torch.uint8)[:n],
                         "b": torch.zeros(n, 2, dtype=dtype), "s": ["x" * (i % 7) for i in range(n)]})
    for frame in (_frame.dumps_frame(b, limit=None), _frame.dumps_call(b, limit=None)[0]):
        assert frame[:1] == b"\x01"
        for private in (False, True):
            back = _frame.loads_frame(frame, private=private)
            for k in ("a", "b", "odd"):
                assert back[k].data_ptr() % 16 == 0, (k, back[k].data_ptr() % 16)
                assert torch.equal(back[k], b[k])
    arr = np.arange(1001, dtype=np.float64)
    for v in ({"x": np.arange(7, dtype=np.uint8), "y": arr}, [arr[1:], np.arange(5, dtype=np.uint8), arr]):
        back = _frame.loads_frame(_frame.dumps_frame(v, limit=None))
        for a in (back.values() if isinstance(back, dict) else back):
            assert a.ctypes.data % 16 == 0
    # a frame handed over at an odd address (a slice of a larger buffer) is read from an aligned copy
    frame = _frame.dumps_frame(b, limit=None)
    back = _frame.loads_frame(memoryview(b"!" + frame)[1:])
    assert back["a"].data_ptr() % 16 == 0 and torch.equal(back["a"], b["a"])
