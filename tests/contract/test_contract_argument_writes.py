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
