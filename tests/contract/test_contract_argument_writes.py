"""A Batch handed to a call is read when the call is sent. A call sent at once with the call (a small Batch, a ready
group, nothing queued) has its rows already: the caller's later writes cannot reach it. A call sent later (a large
Batch, stored first; a union with a future; a group still starting; calls queued before it) fails with a
DispatchError naming the column if the caller wrote into one of its Batches in between: it used to send the rows as
they were at send time, or a mix of old and new, and say nothing."""

from __future__ import annotations

import pytest
import torch

import orchestra as orc
from orchestra import Batch


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n), "y": torch.zeros(n)})


@pytest.mark.parametrize("how", ["large", "union", "replaced column", "added column"])
async def test_a_batch_written_after_its_call_was_made_fails_the_call(bed, how):
    g = bed["e2"]
    if how == "union":  # a future's rows joined with a Batch of the caller's: the call is sent once the future's is
        mine = Batch.from_dict({"y": torch.zeros(4)})
        fut = g.echo(g.echo(Batch.from_dict({"x": torch.arange(4)})) | mine)
    else:
        mine = xs(40_000 if how == "large" else 4)
        if how != "large":  # a small Batch is sent at once unless a call is queued before it: queue one
            g.echo(g.echo(xs(4)))
        fut = g.echo(mine)
    if how == "replaced column":
        mine["y"] = mine["y"] + 1
    elif how == "added column":
        mine["z"] = mine["y"]
    else:
        mine["y"].add_(1)
    with pytest.raises(orc.DispatchError, match=r"written after the call was made.*'[yz]'"):
        await fut
    assert (await g.echo(xs(8)))["x"].tolist() == list(range(8))  # the group is fine


async def test_a_batch_written_before_its_call_is_sent_as_written(bed):
    g = bed["e2"]
    mine = xs(40_000)
    mine["y"].add_(1)
    out = await g.echo(mine)
    assert bool((out["y"] == 1).all())
    mine["y"].add_(1)  # after the await: changes nothing the call had
    assert bool((out["y"] == 1).all())


async def test_a_non_tensor_column_written_after_a_large_call_was_made_fails_the_call(bed):
    g = bed["e2"]
    mine = Batch.from_dict({"x": torch.arange(40_000), "tag": ["a"] * 40_000})
    fut = g.echo(mine)
    mine["tag"][3] = "b"
    with pytest.raises(orc.DispatchError, match=r"written after the call was made \(column 'tag' changed\)"):
        await fut


@pytest.mark.parametrize("how", ["queued", "reads a future"])
async def test_a_plain_argument_of_a_call_sent_later_is_as_it_was_when_the_call_was_made(bed, how):
    """A call's other arguments (a dict, a list, an array, a tensor) are taken when the call is made, as a call
    sent at once takes them: a caller's write before the call is sent reaches no rank. They were read at send time,
    with no check, so the ranks got the values as written (or, on the fast path, a reader of a call still running
    got them as they were when that call replied, where the general path sent them at once)."""
    import numpy as np

    g = bed["e2"]
    cfg = {"k": "orig", "lst": [1], "arr": np.zeros(3), "t": torch.zeros(3)}
    offsets = [10, 20]
    if how == "queued":  # a call queued before it: it is sent when that one is
        g.echo(g.echo(xs(4)))
        fut = g.take_value(cfg)
        rows = g.offset_rows(xs(4), offsets)
    else:  # it reads a future: it is sent once that call's outputs are known
        g.take_value(g.make_value())  # queued before it, reading a future
        fut = g.take_value(cfg)
        rows = g.offset_rows(g.echo(xs(4)), offsets)
    cfg["k"], cfg["arr"][0], cfg["t"][0] = "changed", 7.0, 7.0
    cfg["lst"].append(2)
    offsets[0] = 1000
    for got in await fut:  # one per rank
        assert got["k"] == "orig" and got["lst"] == [1]
        assert got["arr"].tolist() == [0.0] * 3 and got["t"].tolist() == [0.0] * 3
    assert (await rows)["x"].tolist() == [10, 11, 22, 23]


@pytest.mark.parametrize("how", ["negative zero", "object in place", "meta in place"])
async def test_a_batch_written_in_place_beyond_its_tensors_fails_a_call_sent_later(bed, how):
    """A write the check missed: -0.0 over 0.0 in a numeric column (equal as numbers, not as bytes), an object of
    an object column changed in place, and a meta value changed in place (compared by identity before)."""
    import numpy as np

    g = bed["e2"]
    mine = Batch.from_dict({"x": torch.arange(4), "f": np.zeros(4), "o": [{"i": 1} for _ in range(4)]})
    mine.meta["cfg"] = {"lr": 0.1}
    g.echo(g.echo(xs(4)))  # queued before it: the call is sent later
    fut = g.echo(mine)
    if how == "negative zero":
        mine["f"][1] = -0.0
    elif how == "object in place":
        mine["o"][0]["i"] = 100
    else:
        mine.meta["cfg"]["lr"] = 100
    with pytest.raises(orc.DispatchError, match=r"written after the call was made"):
        await fut
    assert (await g.echo(xs(8)))["x"].tolist() == list(range(8))


@pytest.mark.parametrize("how", ["leaf added", "leaf removed"])
async def test_a_nested_column_given_a_leaf_after_a_call_was_made_fails_the_call(bed, how):
    """The check compared the top-level names and the leaves it had seen: a leaf added under a nested column went out
    with the call, unnamed."""
    from orchestra._tensordict import TensorDict

    g = bed["e2"]
    n = 4
    nested = TensorDict({"p": torch.zeros(n), **({"q": torch.ones(n)} if how == "leaf removed" else {})},
                        batch_size=[n])
    mine = Batch(TensorDict({"x": torch.arange(n), "n": nested}, batch_size=[n]))
    g.echo(g.echo(xs(4)))  # queued before it: the call is sent later
    fut = g.echo(mine)
    if how == "leaf added":
        mine.tensors["n"]["q"] = torch.ones(n)
    else:
        del mine.tensors["n"]["q"]
    with pytest.raises(orc.DispatchError, match=r"written after the call was made.*\('n', 'q'\) (added|removed)"):
        await fut
    assert (await g.echo(xs(8)))["x"].tolist() == list(range(8))
