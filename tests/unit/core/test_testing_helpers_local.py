"""orchestra.testing's helpers and the group state they read, on the in-process backend (no Ray): kill_rank on a
group that already has a dead rank, a Sequencer wait given up before its turn, what a group keeps of failures nobody
awaited once it is closed, and errors raised by ``on_death`` callbacks. The Ray Sequencer's side of the cancelled
wait is in tests/integration/test_testing_plugin.py."""

from __future__ import annotations

import asyncio

import pytest

import orchestra as orc
from orchestra import ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra.testing import Sequencer, SequencerError, kill_rank


class Plain(Worker):
    @endpoint(D.broadcast())
    def work(self) -> int:
        return self.rank

    @endpoint(D.broadcast())
    def boom(self, msg: str) -> None:
        raise ValueError(msg)

    @endpoint(D.broadcast())
    def hold(self, seq: Sequencer) -> None:
        with seq(1):  # held until position 0 ran
            pass


def group(ranks: int) -> WorkerGroup:
    return WorkerGroup(ResourcePool(process_on_nodes=[ranks], cpus_per_worker=0.01, backend="local"), Plain)


pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails


# -- kill_rank -------------------------------------------------------------------------------------------------------
async def test_kill_rank_kills_another_rank_of_a_group_with_a_dead_rank():
    g = await group(2).ready()
    try:
        assert (await kill_rank(g, 1)).rank == 1
        err = await kill_rank(g, 0)  # was: WorkerDiedError for rank 1, from describing every rank first
        assert isinstance(err, orc.WorkerDiedError) and err.rank == 0
        assert [h["alive"] for h in g.health()] == [False, False]
    finally:
        await g.aclose()


async def test_kill_rank_of_a_rank_already_dead_says_so():
    g = await group(2).ready()
    try:
        await kill_rank(g, 1)
        with pytest.raises(RuntimeError, match=r"kill_rank: rank 1 of .* is already dead"):
            await kill_rank(g, 1)
    finally:
        await g.aclose()


# -- Sequencer -------------------------------------------------------------------------------------------------------
async def test_a_wait_cancelled_before_its_turn_gives_the_position_back():
    """The test stops waiting for position 1 (cancelled) before position 0 ran: position 1 was never entered, so it
    can be entered again later, and position 2 after it; the abandoned wait takes nothing."""
    s = Sequencer(backend="local")
    try:
        async def enter_one() -> None:
            async with s(1):
                raise AssertionError("position 1 ran although its wait was cancelled")

        waiter = asyncio.create_task(enter_one())
        while 1 not in s._local.entered:  # the wait has arrived on the sequence (a thread registers it)
            await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        async with s(0):
            pass
        async with s(1):  # was: "position 1 was entered twice" (the abandoned wait held it)
            pass
        async with s(2):  # was: timed out, blaming position 1
            pass
        assert s.position() == 3
    finally:
        s.close()


async def test_a_wait_that_timed_out_gives_the_position_back():
    """Position 1 cannot come before position 0 ran, so its wait times out whatever the machine's speed; it never
    entered, so position 1 can be waited for again (was: "entered twice")."""
    s = Sequencer(timeout=0.05, backend="local")
    try:
        with pytest.raises(SequencerError, match=r"position 1 still waiting after 0.05 s: .* at position 0"):
            async with s(1):
                pass
        async with s(0):
            pass
        async with s(1):
            pass
        assert s.position() == 2
    finally:
        s.close()


def test_a_position_is_an_int_not_a_bool():
    s = Sequencer(backend="local")
    try:
        with pytest.raises(ValueError, match="got True"):
            s(True)
    finally:
        s.close()


# -- what a group keeps for tests ------------------------------------------------------------------------------------
async def test_failed_calls_not_awaited_are_still_listed_after_the_group_closed(caplog):
    g = await group(1).ready()
    g.boom("nobody saw me")
    assert await g.work() == [0]  # sent after boom, to the same rank: boom has failed by now
    assert [c.split(":")[0] for c in g.failed_calls_not_awaited()] == ["Plain.boom"]
    await g.aclose()
    listed = g.failed_calls_not_awaited()  # was: [] (closing emptied the list into a log line)
    assert len(listed) == 1 and listed[0].startswith("Plain.boom: WorkerError") and "nobody saw me" in listed[0]
    assert "a call failed and nothing awaited it" in caplog.text  # and the close still logs it


async def test_a_call_ended_by_closing_its_group_is_no_failure_nobody_awaited(caplog):
    """Closing a group ends its calls (GroupClosedError): the closer's own act, like ``fut.cancel()``; such a call
    is not listed (was: listed once its rank's work ended after the close), and nothing is logged at ERROR."""
    g = await group(1).ready()
    s = Sequencer(backend="local")
    try:
        g.hold(s)
        await g.aclose()
        assert g.failed_calls_not_awaited() == []
        assert g.calls_in_flight() == []
    finally:
        s.close()
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []


async def test_an_error_raised_by_an_on_death_callback_is_kept_and_the_other_callbacks_are_told(caplog):
    g = await group(1).ready()
    told = []

    def bad(err: orc.WorkerDiedError) -> None:
        assert err.rank == 5, "my callback's assertion failed"

    g.on_death(bad)
    g.on_death(told.append)
    try:
        await kill_rank(g, 0)  # its own on_death callback is told after the bad one
        assert [e.rank for e in told] == [0]
        errors = g.death_callback_errors()
        assert len(errors) == 1, errors
        assert "bad" in errors[0] and "rank 0" in errors[0] and "my callback's assertion failed" in errors[0]
        assert "on_death callback" in caplog.text  # still logged where it happened
    finally:
        await g.aclose()
    assert g.death_callback_errors() == errors  # kept after close, like failed_calls_not_awaited()

