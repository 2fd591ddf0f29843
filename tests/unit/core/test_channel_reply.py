"""A fast-path reply runs its call's bookkeeping callback as it arrives (``ChannelReply.first``), exactly once."""

from __future__ import annotations

import asyncio

from orchestra._channel import ChannelReply


async def test_the_first_callback_runs_as_the_reply_arrives_and_only_once():
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, object]] = []
    reply = ChannelReply("fast-x-1", 0, asyncio.Future(loop=loop), None)  # type: ignore[arg-type]
    first = lambda f: seen.append(("first", f.result()))  # noqa: E731
    reply.out.add_done_callback(first)
    reply.out.add_done_callback(lambda f: seen.append(("later", f.result())))
    reply.first = first
    reply.settle(7)
    assert seen == [("first", 7)]  # at once, before any turn of the loop
    await asyncio.sleep(0)
    assert seen == [("first", 7), ("later", 7)]  # the other callbacks as asyncio runs them; ``first`` not again


async def test_a_reply_completed_another_way_runs_first_as_a_plain_callback():
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    reply = ChannelReply("fast-x-2", 0, asyncio.Future(loop=loop), None)  # type: ignore[arg-type]
    first = lambda f: seen.append("first")  # noqa: E731
    reply.out.add_done_callback(first)
    reply.first = first
    reply.out.set_exception(ConnectionError("rank gone"))  # a lost rank, a closed channel: not through settle
    reply.out.exception()
    await asyncio.sleep(0)
    assert seen == ["first"]


async def test_a_failing_first_callback_is_reported_as_the_loop_reports_a_failed_callback():
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        reply = ChannelReply("fast-x-3", 0, asyncio.Future(loop=loop), None)  # type: ignore[arg-type]

        def first(f: asyncio.Future) -> None:
            raise RuntimeError("bookkeeping broke")

        reply.out.add_done_callback(first)
        reply.first = first
        reply.settle(None, ValueError("the rank's error"))
        assert isinstance(reply.out.exception(), ValueError)
        assert len(reported) == 1 and isinstance(reported[0]["exception"], RuntimeError)
        assert "fast-x-3" in reported[0]["message"]
    finally:
        loop.set_exception_handler(old)
