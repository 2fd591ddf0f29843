"""The fast path (orchestra._channel): a group's repeated small calls go over a persistent socket per rank instead
of one Ray actor task per rank, with the general path's semantics: results, order across both paths, forwarding,
errors, deadlines, cancellation, deaths, private copies, and the cases that must take Ray."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import anyio
import pytest
import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orchestra import _channel, _frame
from orchestra._wire import INLINE_BYTES
from orchestra.testing import kill_rank

from fast_path_workers import Recorder

AFTER = _channel.threshold()


async def _open(g: WorkerGroup) -> None:
    """Make enough qualifying calls in a row that the group's channel is open."""
    for i in range(AFTER):
        await g.note(f"warm{i}")
    assert g._shared.channel is not None and g._shared.channel.open


@pytest.fixture(scope="module")
async def g():
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder,
                           group_name="fast") as group:
        yield group


async def test_repeated_calls_take_the_fast_path_with_the_general_paths_results(g):
    await _open(g)
    before = g._shared.fast_calls
    assert await g.note("a") == [(0, "a"), (1, "a")]
    b = Batch.from_dict({"x": torch.arange(5)})
    out = await g.double(b)
    assert out["x"].tolist() == [0, 2, 4, 6, 8]
    out = await g.padded(b)  # 5 rows over 2 ranks: padded to 6, the padding row dropped again
    assert out["x"].tolist() == [0, 1, 2, 103, 104]
    assert g._shared.fast_calls - before == 3
    stats = await g.stats()
    assert all(s["double"]["calls"] >= 1 and s["double"]["rows_out"] >= 2 for s in stats)


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="scheduling policies are Linux's")
async def test_a_rank_serves_its_channel_as_sched_batch_and_takes_its_policy_back_after(g):
    """A frame woke a rank that then preempted the controller in the middle of writing the same call to the other
    ranks; the serve thread is SCHED_BATCH while it holds the channel (a woken SCHED_BATCH thread preempts no one)
    and its own policy again once the channel is released."""
    await _open(g)
    assert await g.policy() == [os.SCHED_BATCH] * 2
    g.fast_path = False  # the channel released: the ranks' loops return, the next call comes through Ray
    try:
        assert await g.policy() == [os.SCHED_OTHER] * 2
    finally:
        g.fast_path = True


async def test_repeated_shard_calls_are_written_into_a_frame_template_and_get_their_own_results(g):
    await _open(g)
    used = g._shared.templates.used
    for i in range(8):  # 16 rows, the 4th with meta (made as usual, the template kept), then 12 rows
        rows = 16 if i < 5 else 12
        b = Batch.from_dict({"x": torch.arange(rows) * (i + 1)}, meta={"i": i} if i == 3 else None)
        out = await g.double(b)
        assert out["x"].tolist() == (b["x"] * 2).tolist()
    assert g._shared.templates.used - used == 3  # calls 2, 4 and 7: each shape learnt from its second call
    assert g._shared.channel is not None


async def test_each_rank_sees_the_calls_in_the_order_they_were_made_across_both_paths(g):
    await _open(g)
    start = len((await g.history())[0])
    futs = [g.note("f1"), g.note("f2")]
    made = g.make(3)  # qualifies: fast path
    futs.append(g.rows(made))  # a DataFuture argument with a small result: it waits for it, then fast path
    big = g.big(INLINE_BYTES // 8 + 10)  # fast path; its result is stored through Ray
    futs.append(g.rows(big))  # carries a ref: the channel is released, the call goes through Ray
    futs += [g.note(f"n{i}") for i in range(3)]  # wait their turn behind it (the group's send order): Ray too
    await asyncio.gather(*futs, made, big)
    assert g._shared.channel is None
    futs = [g.note(f"m{i}") for i in range(AFTER + 2)]  # these open a channel again
    assert g._shared.channel is not None
    await asyncio.gather(*futs)
    want = ["f1", "f2", "make", "rows", "rows", "n0", "n1", "n2", *[f"m{i}" for i in range(AFTER + 2)]]
    for log in await g.history():
        assert log[start:] == want


async def test_a_fast_result_forwards_into_the_next_call_small_and_large(g):
    await _open(g)
    small = g.make(4)
    assert await g.rows(small) == [12, 12]  # both ranks made 0..3: a broadcast reader gets await's list of both
    await _open(g)
    n = INLINE_BYTES // 8 + 10  # a Batch over INLINE_BYTES: the rank keeps it; it is stored through Ray
    big = g.big(n)
    got = await big
    assert got["x"].shape == (n,) and float(got["x"][-1]) == n - 1
    assert g._shared.channel is not None  # the big call itself went the fast way
    assert await g.rows(big) == [n * (n - 1) // 2] * 2
    await _open(g)
    vals = await g.big_value(_frame.FRAME_BYTES // 8)  # a plain value over a frame: handed over by Ray too
    assert len(vals[0]) == _frame.FRAME_BYTES // 8 and vals[1][-1] == _frame.FRAME_BYTES // 8 - 1


async def test_a_call_given_a_small_fast_result_stays_on_the_channel(g):
    """A chain of calls (``g.rows(g.make(n))``, the training loop's ``g.step(g.prepare(b))``) whose forwarded
    outputs came back by value over the channel carries them in its frame: nothing needs Ray, so the channel stays
    open and both calls take it, with the same results and the same order on every rank."""
    await _open(g)
    start = len((await g.history())[0])
    before = g._shared.fast_calls
    for n in range(2, 2 + AFTER + 2):
        assert await g.rows(g.make(n)) == [n * (n - 1)] * 2  # both ranks made 0..n-1: the reader sums both
        assert g._shared.channel is not None and g._shared.channel.open
    assert g._shared.fast_calls - before == 2 * (AFTER + 2)
    for log in await g.history():
        assert log[start:] == ["make", "rows"] * (AFTER + 2)


async def test_a_forwarded_int_is_a_value_not_a_ref_index(g):
    """A call's arguments name the refs they carry by their place in a list; a plain int forwarded by value (a fast
    call's small result) was read as such a place on the rank: the reader got another output, or an IndexError."""
    await _open(g)
    ranks = g.fail_on(-1)  # each rank returns its rank: 0 and 1
    assert await ranks == [0, 1]
    assert await g.echo(ranks) == [[0, 1], [0, 1]]


async def test_a_chain_alone_opens_the_channel(g):
    """Before the channel opens, ``make`` goes through Ray and ``rows`` carries its reply refs (or the replies, if
    already in): ``rows`` needs Ray only for its own group's replies, so it does not end the run of qualifying calls,
    and a loop of nothing but chains opens the channel and stays on it (it never opened before)."""
    g.fast_path = False  # releases the channel this module's earlier tests opened
    g.fast_path = True
    before = g._shared.fast_calls
    for n in range(2, 2 + AFTER + 4):
        assert await g.rows(g.make(n)) == [n * (n - 1)] * 2
    assert g._shared.channel is not None and g._shared.channel.open
    assert g._shared.fast_calls - before >= 4


async def test_a_call_given_a_result_stored_through_ray_still_takes_ray(g):
    await _open(g)
    n = INLINE_BYTES // 8 + 10  # over INLINE_BYTES: the rank stores it through Ray, so the reader gets a ref
    big = g.big(n)
    assert await g.rows(big) == [n * (n - 1) // 2] * 2
    assert g._shared.channel is None  # released for the call that carries a ref


async def test_a_result_that_cannot_be_pickled_fails_that_call_only(g):
    await _open(g)
    with pytest.raises(orc.WorkerError, match="lock") as e:
        await g.unpicklable()
    assert e.value.endpoint == "unpicklable"
    assert await g.note("still open") == [(0, "still open"), (1, "still open")]
    assert g._shared.channel is not None


async def test_a_reply_the_controller_cannot_unpickle_fails_that_call_only(g):
    await _open(g)
    with pytest.raises(orc.WorkerError, match="could not be unpickled") as e:
        with anyio.fail_after(60):  # bounds a broken build (it hung: the error escaped a reader callback)
            await g.worker_only_class()
    assert e.value.group == "fast" and e.value.rank in (0, 1)
    assert await g.note("still open") == [(0, "still open"), (1, "still open")]


async def test_awaited_values_are_private_copies(g):
    await _open(g)
    fut = g.value()
    first = await fut
    first[0]["lst"].append(99)
    assert await fut == [{"k": "orig", "lst": [1]}] * 2  # a second await: a fresh copy
    assert await g.echo(fut) == [[{"k": "orig", "lst": [1]}] * 2] * 2  # a later reader: the original


@pytest.mark.parametrize("big", [True, False])
async def test_a_kept_reply_is_the_value_as_the_call_returned_it(g, big):
    """A reply the rank keeps (over a frame's size, or holding a ref) is the value as its call returned it, as on
    the general path, where Ray pickles it at once: the next call's write into the same objects must not show (it
    was pickled only when the controller took it, after the next call had run)."""
    await _open(g)
    for _ in range(4):
        state, bumped = g.live_state(big), g.bump_state()
        got, after = await state, await bumped
        assert [v["step"] for v in got] == [a - 1 for a in after]
        if big:
            assert [float(v["arr"][0]) for v in got] == [float(a - 1) for a in after]
    assert g._shared.channel is not None


async def test_a_kept_batch_reply_with_inline_rows_is_the_batch_as_its_call_returned_it(g):
    """A Batch reply whose rows ride inline (``nbytes`` under INLINE_BYTES) but whose pickle is too large for a frame
    was kept as the live Output, on the assumption that a Batch's parts are stored objects: the next call's write
    into the Batch showed in the result the controller took (the general path gives the rows as they were)."""
    await _open(g)
    await g.live_state(True)
    for _ in range(4):
        rows, bumped = g.live_rows(), g.bump_state()
        got, after = await rows, await bumped
        assert [b["step"].tolist() for b in got] == [[a - 1] * 4 for a in after]  # one Batch a rank
    assert g._shared.channel is not None


async def test_a_rank_error_names_group_rank_and_endpoint(g):
    await _open(g)
    with pytest.raises(orc.WorkerError) as e:
        await g.fail_on(1)
    assert (e.value.group, e.value.rank, e.value.endpoint) == ("fast", 1, "fail_on")
    assert "boom on rank 1" in str(e.value) and e.value.exc_type == "ValueError"
    assert await g.note("after") == [(0, "after"), (1, "after")]


async def test_a_deadline_fails_the_call_and_the_late_reply_is_dropped(g):
    await _open(g)
    with pytest.raises(orc.CallTimeoutError):
        await g.spin.options(timeout=0.2)(60.0)  # the deadline cancels it on every rank
    assert await g.note("next") == [(0, "next"), (1, "next")]
    for log in await g.history():
        assert log[-2:] == ["spin cancelled", "next"]
    assert g.calls_in_flight() == []


async def test_a_reader_of_a_running_fast_call_holds_back_no_later_call(g, tmp_path):
    """Rank 0's upstream call waits for a later call of the same group on rank 1, and a reader of it (on rank 0)
    waits for its reply. The later call must be sent meanwhile, as on the general path (where the reader is sent at
    once, carrying the upstream's refs): the reader held the group's call order until the fast reply came, and the
    later call was never sent (a deadlock, until the upstream's own bound ran out)."""
    await _open(g)
    path = str(tmp_path / "flag")
    up = g.wait_for_file(path)
    down, again = g.on_rank_zero(up), g.on_rank_zero(up)  # two readers: each asks rank 0 to keep it for it
    with anyio.fail_after(50):  # bounded: a result, not a timing (the upstream gives up at 60 s)
        assert await g.make_file(path) == ["made"]
    assert await up == ["found"]
    with anyio.fail_after(50):  # two readers of one call once shared the rank's entry: the first never returned
        assert await down == [["found"]]  # the reply the rank kept for it: as await gives it
        assert await again == [["found"]]
    assert await g.note("after") == [(0, "after"), (1, "after")]
    assert g.calls_in_flight() == []
    assert await g.kept_here() == [0, 0]  # what rank 0 kept for the reader was taken


async def test_a_reader_timing_out_before_it_was_sent_says_what_it_waited_for(g):
    """A reading call whose upstream is a fast call waits for that reply before it is sent: its deadline names
    that wait (it said "rank(s) [] still running", naming no rank and nothing to look at)."""
    await _open(g)
    up = g.spin(60.0)
    down = g.echo.options(timeout=0.3)(up)
    with pytest.raises(orc.CallTimeoutError) as e:
        await down
    msg = str(e.value)
    assert "[]" not in msg and "was not sent" in msg and "'spin'" in msg and "'fast'" in msg, msg
    assert list(e.value.pending_ranks) == []
    up.cancel()
    with pytest.raises(orc.CallCancelledError):
        await up
    assert await g.note("after") == [(0, "after"), (1, "after")]
    assert g.calls_in_flight() == []


async def test_cancelling_a_fast_call_reaches_the_running_endpoint(g):
    await _open(g)
    fut = g.spin(60.0)
    assert g._shared.channel is not None
    started = g.note("ping")  # queued behind spin on every rank
    await asyncio.sleep(0)
    fut.cancel()
    with pytest.raises(orc.CallCancelledError):
        await fut
    assert await started == [(0, "ping"), (1, "ping")]
    for log in await g.history():
        assert log[-2:] == ["spin cancelled", "ping"]


async def test_an_objectref_or_a_large_argument_takes_ray(g):
    await _open(g)
    ref = ray.put({"via": "ray"})
    assert await g.echo(ref) == [{"via": "ray"}] * 2  # Ray resolves a top-level ref, as on the general path
    assert g._shared.channel is None
    await _open(g)
    big = list(range(_frame.FRAME_BYTES // 4))
    assert len((await g.echo(big))[0]) == len(big)
    assert g._shared.channel is None


async def test_an_unserializable_argument_runs_on_no_rank(g):
    await _open(g)
    start = [len(h) for h in await g.history()]
    import threading

    with pytest.raises(orc.DispatchError, match="rank"):
        g.note(threading.Lock())
    assert [len(h) for h in await g.history()] == start  # nothing ran


async def test_taking_the_raw_handles_turns_the_fast_path_off(g):
    await _open(g)
    try:
        actors = g.actors
        assert g._shared.channel is None
        assert ray.get([a.noop.remote() for a in actors]) == [None, None]  # the compute lane is free
        for i in range(AFTER + 2):
            await g.note(f"slow{i}")
        assert g._shared.channel is None and g.fast_path is False
    finally:
        g.fast_path = True  # for the next tests of this module


async def test_the_switch_sends_every_call_through_ray_and_back(g):
    await _open(g)
    try:
        g.fast_path = False
        assert g._shared.channel is None  # released at once
        before = g._shared.fast_calls
        for i in range(AFTER + 2):
            assert await g.note(f"ray{i}") == [(0, f"ray{i}"), (1, f"ray{i}")]
        assert g._shared.channel is None and g._shared.fast_calls == before
    finally:
        g.fast_path = True
    await _open(g)
    assert g._shared.fast_calls > before


async def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("ORCHESTRA_FAST_PATH", "0")
    async with WorkerGroup(ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01), Recorder) as g1:
        for i in range(AFTER + 2):
            await g1.note("x")
        assert g1._shared.channel is None and g1._shared.fast_calls == 0


async def test_a_rank_that_dies_fails_the_fast_call_with_worker_died():
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder,
                           group_name="dies") as g2:
        await _open(g2)
        fut = g2.spin(60.0)
        err = await kill_rank(g2, 1)
        assert err.rank == 1
        with pytest.raises(orc.WorkerDiedError) as e:
            with anyio.fail_after(60):  # bounds a broken build only
                await fut
        assert e.value.group == "dies" and e.value.rank == 1
        assert "rank 1" in str(e.value), str(e.value)  # the message names it too, as the general path's does


async def test_a_rank_that_dies_releases_the_other_ranks_loops():
    """The survivors' loops return (their compute lanes free for Ray calls again) without waiting for the group to
    close."""
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder,
                           group_name="dies2") as g2:
        await _open(g2)
        ch = g2._shared.channel
        await kill_rank(g2, 1)
        with anyio.fail_after(60):  # bounds a broken build only: rank 0 would wait in its loop until the group closes
            served = await ch._serves[0]
        assert served >= 1 and not ch.open


async def test_closing_the_group_closes_a_released_channel_that_still_runs_a_call():
    """A channel released while a rank still runs a call over it is the group's no longer, but it is still the
    group's to close: closing the group fails its call and removes its socket at once, not when Ray reports the
    ranks gone."""
    g2 = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder, group_name="drains")
    try:
        await _open(g2)
        ch = g2._shared.channel
        fut = g2.stubborn(30.0)  # does not look at cancellation: the ranks' loops stay in it
        g2.fast_path = False  # released: the ranks' loops return once it is over
        assert g2._shared.channel is None and not ch.open and not ch.closed and os.path.isdir(ch._dir)
    finally:
        await g2.aclose()
    assert ch.closed and not os.path.exists(ch._dir)
    with pytest.raises(orc.GroupClosedError):
        await fut


async def test_a_rank_that_cannot_join_the_channel_sends_the_calls_through_ray_and_turns_the_fast_path_off(g, caplog):
    """A rank whose loop ends before it connects (here its connects are refused): no frame is written to any rank
    until every rank has joined, so the calls sent meanwhile ran nowhere; they then run through Ray, exactly once on
    each rank and in order, the other ranks' loops return, and the group's fast path is turned off with a warning
    (a rank that cannot reach the controller's socket, e.g. a firewall between nodes, would fail every later channel
    too) until it is set back on. A reader in another group that asked a rank for one of them before it ran (a
    later call of its group hurried it out) gets its outcome from the Ray call that ran it."""
    g.fast_path = False  # release any open channel: the calls below start a new streak
    g.fast_path = True
    async with WorkerGroup(ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01), Recorder,
                           group_name="reads") as h:
        try:
            assert await g.refuse_connects(1) == [True, True]
            while g._shared._streak < AFTER - 2:  # qualifying calls through Ray, up to the one that opens a channel
                await g.note("ray")
            busy = g.stubborn(1.0)  # holds the ranks' lanes: the reader below asks for "opens" before it runs
            assert g._shared.channel is None
            first = g.note("opens")
            ch = g._shared.channel
            assert ch is not None
            second = g.note("queued")
            reader = h.echo(first)
            behind = h.note("behind")  # waits for the reader to be sent: it is sent at once, with a Ray ref
            with caplog.at_level(logging.WARNING, logger="orchestra"):
                with anyio.fail_after(60):  # bounds a broken build only: the calls would wait for rank 1's socket
                    assert await first == [(0, "opens"), (1, "opens")]
                    assert await second == [(0, "queued"), (1, "queued")]
                    read = await reader
                    assert await behind == [(0, "behind")]
                    assert await busy == ["done", "done"]
            assert read == await h.echo(first) and "opens" in repr(read)  # what a reader sent later gets
            assert not ch.open and not ch.joined
            with anyio.fail_after(60):  # bounds a broken build only: rank 0 would wait in its loop
                assert await ch._serves[0] == 0  # its loop returned without running a call: Ray ran them
            assert g.fast_path is False and g._shared.channel is None
            for hist in await g.history():
                assert [x for x in hist if x in ("opens", "queued")] == ["opens", "queued"]  # once each, in order
            assert any("rank 1" in r.getMessage() and "go through Ray" in r.getMessage() for r in caplog.records)
            assert any("fast path" in r.getMessage() and "rank 1" in r.getMessage() and "turned off" in r.getMessage()
                       for r in caplog.records)
        finally:  # left as found for the module's later tests, whatever failed above
            g.fast_path = False  # through Ray, whether or not the channel was released
            with anyio.fail_after(60):  # bounds a broken build only
                assert await g.refuse_connects(-1) == [True, True]
            g.fast_path = True
    assert g._shared.channel is None
    await _open(g)
    assert await g.note("after") == [(0, "after"), (1, "after")]


async def test_a_reader_in_the_same_group_sent_through_ray_during_a_failed_join_fails_with_its_upstream(g):
    """A reader of a call no rank ran yet, hurried out by a later call of the same group, goes through Ray and so
    releases the channel: the calls written to no rank can then no longer go through Ray before it (the reader
    would wait on the ranks' lanes for a call queued behind it), so when the join fails they fail as sent to no
    rank, and so does the reader and the call behind it waits for nothing: nothing hangs, nothing runs twice."""
    g.fast_path = False
    g.fast_path = True
    try:
        assert await g.refuse_connects(1) == [True, True]
        while g._shared._streak < AFTER - 2:
            await g.note("ray")
        busy = g.stubborn(1.0)
        first = g.note("never")
        assert g._shared.channel is not None
        reader = g.echo(first)
        behind = g.note("behind")
        with anyio.fail_after(60):  # bounds a broken build only
            with pytest.raises(orc.WorkerError, match="sent to no rank"):
                await first
            with pytest.raises(orc.WorkerError) as e:
                await reader
            assert e.value.endpoint == "note" and e.value.rank == 1  # the upstream's own error, as reported
            assert await behind == [(0, "behind"), (1, "behind")]
            assert await busy == ["done", "done"]
        assert all("never" not in hist for hist in await g.history())
    finally:
        g.fast_path = False
        with anyio.fail_after(60):  # bounds a broken build only
            assert await g.refuse_connects(-1) == [True, True]
        g.fast_path = True


_LEFT_OPEN = textwrap.dedent("""
    import os, sys, anyio
    import orchestra as orc
    sys.path.insert(0, {tests!r})
    from fast_path_workers import Recorder

    async def main():
        orc.init(num_cpus=1)  # one CPU: one Ray worker prestarted, the rank's
        g = orc.WorkerGroup(orc.ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01), Recorder)
        for _ in range({calls}):
            await g.note("x")
        ch = g._shared.channel
        print("DIR", ch._dir, ch.open and os.path.isdir(ch._dir), flush=True)

    anyio.run(main)  # ends with the group and its channel open, and no orc.shutdown()
""")


def test_a_channel_left_open_at_exit_leaves_no_socket_dir():
    code = _LEFT_OPEN.format(tests=os.path.dirname(__file__), calls=AFTER + 1)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a timeout ends its Ray processes too
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("DIR "))
    _, path, was_open = line.split()
    assert was_open == "True" and not os.path.exists(path), (line, out.stderr[-2000:])


def test_a_second_event_loop_releases_the_channel_and_calls_still_work():
    async def make():
        g3 = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder, group_name="loops")
        await g3.ready()
        await _open(g3)
        return g3

    g3 = asyncio.run(make())

    async def again():
        try:
            assert await g3.note("second loop") == [(0, "second loop"), (1, "second loop")]
            await _open(g3)
            assert g3._shared.channel.loop is asyncio.get_running_loop()
        finally:
            await g3.aclose()

    asyncio.run(again())


async def test_an_error_too_large_for_a_frame_is_still_an_error(g):
    await _open(g)
    with pytest.raises(orc.WorkerError) as e:
        await g.fail_big(1, 2 * _frame.FRAME_BYTES)  # it came back as rank 1's *value* once
    assert (e.value.rank, e.value.endpoint, e.value.exc_type) == (1, "fail_big", "ValueError")
    assert "more characters cut" in e.value.message


async def test_classes_of_the_driver_script_travel_by_value(g, monkeypatch):
    import dataclasses
    import sys

    @dataclasses.dataclass
    class StepCfg:
        lr: float

    StepCfg.__module__, StepCfg.__qualname__ = "__main__", "StepCfg"
    monkeypatch.setattr(sys.modules["__main__"], "StepCfg", StepCfg, raising=False)
    await _open(g)
    assert await g.kind(StepCfg(0.5)) == ["StepCfg:0.5"] * 2  # a rank cannot import the driver's __main__
    assert g._shared.channel is not None


async def test_large_fast_results_keep_their_trace(g):
    await _open(g)
    await g.set_tracing(True)
    try:
        await g.take_events()
        await _open(g)
        await g.big(INLINE_BYTES // 8 + 10)
        assert g._shared.channel is not None
        (_, events), _ = await g.take_events()
        big = [e for e in events if e["endpoint"] == "big"]
        assert big and big[-1]["produced"], big  # the parts it stored, for the trace's flow arrows
    finally:
        await g.set_tracing(False)


async def test_no_socket_here_means_ray_not_a_failed_call(monkeypatch, caplog):
    import tempfile

    long_dir = tempfile.mkdtemp(suffix="d" * 110)
    monkeypatch.setattr(tempfile, "tempdir", long_dir)  # a Unix socket path must be < 108 bytes
    async with WorkerGroup(ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01), Recorder,
                           group_name="nosock") as g4:
        for i in range(AFTER + 3):
            assert await g4.note(f"{i}") == [(0, f"{i}")]
        assert g4._shared.channel is None
    assert any("could not open a socket" in r.getMessage() for r in caplog.records)
    assert os.listdir(long_dir) == []  # the socket directory it tried is gone again
    os.rmdir(long_dir)


def test_results_kept_for_replies_no_loop_will_read_are_dropped():
    """Replies the rank keeps (too large for a frame) of calls still unread when their event loop ended are
    dropped on the ranks once the channel closes; they stayed there until the group closed (2 MiB each)."""
    async def run():
        g6 = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder, group_name="kept")
        await g6.ready()
        await _open(g6)
        for _ in range(3):
            g6.live_state(True)  # never awaited: their replies are not read before this loop ends
        return g6

    g6 = asyncio.run(run())

    async def again():
        try:
            assert await g6.note("second loop") == [(0, "second loop"), (1, "second loop")]  # the channel closed
            for h in g6._shared.hosts:  # the control lane runs in call order: the close's discard ran before it
                await h.discard_kept.remote([])
            assert await g6.kept_here() == [0, 0]
        finally:
            await g6.aclose()

    asyncio.run(again())


def test_a_fast_call_left_running_when_the_loop_ends_does_not_break_shutdown():
    async def run():
        g5 = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder, group_name="left")
        await g5.ready()
        await _open(g5)
        g5.spin(0.5)  # never awaited: still in flight when this loop ends
        return g5

    g5 = asyncio.run(run())
    hosts, sockets = list(g5._shared.hosts), g5._shared.channel._dir
    g5.shutdown()  # raised "Event loop is closed" and left the actors alive
    assert g5.closed and not os.path.exists(sockets) and sockets not in _channel._DIRS
    for h in hosts:  # ray.kill is asynchronous: until the kill reaches the actor, a ping may still be served
        _until_dead(h)


def _until_dead(h: Any, within_s: float = 120.0) -> None:
    """Ping ``h`` until it answers as a dead actor does (RayActorError); fails if it still answers after
    ``within_s`` (a bound on the wait, not a speed check)."""
    deadline = time.monotonic() + within_s
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(h.ping.remote(), timeout=60)


def test_a_channel_released_before_its_ranks_joined_is_closed_once_its_loop_ended(orc_sequencer):
    """A channel released before its ranks joined, in an event loop that then ended, is closed by the group's next
    call from another loop: nothing could accept the ranks' connections any more, so their serve loops waited for
    frames forever and every later call, queued behind them on the compute lane, hung."""
    async def run():
        g8 = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder, group_name="orphan")
        await g8.ready()
        # through Ray (a Sequencer argument needs it): the ranks join a channel only after it, which the next loop
        # lets end; the calls below queue behind it, the last opening a channel. None of them is awaited
        held = g8.hold(orc_sequencer, [1, 2])
        for i in range(AFTER - 1):
            g8.note(f"warm{i}")
        g8.note("queued")  # opens the channel: its frames wait for the ranks to join
        ch = g8._shared.channel
        assert ch is not None and not ch.joined
        g8.fast_path = False  # released before any rank joined; this loop ends before they can
        assert not ch.open and not ch.closed and not held.done()
        return g8, ch

    g8, ch = asyncio.run(run())

    async def again():
        try:
            async with orc_sequencer(0):  # the held ranks go on: they join a channel no loop serves any more
                pass
            with anyio.fail_after(120):  # a hang, not a threshold: the call takes well under a second
                assert await g8.note("second loop") == [(0, "second loop"), (1, "second loop")]
            assert ch.closed and not os.path.exists(ch._dir)
        finally:
            await g8.aclose()

    asyncio.run(again())


def test_asking_health_from_another_threads_loop_leaves_the_groups_channel_and_supervision_alone():
    """``health()`` (or ``on_death``) from a thread running its own event loop, while the group's loop
    runs in another thread: it moved supervision to the asking loop and released the group's channel from the
    wrong thread, racing the group's own loop. It only reads now."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_home(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    async def make():
        g9 = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Recorder, group_name="other")
        await g9.ready()
        await _open(g9)
        return g9

    g9 = on_home(make())
    try:
        ch, watching = g9._shared.channel, g9._shared._watch_loop

        async def ask():
            assert [h["alive"] for h in g9.health()] == [True, True]
            g9.on_death(lambda err: None)()  # registered, then unregistered

        asyncio.run(ask())
        assert g9._shared.channel is ch and ch.open and g9._shared._watch_loop is watching is loop

        async def again():
            return await g9.note("home")

        assert on_home(again()) == [(0, "home"), (1, "home")]
        assert g9._shared.channel is ch  # still the same channel: nothing released it
    finally:
        on_home(g9.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _wrapped_helpers(host: Any) -> list[str]:
    from orchestra._host import Host

    return [name for name in ("_call", "_run_frame", "_begin", "_resolve", "_store", "_reply", "_fast_done",
                              "is_cancelled") if getattr(host, name).__func__ is not getattr(Host, name)]


async def test_a_ranks_call_path_runs_without_rays_tracing_wrappers(g):
    """Ray wraps every method of an actor class for its tracing, private helpers included: each helper a call's
    path calls on its rank (nine a fast-path call) ran through one more Python frame and a check, with tracing off.
    A rank binds its helpers as Host defines them (about 4 % of a rank's CPU a 16-row step call:
    docs/benchmarks.md); the methods Ray calls keep Ray's wrapper."""
    assert await g._shared.hosts[0].__ray_call__.remote(_wrapped_helpers) == []
