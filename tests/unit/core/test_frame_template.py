"""Frame templates (orchestra._template): a repeated shard call's frames made by writing its Batch's column bytes into
an earlier call's frames must be, byte for byte, the frames pickling would have made; every call that differs in
anything but its column bytes is made as usual. Ray-free: the frames are what ``Invocation._encode`` pickles."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from ray import cloudpickle

from orchestra import Batch
from orchestra import _frame
from orchestra import dispatch as D
from orchestra._invocation import _frames_of
from orchestra._batch import SMALL_COLUMN_BYTES
from orchestra._template import MAX_COLUMNS, FrameTemplate, Templates, shape_of
from orchestra._wire import STORE_KWARG
from orchestra.dispatch import Plan

READERS = (4,)


def _plan(batch: Batch | None = None, n: int = 4, dispatch: D.Dispatch | None = None, key: str | None = None,
          **extra) -> Plan:
    group = SimpleNamespace(name="g", pool=SimpleNamespace(backend=SimpleNamespace(own_process=True)))  # Ray's
    args, kwargs = ((), {key: batch}) if key else ((batch,), {})
    kwargs.update(extra)
    plan = Plan(group=group, endpoint="step", world_size=n, ranks=tuple(range(n)), args=args, kwargs=kwargs)
    return (dispatch or D.shard()).check(plan)


def _usual(plan: Plan, readers: tuple[int, ...] = READERS) -> dict:
    """Each rank's frame as the usual send path makes it (``Invocation._send_now`` without a template)."""
    return _frames_of(plan, readers)


def _learnt(plan: Plan) -> FrameTemplate | None:
    assert shape_of(plan, READERS, _frame.reductions()) is not None
    return FrameTemplate.learn(plan, _usual(plan), _usual)


def _random_like(b: Batch, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    cols = {}
    for k, v in b.tensors.items():
        raw = torch.randint(0, 256, (v.numel() * v.element_size(),), dtype=torch.uint8, generator=g)
        cols[k] = raw.view(v.dtype).view(v.shape)
    return Batch(cols)


def _cases() -> dict[str, tuple[Batch, dict]]:
    n = 16
    cplx = torch.randn(n, 3, dtype=torch.complex64)
    grad = torch.randn(n, 2, requires_grad=True)
    return {
        "int64": (Batch.from_dict({"x": torch.arange(n)}), {}),
        "uneven rows, 2-d float": (Batch.from_dict({"x": torch.randn(10, 3)}), {}),
        "bfloat16 (numpy lacks it)": (Batch.from_dict({"x": torch.randn(n, 4).bfloat16()}), {}),
        "bool": (Batch.from_dict({"m": torch.rand(64) > 0.5}), {}),
        "several columns": (Batch.from_dict({"a": torch.arange(n), "b": torch.randn(n, 2).half(),
                                             "c": torch.randint(0, 9, (n, 8), dtype=torch.int8)}), {}),
        "conjugate column": (Batch.from_dict({"x": cplx.conj()}), {}),
        "requires grad": (Batch.from_dict({"x": grad}), {}),
        "pad, rows divisible": (Batch.from_dict({"x": torch.arange(n)}), {"dispatch": D.shard(pad=True)}),
        "keyword argument": (Batch.from_dict({"x": torch.arange(n)}), {"key": "batch"}),
        "8 ranks": (Batch.from_dict({"x": torch.arange(n)}), {"n": 8}),
    }


CASES = _cases()


@pytest.mark.parametrize("case", list(CASES))
def test_a_template_makes_the_frames_pickling_would_for_new_column_bytes(case):
    batch, how = CASES[case]
    learnt_on = _plan(batch, **how)
    template = _learnt(learnt_on)
    assert template is not None
    for seed in range(3):
        other = _random_like(batch, seed)
        plan = _plan(other, **how)
        assert shape_of(plan, READERS, _frame.reductions()) == shape_of(learnt_on, READERS, _frame.reductions())
        made = template.frames(other)
        assert made == _usual(plan)  # byte for byte
        # and each rank reads its own rows of the new batch, bit-exact
        for r, (frame, _, _) in made.items():
            args, kwargs = _frame.loads_frame(frame)
            shard = args[0] if args else kwargs[how["key"]]
            start, rows, _total = kwargs[STORE_KWARG][1]  # the shard's Span, as a plain tuple
            for k, v in other.tensors.items():
                want = v.detach().resolve_conj()[start:start + rows]
                assert shard[k].dtype == want.dtype and shard[k].shape == want.shape
                assert shard[k].contiguous().view(torch.uint8).equal(want.contiguous().view(torch.uint8)), (r, k)


@pytest.mark.parametrize("layout", ["transposed", "every other element", "expanded", "every other column",
                                    "bool bytes not 0 or 1, rows padded"])
def test_a_column_that_is_not_contiguous_is_pickled_as_usual(layout):
    """Each shard of such a column is copied on its own (and torch's copy rewrites bool bytes that are not 0 or 1):
    the template, which reads the whole column once, leaves it to the usual path."""
    n = 16
    if layout == "transposed":
        col = torch.randn(3, n).t()
    elif layout == "every other element":
        col = torch.randn(n, 2)[:, 0]
    elif layout == "expanded":
        col = torch.randn(1).expand(n)
    elif layout == "every other column":
        col = torch.randn(n, 6)[:, ::2]
    else:
        col = torch.randint(0, 256, (n, 24), dtype=torch.uint8).view(torch.bool)[:, :16]
    t = Templates()
    dense = Batch.from_dict({"x": col.contiguous()})
    for _ in range(2):
        plan = _plan(dense)
        shape, frames = t.frames("role", plan, READERS)
        t.saw("role", shape, plan, _usual(plan), _usual)
    assert t.frames("role", _plan(dense), READERS)[1] is not None
    plan = _plan(Batch.from_dict({"x": col}))
    shape, frames = t.frames("role", plan, READERS)
    assert shape is not None and frames is None and t.used == 1
    assert _usual(plan)  # which sends it


def test_no_template_when_a_ranks_column_bytes_are_too_short_to_find():
    plan = _plan(Batch.from_dict({"x": torch.arange(4, dtype=torch.int8)}))  # one byte per rank
    assert _learnt(plan) is None


@pytest.mark.parametrize("why", ["meta", "non-tensor column", "padding rows of its own", "another argument",
                                 "a broadcast", "a per-rank plan", "pad() adds rows", "a shard column out of band",
                                 "a module pickled by value", "too many columns"])
def test_calls_a_template_cannot_make_have_no_shape(why):
    b = Batch.from_dict({"x": torch.arange(8)})
    plan = _plan(b)
    if why == "a shard column out of band":  # a numpy array in the frame: a serializer registered for it applies
        plan = _plan(Batch.from_dict({"x": torch.zeros(2, SMALL_COLUMN_BYTES // 4 + 1)}), n=2)
    elif why == "a module pickled by value":  # cloudpickle would write its globals into the frame
        cloudpickle.register_pickle_by_value(json)
        try:
            assert shape_of(plan, READERS, _frame.reductions()) is None
        finally:
            cloudpickle.unregister_pickle_by_value(json)
        assert shape_of(plan, READERS, _frame.reductions()) is not None
        return
    elif why == "too many columns":
        plan = _plan(Batch.from_dict({f"c{i}": torch.arange(8) for i in range(MAX_COLUMNS + 1)}))
    elif why == "meta":
        plan = _plan(Batch.from_dict({"x": torch.arange(8)}, meta={"step": 1}))
    elif why == "non-tensor column":
        plan = _plan(Batch.from_dict({"x": torch.arange(8), "s": [str(i) for i in range(8)]}))
    elif why == "padding rows of its own":
        plan = _plan(Batch.from_dict({"x": torch.arange(7)}).pad_to_multiple(4), dispatch=D.shard(allow_empty=True))
    elif why == "another argument":
        plan = _plan(b, lr=0.1)
    elif why == "a broadcast":
        plan = _plan(b, dispatch=D.broadcast())
    elif why == "a per-rank plan":
        plan = plan.with_(per_rank={0: ((b,), {})})
    elif why == "pad() adds rows":
        plan = _plan(Batch.from_dict({"x": torch.arange(6)}), dispatch=D.shard(pad=True))  # 6 rows padded to 8
    assert shape_of(plan, READERS, _frame.reductions()) is None


def test_the_shape_holds_everything_a_frame_holds_besides_column_bytes():
    def shape(b: Batch, readers=READERS, base=None, **how) -> tuple:
        return shape_of(_plan(b, **how), readers, base or _frame.reductions())

    ref = shape(Batch.from_dict({"x": torch.arange(16)}))
    assert ref == shape(Batch.from_dict({"x": torch.arange(16) + 5}))
    assert ref != shape(Batch.from_dict({"x": torch.arange(20)}))  # rows
    assert ref != shape(Batch.from_dict({"x": torch.arange(16, dtype=torch.int32)}))  # dtype
    assert ref != shape(Batch.from_dict({"y": torch.arange(16)}))  # column name
    assert ref != shape(Batch.from_dict({"x": torch.arange(32).view(16, 2)}))  # row shape
    assert ref != shape(Batch.from_dict({"x": torch.arange(16)}), readers=(2, 4))  # what the ranks are told
    assert ref != shape(Batch.from_dict({"x": torch.arange(16)}), key="batch")  # how it is passed
    assert ref != shape(Batch.from_dict({"x": torch.arange(16)}), n=8)  # the ranks and their shard spec
    custom = dict(_frame.reductions())
    custom[Batch] = lambda b: (Batch.from_dict, ({"x": b["x"]},))  # a serializer registered for Batch
    assert ref != shape(Batch.from_dict({"x": torch.arange(16)}), base=custom)


def test_an_endpoint_learns_from_the_second_call_of_a_shape_and_forgets_it_for_another():
    t = Templates()

    def call(b: Batch) -> bool:
        plan = _plan(b)
        shape, frames = t.frames("role", plan, READERS)
        if frames is not None:
            assert frames == _usual(plan)
            return True
        t.saw("role", shape, plan, _usual(plan), _usual)
        return False

    sixteen = [Batch.from_dict({"x": torch.arange(16) * i}) for i in range(4)]
    assert [call(b) for b in sixteen] == [False, False, True, True]
    assert call(Batch.from_dict({"x": torch.arange(20)})) is False  # another shape: made as usual
    assert [call(b) for b in sixteen] == [False, False, True, True]  # and the first one learnt again
    assert t.used == 4


def _freed(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)  # FSDP's pattern for a parameter's unsharded storage after use
    return t


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("kind", ["meta", "sparse", "sparse csr", "zero tensor", "freed storage"])
def test_a_column_that_cannot_travel_is_left_to_the_usual_path_which_names_it(kind):
    """Before, a column whose storage was freed was written into the template as whatever memory numpy() read."""
    t = Templates()
    good = Batch.from_dict({"x": torch.arange(64.0).view(16, 4)})
    for _ in range(2):
        plan = _plan(good)
        shape, frames = t.frames("role", plan, READERS)
        t.saw("role", shape, plan, _usual(plan), _usual)
    assert t.frames("role", _plan(good), READERS)[1] is not None
    col = {"meta": lambda: torch.empty(16, 4, device="meta"),  # each of the template's dtype and shape
           "sparse": lambda: torch.eye(16, 4).to_sparse(),
           "sparse csr": lambda: torch.eye(16, 4).to_sparse_csr(),
           "zero tensor": lambda: torch._efficientzerotensor(16, 4),  # no memory: numpy() refuses it
           "freed storage": lambda: _freed(torch.arange(64.0).view(16, 4))}[kind]()
    bad = Batch.from_dict({"x": col})
    shape, frames = t.frames("role", _plan(bad), READERS)
    assert shape is not None and frames is None
    with pytest.raises(Exception, match="ZeroTensor" if kind == "zero tensor" else "'x'"):  # the usual path's error
        _usual(_plan(bad))


@pytest.mark.parametrize("noise", ["not in them", "in frames of another shape", "where the call's own bytes are not"])
def test_no_template_when_the_frames_with_random_bytes_do_not_show_where_the_columns_go(noise):
    plan = _plan(Batch.from_dict({"x": torch.arange(16)}))
    frames = _usual(plan)
    if noise == "not in them":
        encode = lambda p: frames  # noqa: E731 - the call's own frames, not the noise's
    elif noise == "in frames of another shape":
        encode = lambda p: _usual(p, readers=(2, 4))  # noqa: E731
    else:  # the noise is found, but the call's own frames are not the template with its bytes written in
        frames = {r: (f[:-1] + bytes([f[-1] ^ 1]), refs, top) for r, (f, refs, top) in frames.items()}
        encode = _usual
    assert FrameTemplate.learn(plan, frames, encode) is None


def _every_dtype() -> list[torch.dtype]:
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted((d for d in dtypes if not str(d).startswith(("torch.q", "torch.quint"))), key=str)  # no quantized


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", _every_dtype(), ids=str)
def test_a_column_of_every_dtype_is_written_as_pickling_would(dtype):
    """A contiguous column's memory is read as it is: for every dtype (numpy's or not, sub-byte, float8, bits) the
    frames are the ones pickling makes."""
    size = torch.empty((), dtype=dtype).element_size()
    col = torch.randint(0, 256, (16, 2 * size), dtype=torch.uint8).view(dtype)
    template = _learnt(_plan(Batch.from_dict({"x": col})))
    assert template is not None
    other = torch.randint(0, 256, (16, 2 * size), dtype=torch.uint8).view(dtype)
    plan = _plan(Batch.from_dict({"x": other}))
    assert template.frames(plan.args[0]) == _usual(plan)


def test_a_serializer_registered_for_batch_after_a_template_is_used_from_the_next_call_on():
    """What ``ray.util.register_serializer`` does (``CloudPickler.dispatch[cls] = reducer``) changes the shape: the
    next call is pickled as usual, with the new reduction."""
    t = Templates()
    b = Batch.from_dict({"x": torch.arange(16)})
    for _ in range(2):
        plan = _plan(b)
        shape, frames = t.frames("role", plan, READERS)
        t.saw("role", shape, plan, _usual(plan), _usual)
    assert t.frames("role", _plan(b), READERS)[1] is not None
    cloudpickle.CloudPickler.dispatch[Batch] = lambda v: (Batch.from_dict, ({"x": v["x"]},))
    try:
        shape, frames = t.frames("role", _plan(b), READERS)
        assert shape is not None and frames is None
    finally:
        cloudpickle.CloudPickler.dispatch.pop(Batch, None)
    assert t.frames("role", _plan(b), READERS)[1] is not None
