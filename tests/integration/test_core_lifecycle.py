"""A group's life on Ray: control calls after a real process death, supervision while the controller awaits
another group, placement groups given back, Ray's error for a failing generator, a cancelled stream over Ray, and
``orc.shutdown()`` under a call in flight (a cluster of its own).

Call options, deadlines on queued calls, cancelling before a call runs, a call in flight at close and the errors
of a dead or failing upstream group are checked in-process by tests/unit/core/test_group_semantics_local.py;
deaths, closing and cancellation on both backends by tests/contract."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import anyio
import pytest
import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orchestra.testing import kill_rank
from orc_test_workers import Hazard, Scorer


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


def pool(n: int) -> ResourcePool:
    return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.1)


async def test_failed_generator_raises_a_plain_worker_error(scorers):
    with pytest.raises(orc.WorkerError) as info:
        await scorers[2].gen_fail(xs(4))
    e = info.value
    assert type(e) is orc.WorkerError
    assert str(e).splitlines()[0].startswith("ValueError: generator failed on rank")
    assert "\x1b[" not in str(e)


async def test_shutdown_right_after_construction_leaks_nothing():
    free = ray.available_resources()["CPU"]
    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=free / 2), Hazard, group_name="early")
    g.shutdown()
    # every free CPU is free again: a pool of all of them places (its placement group is ready; no worker needed)
    again = ResourcePool(process_on_nodes=[2], cpus_per_worker=free / 2, placement_timeout=20)
    try:
        assert len(await again.slots()) == 2
    finally:
        again.release()
    with pytest.raises(orc.GroupClosedError, match="was shut down"):
        await g.ping()


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has exited: its memory and devices are released)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["aclose", "shutdown"])
async def test_closing_a_group_returns_once_its_ranks_processes_have_exited(how):
    """A group closed and a new one placed on the same GPUs right away must not find their memory still held by the
    old ranks: ``aclose()`` / ``shutdown()`` return once the ranks' processes on this node have exited (before, a
    rank was still running right after in 2 of 3 tries of this test, 3 of 3 of a script; the kill is asynchronous)."""
    for attempt in range(3):
        g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Hazard, group_name=f"exit{attempt}")
        await g.ready()
        pids = [d["pid"] for d in await g.describe()]
        assert all(_running(p) for p in pids)
        if how == "aclose":
            await g.aclose()
        else:
            g.shutdown()
        assert not any(_running(p) for p in pids), (attempt, pids)


async def test_of_two_closes_at_once_neither_returns_before_the_ranks_have_exited():
    """The second close kills nothing (the first did) and, before, returned at once — releasing the pool's
    reservation while the first still waited for the processes to exit."""
    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Hazard, group_name="twice")
    await g.ready()
    pids = [d["pid"] for d in await g.describe()]
    first, second = asyncio.ensure_future(g.aclose()), asyncio.ensure_future(g.aclose())
    done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    assert not any(_running(p) for p in pids), "a close returned with a rank still running"
    await asyncio.gather(first, second)


class _PidOnInit(orc.Worker):
    """Writes its pid where the test reads it, then fails on rank 1: a start-up that fails."""

    def __init__(self, where: str) -> None:
        with open(os.path.join(where, str(self.rank)), "w") as f:
            f.write(str(os.getpid()))
        if self.rank == 1:
            raise RuntimeError("cannot build model on rank 1")


async def test_a_failed_start_up_returns_once_its_ranks_processes_have_exited(tmp_path):
    """A start-up that fails kills its ranks; before, nothing waited for them (their pids were only learned from a
    set-up that succeeded), so a retry on the same GPUs right away could find their memory still held."""
    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), _PidOnInit, str(tmp_path),
                    group_name="bad_start")
    with pytest.raises(orc.WorkerError, match="cannot build model on rank 1"):
        await g.ready()
    # rank 1's file is there (it failed after writing it); rank 0's only if its set-up ran before the failure
    # ended the start-up (which kills every rank)
    pids = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert (tmp_path / "1").exists() and not any(_running(p) for p in pids), pids


async def test_cancelled_stream_leaves_no_task(scorers, orc_sequencer):
    g = scorers[2]
    baseline = len(asyncio.all_tasks())
    # each producer rank yields its first part, then waits for the test's position 0 before the rest: the stream is
    # still running when it is cancelled
    fut = g.per_part(g.gen_in_turn(xs(8), orc_sequencer, [1, 2], pieces=4))
    await asyncio.sleep(0)
    fut.cancel()
    with pytest.raises(orc.CallCancelledError):
        await fut
    async with orc_sequencer(0):  # lets the producer end
        pass
    with anyio.fail_after(10):  # a bound on a broken build only
        while len(asyncio.all_tasks()) > baseline:
            await asyncio.sleep(0.01)
    assert await g.get_scale() == [1.0, 1.0]  # group still answers


_AFTER_SHUTDOWN = textwrap.dedent("""
    import anyio, sys
    import orchestra as orc
    from orchestra.testing import Sequencer
    sys.path.insert(0, {tests!r})
    from orc_test_workers import Scorer

    async def use_a_sequencer():
        seq = Sequencer(timeout=30)
        async with seq(0):
            pass
        seq.close()

    async def main():
        # address="local" (what RAY_ADDRESS=local hands the runner) starts a private cluster like no address does.
        # One CPU: one Ray worker prestarted, the rank's
        orc.init(address="local", num_cpus=1)
        g = orc.WorkerGroup(orc.ResourcePool(process_on_nodes=[1], cpus_per_worker=0.1), Scorer)
        await g.ready()
        await use_a_sequencer()  # starts this cluster's Sequencer actor
        import ray
        print("NODE_IP", ",".join(n["NodeManagerAddress"] for n in ray.nodes()))
        fut = g.hold_until_cancelled()  # ends only when cancelled: in flight at the shutdown
        orc.shutdown()
        with anyio.fail_after(10):
            try:
                await fut
            except orc.OrchestraError as e:
                print("RAISED", type(e).__name__, e)
        # a new cluster after the shutdown: its Sequencers need an actor of their own (the first one's died with it)
        orc.init(num_cpus=1)
        await use_a_sequencer()
        print("SEQUENCER AFTER A NEW INIT")
        orc.shutdown()

    anyio.run(main)
""")


def test_await_after_orc_shutdown_fails_at_once_and_cluster_is_loopback_with_auth():
    """After ``orc.shutdown()`` a call in flight fails at once; the cluster listened on loopback only, with Ray's
    token authentication, also when asked for with ``address="local"``; and a cluster started next serves new
    Sequencers."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    code = _AFTER_SHUTDOWN.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAISED" in out.stdout and "shut down" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "NODE_IP 127.0.0.1" in out.stdout
    assert "Token authentication is disabled" not in out.stderr
    assert "SEQUENCER AFTER A NEW INIT" in out.stdout, out.stderr[-3000:]


_SHUTDOWN_INSIDE_THE_BLOCK = textwrap.dedent("""
    import asyncio
    import ray
    import orchestra as orc
    from orchestra import ResourcePool, Worker, WorkerGroup, endpoint
    from orchestra import dispatch as D

    class W(Worker):
        @endpoint(D.broadcast())
        def rank_of(self):
            return self.rank

    async def main():
        async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), W, group_name="x") as g:
            print("RANKS", await g.rank_of())
            orc.shutdown()  # inside the group's block (a finally, a signal handler): the block's end closes it again
        print("RAY AFTER THE BLOCK", ray.is_initialized())
        orc.init(num_cpus=64)  # a cluster started next serves new groups as usual
        async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), W, group_name="y") as g:
            print("RANKS AGAIN", await g.rank_of())
        orc.shutdown()

    orc.init(num_cpus=64)
    asyncio.run(main())
""")


def test_a_group_closed_after_orc_shutdown_starts_no_cluster():
    """Was: ``orc.shutdown()`` inside ``async with WorkerGroup(...)`` left the group's share of its pool to give
    back, so the block's end called Ray to remove placement groups that had ended with the cluster, and Ray's
    auto-init started a new local cluster (seconds, a second Ray session) just for that, left running."""
    out = subprocess.run([sys.executable, "-c", _SHUTDOWN_INSIDE_THE_BLOCK], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RANKS [0, 1]" in out.stdout and "RANKS AGAIN [0, 1]" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "RAY AFTER THE BLOCK False" in out.stdout, out.stdout + out.stderr[-3000:]
    assert out.stderr.count("Started a local Ray instance") == 2, out.stderr[-3000:]  # the two orc.init calls


@pytest.fixture(scope="module")
async def watched():
    """A 2-rank group whose rank 1 is SIGKILLed by the first test that uses it (the supervision test); the tests
    after it only need a group with a dead rank, so they share this one rather than start their own (one that runs
    alone kills rank 1 first)."""
    async with WorkerGroup(pool(2), Scorer, group_name="watched") as g:
        yield g


async def test_supervision_sees_a_death_while_the_controller_awaits_another_group(watched, scorers, orc_sequencer):
    g, other = watched, scorers[2]
    died = anyio.Event()
    seen: list[orc.WorkerDiedError] = []
    g.on_death(lambda e: (seen.append(e), died.set()))
    inflight = g.hold_until_cancelled()  # ends only when cancelled: still running when rank 1 dies
    pid = (await g.describe())[1]["pid"]
    assert [h["alive"] for h in g.health()] == [True, True]
    # another group's call that can end only after the death was seen: the test lets it through (position 0)
    # once ``died`` is set, so the controller is awaiting that call while the death arrives
    busy = other.hold(orc_sequencer, [[1], [2]])

    async def release_once_seen() -> None:
        await died.wait()
        async with orc_sequencer(0):
            pass

    os.kill(pid, signal.SIGKILL)
    with anyio.fail_after(30):  # a bound on a broken build only
        async with anyio.create_task_group() as tg:
            tg.start_soon(release_once_seen)
            assert await busy == [0, 1]
    assert (seen[0].group, seen[0].rank) == ("watched", 1)
    assert [h["alive"] for h in g.health()] == [True, False]
    with pytest.raises(orc.WorkerDiedError) as info:
        await inflight
    assert info.value.rank == 1 and info.value.endpoint == "hold_until_cancelled"
    with pytest.raises(orc.WorkerDiedError, match="nothing was sent"):
        g.sleep(1.0)


async def test_control_calls_after_a_death_name_group_and_rank(watched):
    g = watched
    if g.health()[1]["alive"]:  # run on its own: no earlier test killed it
        await kill_rank(g, 1)  # SIGKILL, then waits until the group reports the death
    for call in (g.ping, g.stats, g.describe, g.reset_stats):
        with pytest.raises(orc.WorkerDiedError) as info:
            await call()
        assert info.value.group == "watched" and info.value.rank == 1
