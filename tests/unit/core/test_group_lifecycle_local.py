"""A group's life on the in-process backend: its share of a pool is given back exactly once whatever sequence of
close calls (or a failed start) happens, ``on_death`` hears of deaths that happened before it was registered,
cancelling an ``async for`` over a call not yet sent cancels the call, ``shutdown()`` from a thread other than the
group's event loop, and a group whose start-up was cut short by the end of its event loop.

The worker classes are the Ray tests' (``tests/integration/orc_test_workers.py``): the same code runs on both.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
import torch

import orchestra as orc
from orchestra import ResourcePool, WorkerGroup
from orchestra.testing import kill_rank

_INTEGRATION = Path(__file__).resolve().parents[2] / "integration"
if str(_INTEGRATION) not in sys.path:
    sys.path.insert(0, str(_INTEGRATION))
from orc_test_workers import Hazard, Scorer  # noqa: E402


class Broken(orc.Worker):
    """A worker whose construction fails on every rank."""

    def __init__(self) -> None:
        raise RuntimeError("bad config")


def rows(n: int) -> orc.Batch:
    return orc.Batch.from_dict({"x": torch.arange(n)})


def shared_pool() -> ResourcePool:
    """One slot that two groups may share (max_colocate_count=2)."""
    return ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01, max_colocate_count=2, backend="local")


async def _aclose(g: WorkerGroup) -> None:
    await g.aclose()


async def _shutdown(g: WorkerGroup) -> None:
    g.shutdown()


CLOSES: dict[str, Callable[[WorkerGroup], Awaitable[None]]] = {"aclose": _aclose, "shutdown": _shutdown}


# -- the pool reference: released once per group ----------------------------------------------------------------------
@pytest.mark.parametrize("first", sorted(CLOSES))
@pytest.mark.parametrize("second", sorted(CLOSES))
async def test_closing_a_group_twice_keeps_the_pool_another_group_holds(first, second):
    pool = shared_pool()
    a = WorkerGroup(pool, Hazard, group_name="A")
    b = WorkerGroup(pool, Hazard, group_name="B")
    try:
        await a.ready()
        await b.ready()
        await CLOSES[first](a)
        await CLOSES[second](a)
        assert pool.holds_refs(), "closing A twice gave back the pool reference B holds"
        assert await b.ping() == [0]
    finally:
        await b.aclose()
    assert not pool.holds_refs()


async def test_a_group_whose_start_failed_keeps_the_pool_another_group_holds():
    pool = shared_pool()
    async with WorkerGroup(pool, Hazard, group_name="A") as a:
        bad = WorkerGroup(pool, Broken, group_name="B")
        with pytest.raises(orc.WorkerError, match="__init__"):
            async with bad:
                pass
        bad.shutdown()  # and once more: still nothing of A's is given back
        await bad.aclose()
        assert pool.holds_refs(), "the failed group gave back the pool reference A holds"
        assert await a.ping() == [0]
    assert not pool.holds_refs()


_FIRST: contextvars.ContextVar[bool] = contextvars.ContextVar("first_close", default=False)


@pytest.mark.parametrize("second", sorted(CLOSES))
async def test_a_close_while_another_is_under_way_returns_only_after_it(monkeypatch, second):
    """Two closes at once: the one that closed the group kills the ranks, waits for their processes and gives the
    pool back, in a thread; the other ran the same in its own thread, which could run first: it killed nothing,
    gave the pool back and returned before any rank was killed (the Ray test of this saw a rank still running when
    a close returned, in one of the two CI runs on stop 40's commit). Here the first close's thread is held until the second close returned: the
    second kills the ranks itself now, or waits while another close does."""
    pool = shared_pool()
    g = WorkerGroup(pool, Hazard, group_name="twice")
    await g.ready()
    shared, order, go = g._shared, [], threading.Event()
    finish, kill = type(shared).finish_close, pool.backend.kill

    def held_finish(self, *args):
        if _FIRST.get():  # the thread of the close that closed the group
            assert go.wait(timeout=60)
        finish(self, *args)

    def noted_kill(handle):
        kill(handle)
        order.append("killed")

    monkeypatch.setattr(type(shared), "finish_close", held_finish)
    monkeypatch.setattr(pool.backend, "kill", noted_kill)

    async def first_close() -> None:
        _FIRST.set(True)  # seen in its thread: anyio runs the function in a copy of the caller's context
        await g.aclose()

    first = asyncio.ensure_future(first_close())
    await asyncio.sleep(0)  # it closes the group and hands the rest of its close to a thread
    assert g.closed
    await CLOSES[second](g)
    order.append("second returned")
    go.set()
    await first
    assert order == ["killed", "second returned"]
    assert not pool.holds_refs()


def test_a_reference_taken_before_the_pool_was_forgotten_is_given_back_as_nothing():
    """``orc.shutdown()`` forgets a Ray pool's reservations and every group's share (they end with the cluster). A
    group's close already under way in a worker thread gives its share back afterwards: that must do nothing, not
    raise "released twice" nor count against a group of the next era; a second release of one share still is a bug."""
    pool = shared_pool()
    old = pool.acquire()
    pool.forget()
    assert not pool.holds_refs()
    pool.release_ref(old)  # the close that was under way: nothing to give back, no error
    new = pool.acquire()
    pool.release_ref(old)  # still nothing: the share of the next era's group is kept
    assert pool.holds_refs()
    pool.release_ref(new)
    assert not pool.holds_refs()
    with pytest.raises(RuntimeError, match="released its share twice"):
        pool.release_ref(new)


# -- on_death: deaths before the registration ----------------------------------------------------------------------
async def test_on_death_registered_after_a_rank_died_is_told_of_it_once():
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend="local"), Hazard,
                           group_name="late") as g:
        early: list[int] = []
        g.on_death(lambda err: early.append(err.rank))
        await kill_rank(g, 1)
        late: list[int] = []
        g.on_death(lambda err: late.append(err.rank))  # on the group's loop: told at once
        assert late == [1]
        assert [h["alive"] for h in g.health()] == [True, False]  # health() follows the loop, tells nobody again
        with pytest.raises(orc.WorkerDiedError):
            g.echo(None)
        assert (early, late) == ([1], [1])


async def test_on_death_registered_from_another_threads_loop_is_told_on_the_groups_loop():
    """Registered from an event loop running in another thread (a monitor thread's ``asyncio.run``) after a rank
    died: the death is told on the group's own loop, not on the registering thread, whose loop the group's state is
    not touched from."""
    import threading

    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend="local"), Hazard,
                           group_name="late_elsewhere") as g:
        await kill_rank(g, 0)
        told: list[tuple[int, int]] = []
        heard = asyncio.Event()

        def on_death(err: orc.WorkerDiedError) -> None:
            told.append((err.rank, threading.get_ident()))
            heard.set()

        async def register() -> None:
            g.on_death(on_death)

        await asyncio.to_thread(asyncio.run, register())
        with anyio.fail_after(30):  # a hang, not a threshold
            await heard.wait()
        assert told == [(0, threading.get_ident())]
        assert [h["alive"] for h in g.health()] == [False, True]  # and nobody is told twice
        assert len(told) == 1


async def test_on_death_registered_from_another_thread_hears_a_death_recorded_while_it_registers():
    """A rank dies on the group's loop while another thread's loop registers a callback, between the registration
    reading the deaths already known and adding the callback: the callback is told of it once, not missed (it was
    neither among the deaths read nor among the callbacks told)."""
    import threading

    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend="local"), Hazard,
                           group_name="dies_meanwhile") as g:
        shared, home, home_thread = g._shared, asyncio.get_running_loop(), threading.get_ident()
        registering = threading.Event()
        # the registration waits, after reading the deaths, until the group's loop recorded the death or waits to
        # record it (blocked by the registration)
        recorded_or_waiting = threading.Event()

        class DeadRead(dict):
            def items(self):  # the registration reads the deaths here
                known = list(super().items())
                if registering.is_set():
                    registering.clear()
                    home.call_soon_threadsafe(shared.declared_dead, 1, "test: dies while a callback registers")
                    recorded_or_waiting.wait()
                return known

        class ReportingLock:
            def __init__(self, lock):
                self._lock = lock

            def __enter__(self):
                if threading.get_ident() == home_thread:
                    recorded_or_waiting.set()  # the group's loop is about to wait for the registration
                return self._lock.__enter__()

            def __exit__(self, *exc):
                return self._lock.__exit__(*exc)

        def record_then_report(rank, why, _declared=shared.declared_dead):
            _declared(rank, why)
            recorded_or_waiting.set()

        shared.dead = DeadRead(shared.dead)
        shared.deaths_lock = ReportingLock(getattr(shared, "deaths_lock", threading.Lock()))
        shared.declared_dead = record_then_report
        told: list[tuple[int, int]] = []

        async def register() -> None:
            registering.set()
            g.on_death(lambda err: told.append((err.rank, threading.get_ident())))

        await asyncio.to_thread(asyncio.run, register())
        await asyncio.sleep(0)  # a tell owed to a callback registered elsewhere is posted to this loop
        assert told == [(1, home_thread)]
        assert [h["alive"] for h in g.health()] == [True, False]
        assert len(told) == 1


# -- async for over a call not yet sent ------------------------------------------------------------------------------
async def test_cancelling_an_async_for_over_a_call_not_yet_sent_cancels_the_call(seq):
    """The task iterating ``async for part in fut`` is cancelled while the call still waits in its group's send
    order: the call is cancelled for everyone and never runs (as for ``await fut``)."""
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend="local"), Hazard,
                           group_name="parts") as g:
        # holds the group's send order until its last part: each producer rank yields its first part, then waits
        # for the test's position 0 (rank 0 passes 1, rank 1 passes 2) before the rest
        slow = g.per_part(g.gen_in_turn(rows(8), seq, [1, 2], pieces=4))
        queued = g.mark("late")

        async def consume() -> None:
            async for _ in queued:
                pass

        t = asyncio.create_task(consume())
        await asyncio.sleep(0)  # one turn: the task runs up to its wait for the call to be sent
        assert not queued.done() and not t.done()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert queued.done()
        with pytest.raises(orc.CallCancelledError, match="iterating its parts was cancelled"):
            await queued
        async with seq(0):  # the stream ends only now
            pass
        await slow
        assert await g.seen_calls() == [0, 0]  # "late" was never sent


# -- shutdown() from another thread ------------------------------------------------------------------------------------
async def test_shutdown_from_another_thread_is_refused_before_changing_anything(seq):
    """``shutdown()`` called from a thread other than the one running the group's event loop (a watchdog, a signal
    thread) is refused at once, with nothing changed: the call in flight runs on, the pool stays held. Handing
    ``aclose()`` to the loop, as the error says, closes the group: the call fails with GroupClosedError, the ranks
    are killed and the pool is released."""
    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend="local"), Scorer,
                    group_name="threaded")
    try:
        await g.ready()
        hosts = g.actors
        fut = g.hold_until_cancelled(seq)
        async with seq(2):  # both ranks are running it
            pass
        refused = r"'threaded': shutdown\(\) was called in thread .*run_coroutine_threadsafe"
        with pytest.raises(RuntimeError, match=refused):
            await asyncio.to_thread(g.shutdown)
        assert not g.closed and not fut.done() and g.pool.holds_refs()
        assert await g.ping() == [0, 1]  # the ranks still answer

        loop = asyncio.get_running_loop()
        await asyncio.to_thread(lambda: asyncio.run_coroutine_threadsafe(g.aclose(), loop).result())
        assert g.closed and fut.done() and not g.pool.holds_refs()
        with pytest.raises(orc.GroupClosedError, match="'threaded' was shut down"):
            await fut
        for h in hosts:  # killed: a dead rank answers nothing
            with pytest.raises(Exception, match="(?i)died|dead|killed"):
                await asyncio.wrap_future(h.ping.remote().future())
    finally:
        await g.aclose()


def test_a_group_whose_start_was_cut_short_by_the_end_of_its_loop_is_closed_saying_why():
    """Made in one ``asyncio.run`` that returned before ``ready()`` (its start-up task was cancelled with the loop),
    used in the next: ``ready()`` and calls fail with a GroupClosedError that says what happened, and the group's
    pool is given back (it raised a bare CancelledError, calls said "cancelled before it finished sending", and the
    group kept its pool)."""

    async def make() -> WorkerGroup:
        return WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend="local"), Scorer)

    g = asyncio.run(make())

    async def use() -> None:
        with pytest.raises(orc.GroupClosedError, match="event loop it began on ended"):
            await g.ready()
        with pytest.raises(orc.GroupClosedError, match="event loop it began on ended"):
            await g.count_rows(rows(4))

    asyncio.run(use())
    assert g.closed and not g.pool.holds_refs()


async def test_orc_shutdown_from_another_thread_is_refused_before_changing_anything(seq):
    """``orc.shutdown()`` from a watchdog thread while a group's event loop runs elsewhere had the flaw
    ``group.shutdown()`` had (it closed the groups from the wrong thread, halfway): it is refused, naming the group,
    and nothing is closed."""
    g = WorkerGroup(ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01, backend="local"), Scorer,
                    group_name="watched_by_a_thread")
    try:
        await g.ready()
        fut = g.hold_until_cancelled(seq)
        async with seq(1):  # the rank is running it
            pass
        with pytest.raises(RuntimeError, match=r"orc.shutdown\(\).*'watched_by_a_thread'.*another thread"):
            await asyncio.to_thread(orc.shutdown)
        assert not g.closed and not fut.done() and g.pool.holds_refs()
        assert await g.ping() == [0]
    finally:
        await g.aclose()


class BrokenOnRankOne(orc.Worker):
    """A worker whose construction fails on rank 1 only."""

    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("rank one's bad config")


async def test_health_says_whether_the_group_started_and_which_rank_failed_its_start_up():
    # before ready() every rank read {"alive": False, "error": None}, as a dead rank's does; after rank 1's start-up
    # failed every rank read "its start-up failed", naming neither the rank nor the cause
    g = WorkerGroup(ResourcePool([2], backend="local"), BrokenOnRankOne)
    assert [(h["ready"], h["alive"], h["error"]) for h in g.health()] == [(False, False, None)] * 2
    with pytest.raises(orc.WorkerError, match="rank one's bad config"):
        await g.ready()
    for h in g.health():
        assert not h["ready"] and not h["alive"]
        assert "its start-up failed" in h["error"] and "rank 1" in h["error"] and "rank one's bad config" in h["error"]
    await g.aclose()
