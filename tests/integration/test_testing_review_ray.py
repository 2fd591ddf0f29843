"""What the adversarial review of orchestra.testing found, on Ray (one 1-rank group for the module's checks; the
in-process side, and the plugin's reports, are in tests/unit/core/test_testing_review_local.py and
test_testing_plugin_review.py): a cancelled call waiting on a Sequencer gives its position back (sync and async
endpoints), a stream that fails after a ``break`` is a failure nobody awaited, and the report of an unawaited
reader of a failed upstream names the upstream's error."""

from __future__ import annotations

import asyncio

import pytest
import torch
from testing_review_workers import Turns

import orchestra as orc
from orchestra import Batch
from orchestra.testing import Sequencer


async def test_a_cancelled_call_gives_its_sequencer_position_back_and_failures_are_reported(make_group):
    g = await make_group(Turns, ranks=1, group_name="T")
    for ep in ("wait_turn", "await_turn"):  # one group for both: a Ray group's start is most of this test's cost
        seq, started = Sequencer(timeout=30), Sequencer(timeout=30)
        try:
            fut = getattr(g, ep)(seq, 1, started)
            async with started(1):  # the call has passed position 0 of ``started``: it waits for position 1 of seq
                pass
            fut.cancel()
            with pytest.raises(orc.CallCancelledError):
                await fut
            assert await g.noop() == [0]  # the rank's compute lane is free: the cancelled call ended
            async with seq(0):
                pass
            async with seq(1):  # was: "position 1 was entered twice" (the cancelled call's wait held it)
                pass
        finally:
            seq.close()
            started.close()

    seq = Sequencer(timeout=30)
    try:
        async for _ in g.fail_after_first(Batch.from_dict({"x": torch.arange(4)}), seq):
            break
        async with seq(0):
            pass
        assert await g.noop() == [0]  # after the stream on the rank's compute lane: it has failed by now
        while g.calls_in_flight():  # its end reaches the controller in its own time (Ray orders no two replies)
            await asyncio.sleep(0.01)
        failed = g.failed_calls_not_awaited()
        assert len(failed) == 1 and failed[0].startswith("T.fail_after_first: WorkerError"), failed
        assert "second part failed on rank 0" in failed[0]
        g._shared.unseen.clear()  # seen here: the test's own check
    finally:
        seq.close()

    down = g.take(g.boom())
    await g.noop()
    failed = g.failed_calls_not_awaited()
    assert len(failed) == 1 and failed[0].startswith("T.take: WorkerError"), failed
    assert "boom on rank 0" in failed[0] and "rank 0, endpoint" in failed[0], failed
    assert "unknown location" not in failed[0] and "RayTaskError" not in failed[0], failed
    with pytest.raises(orc.WorkerError) as e:
        await down
    assert (e.value.group, e.value.rank, e.value.endpoint) == ("T", 0, "boom")
