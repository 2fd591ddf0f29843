"""A call's deadline (``.options(timeout=...)``) covers the whole call whether or not anyone awaits it: at the
deadline the call fails with CallTimeoutError and its ranks are cancelled, on both backends. (A deadline used to be
checked only by an awaiter: a call nobody awaited ran past it, and a late await returned its result.)"""

from __future__ import annotations

import anyio
import pytest
import torch

import orchestra as orc
from orchestra import Batch


@pytest.mark.parametrize("rows", [4, 40_000])  # sent at once with the call; stored first (the general path)
async def test_a_deadline_cancels_a_call_nobody_awaits(bed, seq, rows):
    g = bed["e2"]
    # 2 s: time for both ranks to start the call on a loaded machine (a deadline before that skips it there)
    fut = g.hold_rows_until_cancelled.options(timeout=2.0)(Batch.from_dict({"x": torch.arange(rows)}), seq)
    async with seq(2):  # both ranks run the call now; from here on nobody awaits it
        pass
    with anyio.fail_after(60):  # a bound on a broken build: queued behind the held call, this ends only with it
        outcomes = await g.take_outcomes()
    assert outcomes == [[f"cancelled with {rows} rows"]] * 2  # the deadline alone ended it on every rank
    assert fut.done()
    with pytest.raises(orc.CallTimeoutError) as info:
        await fut
    assert list(info.value.pending_ranks) == [0, 1]
