"""``Invocation._wait_some``: the wait of ``await fut`` (every rank's reply, the first failure, or the call's early
end, under the deadline), woken by the call's own hooks (a slot's output done, a slot's failure, the call's end)
rather than by a callback on each future. Driven on a bare event loop, no backend: the interleavings are fixed by
scheduling."""

from __future__ import annotations

import asyncio
import types

from orchestra._errors import CallCancelledError
from orchestra._invocation import Invocation


def _bare(loop: asyncio.AbstractEventLoop, deadline_in: float | None, ranks: int = 1) -> Invocation:
    """An invocation of ``ranks`` ranks already sent (its submission done), each slot's one output a bare future
    (``inv.outs``), nothing else running: what ``wait`` hands ``_wait_some``."""
    inv = object.__new__(Invocation)
    inv.loop, inv.error, inv._ended, inv._root, inv._ticket = loop, None, None, None, None
    inv.timeout = deadline_in
    inv.deadline = None if deadline_in is None else loop.time() + deadline_in
    inv.group, inv.endpoint = "g", "e"
    inv._wakes, inv._scan, inv._deadline_timer = [], 0, None
    inv._apart_dependents, inv._inputs_gone, inv._looked, inv._read, inv.upstreams = [], True, True, False, []
    inv.shared = types.SimpleNamespace(live=set(), hosts=[], note_unseen=lambda inv: None)
    inv.submitted = loop.create_future()
    inv.submitted.set_result(None)
    inv.slots, inv.outs = [], []
    for r in range(ranks):
        slot, out = inv._slot(r, True), loop.create_future()
        slot.add(object(), out)
        slot.finish()
        inv.slots.append(slot)
        inv.outs.append(out)
    return inv


async def test_every_reply_wakes_the_wait_once_all_are_in():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, None, ranks=3)
    for i, out in enumerate(inv.outs):
        loop.call_soon(out.set_result, i)
    assert await inv._wait_some(set(inv.outs)) is True
    assert all(o.done() for o in inv.outs) and inv._wakes == []


async def test_a_reply_in_the_same_loop_turn_as_the_deadline_counts():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, 0.0)  # the deadline's timer is due at the next loop turn
    (reply,) = inv.outs
    loop.call_soon(reply.set_result, "ok")  # ... and the reply lands in that same turn, before the timer runs
    # the timer's callback runs before the slot's done-callback (scheduled by set_result): the waiter says
    # "deadline", yet the reply is there and must count
    assert await inv._wait_some({reply}) is True
    assert reply.result() == "ok"


async def test_the_deadline_wins_when_no_reply_came():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, 0.0)
    assert await inv._wait_some(set(inv.outs)) is False
    assert inv._wakes == []  # its waiter is gone: a later reply wakes no one
    inv.outs[0].cancel()


async def test_a_failure_wakes_the_wait_while_another_rank_still_runs():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, None, ranks=2)
    slow, failed = inv.outs
    loop.call_soon(failed.set_exception, RuntimeError("rank 1"))
    assert await inv._wait_some({slow, failed}) is True
    assert not slow.done()
    slow.cancel()


async def test_an_early_end_wakes_the_wait():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, None)
    (blocked,) = inv.outs
    loop.call_soon(inv.fail, CallCancelledError("sibling died"))
    assert await inv._wait_some({blocked}) is True
    assert not blocked.done()
    blocked.cancel()


async def test_two_waits_of_one_call_are_both_woken():
    """Two tasks awaiting one call (a caller's await and a reader's) wait together: neither is left behind."""
    loop = asyncio.get_running_loop()
    inv = _bare(loop, None, ranks=2)
    waits = [asyncio.ensure_future(inv._wait_some(set(inv.outs))) for _ in range(2)]
    await asyncio.sleep(0)  # both are waiting
    for out in inv.outs:
        out.set_result(None)
    assert await asyncio.gather(*waits) == [True, True]


async def test_a_cancelled_wait_leaves_no_waiter_behind():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, None)
    task = asyncio.ensure_future(inv._wait_some(set(inv.outs)))
    await asyncio.sleep(0)
    assert len(inv._wakes) == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert inv._wakes == []
    inv.outs[0].set_result(None)
