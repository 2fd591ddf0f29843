"""What orchestra.testing reports and how its Sequencer waits, on the in-process backend (no Ray), for the cases an
adversarial review of the plugin found wrong:

- a call counts as seen when its outcome was handed to someone (a wait that returned it or raised its error, a call
  that read it), not when a wait merely started: a stream read with ``async for ...: break`` that fails later is a
  failure nobody awaited, and one abandoned while producing is not "read elsewhere";
- a stream whose iteration stopped before its end is listed by ``streams_not_drained()``;
- the report of an unawaited call that read a failed upstream names the upstream's error, as ``await`` does;
- closing an in-process group waits for its ranks' compute threads (an endpoint that never polls ``cancelled()``);
- a Sequencer wait inside a cancelled call gives its position back and ends the call (sync and async endpoints);
- the in-process Sequencer takes any number of concurrent async waits (no thread per waiter), and its timeout names
  the position that never arrived.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra.testing import Sequencer, SequencerError

_INTEGRATION = Path(__file__).resolve().parents[2] / "integration"
if str(_INTEGRATION) not in sys.path:
    sys.path.insert(0, str(_INTEGRATION))
from testing_review_workers import Reports  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails

EVENTS: list[tuple[str, int]] = []


class Flag(threading.Event):
    """A threading.Event passed to in-process ranks by reference (never pickled), as the local Sequencer is."""

    _orc_in_process = True


class Streams(Reports):
    @endpoint(D.shard())
    def held_after_first(self, batch: Batch, seq: Sequencer):
        yield batch.slice(0, 1)
        with seq(1):
            pass
        yield batch.slice(1, len(batch))

    @endpoint(D.shard())
    def pieces(self, batch: Batch, n: int = 4):
        yield from batch.chunk(n)

    @endpoint(D.broadcast())
    def block_until(self, started: Flag, release: Flag) -> str:
        """Never polls ``cancelled()``: runs until the test sets ``release``."""
        started.set()
        release.wait(30)
        EVENTS.append(("block_until", self.rank))
        return "done"

    @endpoint(D.broadcast())
    def wait_turn(self, seq: Sequencer, pos: int, started: Flag) -> int:
        started.set()
        with seq(pos):
            EVENTS.append(("wait_turn", pos))
        return pos

    @endpoint(D.broadcast())
    async def await_turn(self, seq: Sequencer, pos: int, started: Flag) -> int:
        started.set()
        async with seq(pos):
            EVENTS.append(("await_turn", pos))
        return pos


def group(ranks: int = 1, name: str | None = None) -> WorkerGroup:
    return WorkerGroup(ResourcePool(process_on_nodes=[ranks], cpus_per_worker=0.01, backend="local"), Streams,
                       group_name=name)


def rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


async def until_set(ev: threading.Event) -> None:
    """Until a rank set ``ev`` (a thread of the rank's: polled without blocking the loop)."""
    while not ev.is_set():
        await asyncio.sleep(0.005)


async def until_finished(g: WorkerGroup) -> None:
    """Until no call of ``g`` is in flight (a stream's end reaches the controller after its rank's next reply)."""
    while g.calls_in_flight():
        await asyncio.sleep(0.005)


# -- item 1: seen when the outcome is handed out, not when a wait starts ----------------------------------------------
async def test_a_stream_that_fails_after_the_part_a_break_read_is_a_failure_nobody_awaited(seq):
    """``async for part in fut: break`` took the first part; the stream fails after that. Nothing saw the failure:
    it is listed (was: the iteration's start marked the call as looked at, so it was never listed)."""
    async with group(name="S") as g:
        fut = g.fail_after_first(rows(4), seq)
        async for _ in fut:
            break
        async with seq(0):
            pass
        assert await g.noop() == [0]  # after the stream on the rank's compute lane: it has failed by now
        failed = g.failed_calls_not_awaited()
        assert len(failed) == 1 and failed[0].startswith("S.fail_after_first: WorkerError"), failed
        assert "second part failed on rank 0" in failed[0]
        with pytest.raises(orc.WorkerError, match="second part failed"):
            await fut
        assert g.failed_calls_not_awaited() == []  # awaited now: its error was handed out


async def test_a_stream_abandoned_while_producing_is_in_flight_and_not_read_elsewhere(seq):
    """A stream left after its first part while it still produces is a call in flight that nothing reads: the
    plugin reports it at once (was: ``read_elsewhere()`` was True, so the plugin waited for it to end, then
    passed)."""
    async with group(name="S") as g:
        fut = g.held_after_first(rows(4), seq)
        async for _ in fut:
            break
        assert g.calls_in_flight() == ["S.held_after_first"]
        assert not fut._inv.read_elsewhere()
        async with seq(0):
            pass
        await until_finished(g)
        assert g.streams_not_drained() == ["S.held_after_first"]


async def test_a_stream_whose_iteration_stopped_before_its_end_is_not_drained():
    """The producer finished, the test read one part of four and stopped: ``streams_not_drained()`` lists it (the
    plugin fails such a test, as docs/testing.md says: "a stream never drained"); a stream read to its end, or
    awaited after the break, or cancelled, is not listed."""
    async with group(ranks=2, name="S") as g:
        fut = g.pieces(rows(8))
        async for _ in fut:
            break
        await until_finished(g)
        assert g.streams_not_drained() == ["S.pieces"]
        assert len(await fut) == 8
        assert g.streams_not_drained() == []

        drained = g.pieces(rows(8))
        assert len([p async for p in drained]) == 8
        cancelled = g.pieces(rows(8))
        async for _ in cancelled:
            break
        cancelled.cancel()
        assert g.streams_not_drained() == []


async def test_a_wait_that_only_started_does_not_count_as_seen(seq):
    """A wait on a call that the caller cancels (``asyncio.wait_for`` timing out) ends the call: not a failure
    nobody awaited. A wait that raised the call's error saw it; one that returned its value saw it too."""
    async with group(name="S") as g:
        fut = g.held_after_first(rows(4), seq)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut.wait(), 0.05)
        with pytest.raises(orc.CallCancelledError):
            await fut
        async with seq(0):
            pass
        assert await g.noop() == [0]
        assert g.failed_calls_not_awaited() == [] and g.calls_in_flight() == []
        with pytest.raises(orc.WorkerError, match="boom on rank 0"):
            await g.boom()
        assert g.failed_calls_not_awaited() == []


async def test_a_call_another_call_read_is_read_elsewhere_and_its_failure_is_not_listed_twice():
    """``h.take(up)``: the reader's ranks read ``up``; once the reader finished, ``up`` counts as read elsewhere
    (its replies may still be on their way). A failed upstream read by a call nobody awaited is reported once,
    through that call, with the upstream's own error (item 6)."""
    async with group(name="G") as g, group(name="H") as h:
        up = g.noop()
        assert await h.take(up) == ["list"]
        assert up._inv.read_elsewhere()
        up2 = g.boom()
        down = h.take(up2)
        await g.noop()
        await h.noop()
        assert g.failed_calls_not_awaited() == []
        failed = h.failed_calls_not_awaited()
        assert len(failed) == 1 and failed[0].startswith("H.take: WorkerError"), failed
        # the upstream's error, as ``await down`` raises it: its group, rank and endpoint, not "UpstreamFailed"
        assert "boom on rank 0" in failed[0] and "rank 0, endpoint" in failed[0], failed
        assert "UpstreamFailed" not in failed[0] and "unknown location" not in failed[0], failed
        with pytest.raises(orc.WorkerError) as e:
            await down
        assert (e.value.group, e.value.rank, e.value.endpoint) == ("G", 0, "boom")
        assert h.failed_calls_not_awaited() == []


# -- item 2: closing an in-process group waits for its compute threads ----------------------------------------------
async def test_closing_an_in_process_group_waits_for_an_endpoint_that_never_polls():
    """A cancelled call whose endpoint never polls ``cancelled()`` runs on in its rank's compute thread; closing
    the group returns only once that thread ended (was: at once, the endpoint running into the next test)."""
    EVENTS.clear()
    started, release = Flag(), Flag()
    g = group(ranks=2, name="L")
    await g.ready()
    hosts = list(g._shared.hosts)
    fut = g.block_until(started, release)
    await until_set(started)
    fut.cancel()
    assert hosts[0].running() == ["block_until"]
    releaser = threading.Timer(0.2, release.set)  # the endpoint returns a little later, while the close waits
    releaser.start()
    try:
        await g.aclose()
        assert sorted(EVENTS) == [("block_until", 0), ("block_until", 1)]  # ended before the close returned
        assert [h.running() for h in hosts] == [[], []]
    finally:
        release.set()
        releaser.join()


async def test_make_group_teardown_names_an_in_process_rank_still_running(monkeypatch):
    """An endpoint still running when the bounds have passed fails the teardown, naming group, rank and endpoint
    (was: the rank's watch call failed at once, which counted as a death, and the test passed)."""
    from orchestra.testing import _plugin

    monkeypatch.setattr("orchestra._group.EXIT_WAIT_S", 0.05)
    started, release = Flag(), Flag()
    factory = _plugin.GroupFactory(asyncio.get_running_loop())
    g = await factory(Streams, ranks=1, group_name="Stuck", backend="local", cpus_per_worker=0.01)
    host = g._shared.hosts[0]
    try:
        fut = g.block_until(started, release)
        await until_set(started)
        fut.cancel()
        problems = await _plugin.close_and_check(factory, set(), bound=0.05)
        assert problems == ["<WorkerGroup 'Stuck' Streams x1> rank 0: still running endpoint 'block_until' 0.05 s "
                            "after the group closed (an in-process rank's thread cannot be killed: make the endpoint "
                            "return when self.cancelled() is True)"], problems
    finally:
        release.set()
    assert host.wait_stopped(10) == []


# -- item 3: a Sequencer wait inside a cancelled call gives its position back ----------------------------------------
@pytest.mark.parametrize("ep", ["wait_turn", "await_turn"])
async def test_a_cancelled_call_waiting_on_a_sequencer_gives_its_position_back(seq, ep):
    """The call waits for position 1 and is cancelled: its wait gives position 1 back and the call ends (its
    block never runs); the test then enters positions 0 and 1 itself (was: "position 1 was entered twice", and
    the cancelled call's block ran after its cancellation)."""
    EVENTS.clear()
    started = Flag()
    async with group(name="Q") as g:
        fut = getattr(g, ep)(seq, 1, started)
        await until_set(started)
        fut.cancel()
        with pytest.raises(orc.CallCancelledError):
            await fut
        async with seq(0):  # the rank's wait may not have seen its cancellation yet: position 1 waits for it
            pass
        async with seq(1):
            pass
        assert await g.noop() == [0]  # the rank's compute lane is free: the cancelled call ended
        assert EVENTS == []
        assert seq.position() == 2


async def test_a_second_wait_for_a_held_position_is_told_it_was_entered_twice_once_the_holder_exits():
    """Position 1 is held by a wait; a second wait for it waits too (the holder may give it back, as a cancelled
    call's wait does, on Ray only once let in): when the holder exits its block, the second fails with "entered
    twice"."""
    s = Sequencer(timeout=20, backend="local")
    release = asyncio.Event()

    async def hold_one() -> None:
        async with s(1):
            await release.wait()
    first = asyncio.create_task(hold_one())
    second: asyncio.Task | None = None
    try:
        while 1 not in s._local.entered:
            await asyncio.sleep(0)
        second = asyncio.create_task(_enter_and_leave(s, 1))
        while not s._local.queued:  # the second wait arrived: it waits behind the first
            await asyncio.sleep(0)
        async with s(0):
            pass
        while 1 not in s._local.inside:  # the holder runs its block; the second wait still waits
            await asyncio.sleep(0)
        assert not second.done()
        release.set()
        with pytest.raises(SequencerError, match="position 1 was entered twice"):
            await second
    finally:  # every task ends here
        release.set()
        await first
        if second is not None and not second.done():
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
        s.close()


async def _enter_and_leave(s: Sequencer, pos: int) -> None:
    async with s(pos):
        pass


# -- item 4: many concurrent async waits on the in-process Sequencer ---------------------------------------------------
async def test_more_concurrent_async_waits_than_worker_threads_run_in_order():
    """45 ``async with seq(i)`` made in reverse order (more than anyio's 40 worker threads): each takes its turn
    (was: position 0 never got a thread, and the timeout blamed position 0)."""
    s = Sequencer(timeout=20, backend="local")
    order: list[int] = []

    async def step(i: int) -> None:
        async with s(i):
            order.append(i)
    try:
        await asyncio.gather(*[step(i) for i in reversed(range(45))])
    finally:
        s.close()
    assert order == list(range(45))


async def test_a_sequencer_timeout_names_the_position_that_never_arrived():
    s = Sequencer(timeout=0.05, backend="local")
    try:
        with pytest.raises(SequencerError, match=r"position 0 has not arrived \(no wait for it started\)"):
            async with s(1):
                pass
    finally:
        s.close()


async def test_more_groups_than_worker_threads_close_at_once():
    """41 groups close at once while each rank runs an endpoint that a 42nd close releases: every close waits in a
    thread of its own (was: anyio's 40 default threads were all taken by waiting closes, so the 42nd close never
    started and nothing ended before the endpoints' own 30 s bound)."""
    blocked = [group(name=f"C{i}") for i in range(41)]
    last = group(name="Last")
    await asyncio.gather(*[g.ready() for g in [*blocked, last]])
    release = Flag()
    started = [Flag() for _ in blocked]
    futs = [g.block_until(ev, release) for g, ev in zip(blocked, started)]
    for ev in started:
        await until_set(ev)
    for f in futs:
        f.cancel()

    async def close_last_then_release() -> None:
        await asyncio.sleep(0)  # after every other close took its thread
        await last.aclose()
        release.set()
    try:
        await asyncio.wait_for(asyncio.gather(*[g.aclose() for g in blocked], close_last_then_release()), 20)
    finally:
        release.set()
    assert all(g.closed for g in [*blocked, last])
