"""``Invocation._wait_some``: the wait of ``await fut`` (every rank's reply, the first failure, or the call's early
end, under the deadline). Driven on a bare event loop, no backend: the interleavings are fixed by scheduling."""

from __future__ import annotations

import asyncio

from orchestra._invocation import Invocation


def _bare(loop: asyncio.AbstractEventLoop, deadline_in: float | None) -> Invocation:
    inv = object.__new__(Invocation)
    inv.loop, inv.error, inv._ended = loop, None, None
    inv.timeout = deadline_in
    inv.deadline = None if deadline_in is None else loop.time() + deadline_in
    return inv


async def test_a_reply_in_the_same_loop_turn_as_the_deadline_counts():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, 0.0)  # the deadline's timer is due at the next loop turn
    reply = loop.create_future()
    loop.call_soon(reply.set_result, "ok")  # ... and the reply lands in that same turn, before the timer runs
    # the timer's callback runs before the reply's done-callback (scheduled by set_result): the waiter says
    # "deadline", yet the reply is there and must count
    assert await inv._wait_some({reply}) is True
    assert reply.result() == "ok"


async def test_the_deadline_wins_when_no_reply_came():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, 0.0)
    reply = loop.create_future()
    assert await inv._wait_some({reply}) is False
    reply.cancel()


async def test_a_failure_wakes_the_wait_while_another_rank_still_runs():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, None)
    slow, failed = loop.create_future(), loop.create_future()
    loop.call_soon(failed.set_exception, RuntimeError("rank 1"))
    assert await inv._wait_some({slow, failed}) is True
    assert not slow.done()
    slow.cancel()


async def test_an_early_end_wakes_the_wait():
    loop = asyncio.get_running_loop()
    inv = _bare(loop, None)
    blocked = loop.create_future()
    ended = inv.ended()
    loop.call_soon(lambda: (ended.set_exception(RuntimeError("sibling died")), ended.exception()))
    assert await inv._wait_some({blocked}) is True
    assert not blocked.done()
    assert not ended._callbacks  # its wake-up callback was removed again
    blocked.cancel()
