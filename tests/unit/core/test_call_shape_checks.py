"""Calls whose refusal is knowable from their shape are refused before any rank runs, and errors about the ranks'
results name the group, endpoint and rank (in-process backend). Each case was found by an adversarial review: the
call ran on some ranks and failed on others, a result mixed kinds, a stream of values iterated as nothing, or an
error named a part index instead of the rank."""

from __future__ import annotations

from typing import Any

import threading
import time

import numpy as np
import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra._tensordict import TensorDict

pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails


def pool(n: int) -> ResourcePool:
    return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend="local")


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


_READ = threading.Event()  # set by a read's rank 0


class _Shapes(Worker):
    def __init__(self) -> None:
        self.ran: list[str] = []

    @endpoint(D.broadcast())
    def runs(self) -> list[str]:
        return self.ran

    @endpoint(D.shard(pad=True))
    def pair(self, a: Batch, b: Batch) -> Batch:
        self.ran.append("pair")
        return a

    @endpoint(D.shard(pad=True))
    def padded(self, batch: Batch) -> Batch:
        self.ran.append("padded")
        return Batch.from_dict({"x": batch["x"], "n": torch.full((len(batch),), len(batch))})

    @endpoint(D.shard(allow_empty=True))
    def maybe_empty(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def echo(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def gen(self, batch: Batch, pieces: int = 2):
        yield from batch.chunk(pieces)

    @endpoint(D.shard())
    def late_gen(self, batch: Batch, pieces: int = 2):  # each part a little after gen's: a source behind another
        for p in batch.chunk(pieces):
            time.sleep(0.02)
            yield Batch.from_dict({"late": p["x"] + 1})

    @endpoint(D.shard())
    def two_parts(self, batch: Batch):  # rank 1's parts are float, the others' integer
        for p in batch.chunk(2):
            yield Batch.from_dict({"x": p["x"].float() if self.rank == 1 else p["x"]})

    @endpoint(D.shard())
    def totals(self, batch: Batch):  # a stream of plain values
        for p in batch.chunk(2):
            yield int(p["x"].sum())

    @endpoint(D.shard())
    def cols(self, batch: Batch, how: str = "column", hold: bool = False) -> Batch:  # rank 1's unlike the others'
        self.ran.append("cols")
        if hold and self.rank == 1:  # until a reader's rank 0 ran (ranks run in this process: local backend)
            assert _READ.wait(timeout=60)
        cols = {"x": batch["x"], "y": batch["x"] * 2}
        if how == "numpy row shape":
            cols["y"] = np.zeros((len(batch), 2 if self.rank == 1 else 3))
        elif self.rank == 1:
            if how == "column":
                del cols["y"]
            elif how == "kind":
                cols["y"] = cols["y"].float()
            elif how == "row shape":
                cols["y"] = cols["y"][:, None].expand(-1, 2)
            elif how == "text":
                cols["y"] = [str(v) for v in cols["y"].tolist()]
            elif how == "empty":  # no rows, no columns: nothing to join, as concat skips it
                cols = {}
        return Batch.from_dict(cols)

    @endpoint(D.shard())
    def read(self, batch: Batch) -> Batch:
        self.ran.append("read")
        if self.rank == 0:
            _READ.set()
        return batch

    @endpoint(D.shard())
    def ids(self, batch: Batch) -> Batch:  # rank 0: integer ids, rank 1: string ids
        ids = np.arange(len(batch)) if self.rank == 0 else [f"id{i}" for i in range(len(batch))]
        return Batch.from_dict({"x": batch["x"], "id": ids})


@pytest.fixture(scope="module")
async def groups():
    gs = {n: WorkerGroup(pool(n), _Shapes, group_name=f"shapes{n}") for n in (2, 3)}
    for g in gs.values():
        await g.ready()
    yield gs
    for g in gs.values():
        await g.aclose()


async def runs(g: WorkerGroup) -> list[list[str]]:
    return await g.runs()


@pytest.mark.parametrize("dispatch", [D.shard(pad=True), D.shard() | D.pad(), D.shard(mesh="m", pad=True)],
                         ids=repr)
def test_a_generator_endpoint_with_pad_is_refused_where_it_is_defined(dispatch):
    """Rank 1 of 2 got a filler row and refused while rank 0 ran the body; with rows that divide it streamed:
    whether a call ran depended on its row count. A generator cannot pad at all, so it is refused when defined."""
    with pytest.raises(TypeError, match=r"generator .*padded_gen.*streaming endpoint cannot pad"):
        class _PadGen(Worker):
            @endpoint(dispatch)
            def padded_gen(self, batch: Batch):
                yield batch


async def test_stream_over_a_pad_endpoint_is_refused_at_the_call(groups):
    """stream() ran the call once per arriving part with the whole part as one shard: pad=True was dropped, and the
    shards were of unequal sizes ([2, 2, 1, 1, ...])."""
    g2, g3 = groups[2], groups[3]
    with pytest.raises(orc.DispatchError, match=r"stream\(\).*pad"):
        g2.padded.options(stream=True)(g3.gen(xs(7), pieces=2))


@pytest.mark.parametrize("how", ["batches", "awaited futures", "running futures"])
async def test_a_pad_call_of_data_arguments_with_different_rows_runs_on_no_rank(groups, how):
    """7 and 8 rows over 3 ranks: ranks 0 and 1 ran, rank 2 failed ("padded differently")."""
    g = groups[3]
    before = await runs(g)
    a, b = xs(7), xs(8)
    if how != "batches":
        a, b = g.echo(a), g.echo(b)
        if how == "awaited futures":
            await a, await b
    with pytest.raises((orc.DispatchError, orc.WorkerError), match=r"7 and 8 rows.*union") as info:
        await g.pair(a, b)
    if how != "running futures":
        assert isinstance(info.value, orc.DispatchError)
    assert await runs(g) == before


async def test_a_pad_call_of_data_arguments_with_different_rows_none_padded_runs(groups):
    """4 and 6 rows over 2 ranks need no padding: they split as a call without pad splits them (2 + 3 rows a rank)."""
    g = groups[2]
    for a, b in ((xs(4), xs(6)), (g.echo(xs(4)), g.echo(xs(6)))):
        assert (await g.pair(a, b))["x"].tolist() == [0, 1, 2, 3]


async def test_a_pad_endpoint_takes_zero_rows_from_a_future_as_from_a_batch(groups):
    g2, g3 = groups[2], groups[3]
    assert len(await g2.padded(xs(0))) == 0
    out = await g2.padded(g3.maybe_empty(xs(0)))  # was: WorkerError "... or use shard(pad=True)" (it has pad)
    assert len(out) == 0 and out.keys() == ["x", "n"]


async def test_iterating_a_future_of_plain_values_says_to_await_it(groups):
    """``async for`` over a stream of ints ended at once with nothing, while await gave [[1, 5], [9, 13]]."""
    f = groups[2].totals(xs(8))
    with pytest.raises(TypeError, match=r"rank \d returned int.*await"):
        async for _ in f:
            pass
    assert await f == [[1, 5], [9, 13]]


async def test_results_that_do_not_join_name_the_rank_group_and_endpoint(groups):
    """The error said "column 'x' of batch 2 is torch.float32" (a part index) with no group or endpoint."""
    with pytest.raises(ValueError, match=r"'shapes3'.*'two_parts'.*rank 1") as info:
        await groups[3].two_parts(xs(12))
    assert "batch 2" not in str(info.value)


async def test_results_with_a_column_of_numbers_on_one_rank_and_strings_on_another_do_not_join(groups):
    """await gave [0, 1, 'id0', 'id1']: an integer column and a string column concatenated into one object
    column, though concat refuses two kinds."""
    with pytest.raises(ValueError, match=r"'id'.*rank 1"):
        await groups[2].ids(xs(4))


def test_concat_refuses_an_object_column_of_another_kind_than_a_typed_one():
    nums = Batch.from_dict({"id": np.arange(2)})
    strs = Batch.from_dict({"id": ["a", "b"]})
    objs = Batch.from_dict({"id": np.array([{"k": 1}, None], dtype=object)})
    nones = Batch.from_dict({"id": np.array([None, None], dtype=object)})
    typed_strs = Batch.from_dict({"id": np.array(["a", "b"])})
    for a, b in ((nums, strs), (strs, nums), (nums, objs), (typed_strs, nones), (nones, typed_strs)):
        with pytest.raises(ValueError, match="column 'id'"):
            Batch.concat([a, b])
    ints_as_objects = Batch.from_dict({"id": np.array([3, 4], dtype=object)})
    assert Batch.concat([nums, ints_as_objects])["id"].tolist() == [0, 1, 3, 4]  # the same kind, boxed
    assert Batch.concat([typed_strs, strs])["id"].tolist() == ["a", "b"] * 2
    assert Batch.concat([strs, objs])["id"].tolist() == ["a", "b", {"k": 1}, None]  # object columns: any values


async def test_a_union_of_futures_with_different_rows_names_them(groups):
    with pytest.raises(ValueError, match=r"shapes2\.echo.*4 rows.*shapes3\.echo.*5 rows"):
        await (groups[2].echo(xs(4)) | groups[3].echo(xs(5)))


def test_a_nested_column_the_wire_cannot_carry_is_refused_when_the_batch_is_made():
    """A nested column with no leaves vanished through any call, and a nested batch size of [4, 3] came back as
    [4]; the Batch compared equal to what was sent."""
    with pytest.raises(ValueError, match=r"'empty'.*no tensor"):
        Batch(TensorDict({"x": torch.arange(4), "empty": TensorDict({}, [4])}, [4]))
    b = Batch(TensorDict({"x": torch.arange(4), "n": TensorDict({"y": torch.zeros(4, 3)}, [4, 3])}, [4]))
    assert b.tensors["n"].batch_size == torch.Size([4])  # the row dimension, as the top level keeps
    again = Batch.concat([b, b])
    assert again.tensors["n"].batch_size == torch.Size([8]) and again.tensors["n"]["y"].shape == (8, 3)


def test_a_value_in_the_tensordict_that_is_not_a_tensor_is_refused_when_the_batch_is_made():
    """A NonTensorData next to a tensor, at the top level or nested, never reached a rank (the wire carries
    tensors), and the Batch compared equal to what was sent."""
    top = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    top.set_non_tensor("top", "t")
    with pytest.raises(ValueError, match=r"column 'top' of the TensorDict holds a NonTensorData"):
        Batch(top)
    inner = TensorDict({"l": torch.zeros(3)}, batch_size=[3])
    inner.set_non_tensor("tag", "hello")
    with pytest.raises(ValueError, match=r"column 'a.tag' of the TensorDict holds a NonTensorData"):
        Batch(TensorDict({"x": torch.zeros(3), "a": inner}, batch_size=[3]))


def test_a_nested_column_of_row_size_is_kept_as_given():
    """Normalizing costs nothing when there is nothing to cut: the caller's TensorDict is the Batch's."""
    td = TensorDict({"x": torch.arange(4), "n": TensorDict({"y": torch.zeros(4, 3)}, [4])}, [4])
    assert Batch(td).tensors is td


def test_a_nested_collection_of_tensors_the_wire_carries_is_taken_as_a_nested_column():
    """A tensorclass value or a lazily stacked TensorDict holds tensors the wire carries (as a TensorDict): they
    worked before the check of what a TensorDict holds, which refused them as values that would not arrive."""
    from tensordict import LazyStackedTensorDict, tensorclass

    @tensorclass
    class _Pair:
        a: torch.Tensor

    n = 4
    for value in (_Pair(a=torch.ones(n, 2), batch_size=[n]),
                  LazyStackedTensorDict(*[TensorDict({"y": torch.ones(2)}, []) for _ in range(n)], stack_dim=0)):
        b = Batch(TensorDict({"x": torch.zeros(n), "c": value}, batch_size=[n]))
        leaves = dict(b.tensors.items(include_nested=True, leaves_only=True))
        assert set(leaves) - {"x"} in ({("c", "a")}, {("c", "y")}) and len(Batch.concat([b, b])) == 2 * n
        assert isinstance(b.tensors["c"], TensorDict) and b.tensors["c"].batch_size == torch.Size([n])


@pytest.mark.parametrize("how", ["non-tensor value", "empty nested column"])
async def test_a_value_put_into_the_tensordict_after_the_batch_was_made_fails_the_call_naming_it(groups, how):
    """``b.tensors[k] = ...`` goes past the construction check: the wire dropped such a value without a word (the
    rank got the Batch without it). Now the Batch refuses to travel, and the call runs on no rank."""
    g = groups[2]
    b = xs(4)
    if how == "non-tensor value":
        b.tensors["s"] = "hello"
    else:
        b.tensors["e"] = TensorDict({}, batch_size=[4])
    with pytest.raises(orc.DispatchError, match=r"argument 0.*cannot travel.*'[se]'"):
        await g.echo(b)
    with pytest.raises(TypeError, match="cannot travel"):
        import pickle

        pickle.dumps(b)


def _reads(ran: list[list[str]]) -> list[int]:
    return [r.count("read") for r in ran]


@pytest.mark.parametrize("how", ["column", "kind", "row shape", "text", "numpy row shape"])
@pytest.mark.parametrize(("down", "when"), [(2, "done"), (3, "done"), (3, "running")],
                         ids=["rank i reads rank i, done", "rows split anew, done", "rows split anew, running"])
async def test_a_future_whose_ranks_returned_unlike_columns_is_read_by_no_rank(groups, how, when, down):
    """``await`` refuses a future whose ranks' results do not join; a call given that future read it rank by rank
    instead: its rank 0 got columns x and y, its rank 1 only x (or y of another kind), and both ran. Or, where a
    reader's rows spanned both upstream ranks, only that rank failed. Now no rank runs it: the controller refuses
    it by the headers it has, and every reader by all of them."""
    g_up, g_down = groups[2], groups[down]  # (rank i reads a running upstream's rank i: the next test)
    before = await runs(g_down)
    up = g_up.cols(xs(4), how=how)
    if when == "done":
        await up.wait()
    with pytest.raises((orc.DispatchError, orc.WorkerError), match=r"rank 1.*rank 0|rank 0.*rank 1") as info:
        await g_down.read(up)
    assert "'y'" in str(info.value) or "columns" in str(info.value)
    if when == "done":
        assert isinstance(info.value, orc.DispatchError) and "'shapes2'" in str(info.value)
    assert _reads(await runs(g_down)) == _reads(before)
    with pytest.raises(ValueError, match="do not join"):
        await up


@pytest.mark.parametrize("how", ["column", "kind"])
async def test_a_call_that_read_one_upstream_rank_a_rank_before_the_rest_was_here_fails_at_its_end(groups, how):
    """The reader's rank i reads the upstream's rank i alone (same DP size), and was sent before rank 1's headers
    were here (rank 1 waits until the reader's rank 0 ran): no rank could tell. Its result is refused when it ends,
    naming the upstream, where before it was used."""
    g = groups[2]
    _READ.clear()
    before = await runs(g)
    up = g.cols(xs(4), how=how, hold=True)
    out = g.read(up)
    with pytest.raises(orc.DispatchError, match=r"'read'.*ranks read the future of .*'cols' rank by rank.*"
                                                r"not one Batch.*rank 1.*rank 0.*result is refused"):
        await out
    assert _reads(await runs(g)) == [n + 1 for n in _reads(before)]  # it ran on both: the case this cannot prevent
    with pytest.raises(orc.DispatchError, match="result is refused"):
        await out.wait()
    with pytest.raises(orc.DispatchError, match=r"'cols' (read )?rank by rank"):
        await g.read(out)  # a later reader fails with it, as with any failure of its input


async def test_a_call_computed_from_rows_read_rank_by_rank_is_refused_too(groups):
    """The aligned reader's result, forwarded before it ended, was read as good rows by the next call: refused only
    when the reader itself was awaited, which a pipeline may never do. The next call inherits the check."""
    g = groups[2]
    _READ.clear()
    first = g.read(g.cols(xs(4), how="column", hold=True))
    second = g.echo(first)  # sent at once, aligned again
    # (first echoed what its ranks read, so its own ranks' results do not join either: named first when so)
    with pytest.raises(orc.DispatchError, match=r"'echo'.*ranks read the future of .*'(cols|read)' rank by rank"):
        await second


async def test_a_rank_with_no_rows_and_no_columns_does_not_make_a_future_unreadable(groups):
    """concat skips a result without rows, so await joins it; a reader does too."""
    g = groups[2]
    up = g.cols(xs(2), how="empty")  # rank 0: 1 row of x and y; rank 1: no rows (a 1-row shard has rows, so:)
    assert (await g.read(g.maybe_empty(up)))["y"].tolist() == (await up)["y"].tolist()


async def test_a_stream_over_a_future_whose_ranks_results_do_not_join_is_refused(groups):
    """``stream()`` reads each part apart: it ran every part with the columns its rank returned, and its result
    was used. Refused by the headers here before any part is sent (and part by part, and at its end, otherwise)."""
    g = groups[2]
    up = g.cols(xs(4), how="column")
    await up.wait()
    before = await runs(g)
    with pytest.raises(orc.DispatchError, match=r"'read'.*future of .*'cols' is not one Batch.*rank 1.*rank 0"):
        await g.read.options(stream=True)(up)
    assert _reads(await runs(g)) == _reads(before)


async def test_iterating_the_parts_of_a_call_that_read_rows_rank_by_rank_ends_in_its_refusal(groups):
    """``async for`` handed out the rows of an aligned reader sent before its input's headers were all here, and
    ended without a word. Each part is now checked against the headers here, and the end against all of them."""
    g = groups[2]
    _READ.clear()
    out = g.read(g.cols(xs(4), how="column", hold=True))
    with pytest.raises(orc.DispatchError, match=r"'cols' (read )?rank by rank.*result is refused"):
        async for _ in out:
            pass


def test_columns_apart_names_a_generators_outputs_by_their_place():
    """Two outputs of one rank were both named "rank 0's result"."""
    from orchestra._wire import Output, PartInfo, columns_apart

    def out(b: Batch) -> Output:
        return Output(0, parts=(PartInfo(b, len(b), b.nbytes),), keys=tuple(b.keys()), schema=b._schema())

    why = columns_apart([out(xs(2)), out(Batch.from_dict({"x": torch.zeros(2)}))])
    assert why is not None and "rank 0's output 1 (of a generator) and rank 0's output 0" in why
    assert columns_apart([out(xs(2)), out(xs(0).select()), out(xs(3))]) is None  # no rows: left out


def test_concat_names_a_numpy_column_of_another_row_shape():
    """np.concatenate's own message named neither the column nor the batch."""
    a = Batch.from_dict({"e": np.zeros((2, 3))})
    b = Batch.from_dict({"e": np.zeros((2, 4))})
    with pytest.raises(ValueError, match=r"column 'e' of batch 1 has rows of shape \(4,\)"):
        Batch.concat([a, b])


async def test_a_long_chain_of_reads_rank_by_rank_holds_each_input_once(groups):
    """Each call of ``out = g.read(out)`` sent before its input's headers were here copied every earlier unchecked
    read into its own list (call k held k), so a loop of 1 500 such calls took twice as long as before the check
    (12.7 s against 5.9 s). A call now holds its own inputs only, and its end checks the chain once."""
    g = groups[2]
    _READ.clear()
    out = g.cols(xs(4), how="same", hold=True)  # same columns on every rank: the chain is good
    chain = []
    for _ in range(50):
        out = g.echo(out)
        chain.append(out._inv)
    assert max(len(c._read_apart) + len(c._apart_inputs) for c in chain) <= 2
    _READ.set()
    assert (await out)["y"].tolist() == [0, 2, 4, 6]
    assert all(c._columns_ok and not c._apart_inputs for c in chain)


async def test_a_stream_over_a_union_of_streams_one_behind_the_other_waits_for_it(groups):
    """While one source of the union had its next part and the other not yet, the loop pairing them spun without
    awaiting: the event loop ran nothing else (the late part could never be delivered) and the call hung at 100 %
    CPU, deaf to timeouts."""
    g = groups[2]
    out = await g.read.options(stream=True)(g.gen(xs(8)) | g.late_gen(xs(8)))
    assert sorted(out.keys()) == ["late", "x"] and (out["late"] - out["x"]).tolist() == [1] * 8


async def test_a_call_two_reads_down_from_a_read_rank_by_rank_is_refused_before_sending(groups):
    """Only the input's own reads were looked at before sending: a call two steps down from a refused read ran on
    every rank (an optimizer step's side effect stays) and was refused only at its end. The upstream's verdict now
    reaches every call computed from it as soon as its headers are all here. (read returns the rows it read, so
    its own headers disagree too: echo is refused for whichever of cols and read finished first at the controller;
    the local backend's reply order is not fixed, and a match on cols alone failed 3 runs in 40.)"""
    g, g3 = groups[2], groups[3]
    _READ.clear()
    up = g.cols(xs(6), how="kind", hold=True)
    second = g.echo(g.read(up))  # both aligned, sent before rank 1's header of up was here
    await up.wait()
    before = await runs(g3)
    with pytest.raises(orc.DispatchError,
                       match=r"'echo', was computed from the future of .*'(cols|read)' read rank by rank"):
        await g3.read(second)
    assert _reads(await runs(g3)) == _reads(before)
    with pytest.raises(orc.DispatchError, match="refused"):
        await second


def test_structured_numpy_columns_are_compared_as_concat_joins_them():
    """The first header check took a structured dtype's full text: columns that concat joins (fields of another
    width, or another layout) were refused by every reader, though await joined them."""
    from orchestra._wire import Output, PartInfo, columns_apart

    def out(rank: int, a: np.ndarray) -> Output:
        b = Batch.from_dict({"s": a})
        return Output(rank, parts=(PartInfo(b, len(b), b.nbytes),), keys=tuple(b.keys()), schema=b._schema())

    narrow = np.zeros(2, dtype=[("a", "<i4")])
    wide = np.zeros(2, dtype=[("a", "<i8")])
    other = np.zeros(2, dtype=[("b", "<i8")])
    assert len(Batch.concat([Batch.from_dict({"s": narrow}), Batch.from_dict({"s": wide})])) == 4
    assert columns_apart([out(0, narrow), out(1, wide)]) is None
    why = columns_apart([out(0, narrow), out(1, other)])
    assert why is not None and "structured dtypes" in why
