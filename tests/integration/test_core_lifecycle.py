"""Errors after deaths and shutdowns, group lifecycle, cancellation and deadlines that leave nothing behind."""

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
from orc_test_workers import Hazard


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


def pool(n: int) -> ResourcePool:
    return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.1)


async def _sigkill(g: WorkerGroup, rank: int) -> None:
    pid = (await g.describe())[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    with anyio.fail_after(30):
        while True:  # until Ray has noticed the death
            try:
                await g.ping()
            except orc.WorkerDiedError:
                return
            await anyio.sleep(0.05)


async def test_control_calls_after_a_death_name_group_and_rank():
    async with WorkerGroup(pool(2), Hazard, group_name="dead-ctl") as g:
        await _sigkill(g, 1)
        for call in (g.ping, g.stats, g.describe, g.reset_stats):
            with pytest.raises(orc.WorkerDiedError) as info:
                await call()
            assert info.value.group == "dead-ctl" and info.value.rank == 1


async def test_reading_a_dead_groups_future_blames_that_group():
    async with WorkerGroup(pool(2), Hazard, group_name="producer") as src, \
            WorkerGroup(pool(2), Hazard, group_name="consumer") as dst:
        await _sigkill(src, 1)
        with pytest.raises(orc.WorkerDiedError) as info:
            await dst.echo(src.echo(xs(4)))
        assert (info.value.group, info.value.rank) == ("producer", 1)


async def test_upstream_worker_error_is_reported_at_the_upstream_rank():
    async with WorkerGroup(pool(2), Hazard, group_name="up") as src, \
            WorkerGroup(pool(2), Hazard, group_name="down") as dst:
        with pytest.raises(orc.WorkerError) as info:
            await dst.echo(src.gen_fail(xs(4)))
        assert (info.value.group, info.value.endpoint) == ("up", "gen_fail")


async def test_failed_generator_raises_a_plain_worker_error(h2):
    with pytest.raises(orc.WorkerError) as info:
        await h2.gen_fail(xs(4))
    e = info.value
    assert type(e) is orc.WorkerError
    assert str(e).splitlines()[0].startswith("ValueError: generator failed on rank")
    assert "\x1b[" not in str(e)


@pytest.fixture(scope="module")
async def h2():
    async with WorkerGroup(pool(2), Hazard, group_name="life2") as g:
        yield g


async def test_shutdown_right_after_construction_leaks_nothing():
    free = ray.available_resources()["CPU"]
    g = WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=free / 2), Hazard, group_name="early")
    g.shutdown()
    # every free CPU is free again: a pool of all of them places
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=free / 2,
                                        placement_timeout=20), Hazard, group_name="after") as g2:
        assert await g2.seen_calls() == [0, 0]
    with pytest.raises(orc.GroupClosedError, match="was shut down"):
        await g.ping()


async def test_a_call_in_flight_at_shutdown_says_so():
    g = WorkerGroup(pool(2), Hazard, group_name="closing")
    await g.ready()
    fut = g.sleep(20.0)
    await g.aclose()
    with pytest.raises(orc.GroupClosedError, match="'closing' was shut down"):
        await fut
    with pytest.raises(orc.GroupClosedError, match="was shut down"):
        g.sleep(1.0)


async def test_bad_options_name_the_option(h2):
    with pytest.raises(ValueError, match="timeout"):
        h2.sleep.options(timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        h2.sleep.options(timeout="abc")
    with pytest.raises(TypeError, match="stream"):
        h2.sleep.options(stream="yes")


async def test_timeout_on_a_queued_call_means_it_never_runs(h2):
    before = await h2.seen_calls()
    slow = h2.per_part(h2.slow_gen(xs(8), pieces=4, delay=0.3))  # holds the group's send order until its last part
    queued = h2.mark.options(timeout=0.05)("late")
    with pytest.raises(orc.CallTimeoutError):
        await queued
    await slow
    assert await h2.seen_calls() == before  # "late" was never sent


async def test_cancelled_stream_leaves_no_task(h2):
    baseline = len(asyncio.all_tasks())
    fut = h2.per_part(h2.slow_gen(xs(8), pieces=4, delay=0.5))
    await asyncio.sleep(0)
    fut.cancel()
    with pytest.raises(orc.CallCancelledError):
        await fut
    with anyio.fail_after(10):
        while len(asyncio.all_tasks()) > baseline:
            await asyncio.sleep(0.01)
    assert await h2.seen_calls() == await h2.seen_calls()  # group still answers


async def test_remote_cancel_is_an_orchestra_error_in_other_awaiters(h2):
    fut = h2.sleep(10.0)
    fut.cancel()
    with pytest.raises(orc.CallCancelledError, match="cancelled"):
        await fut


_AFTER_SHUTDOWN = textwrap.dedent("""
    import anyio, sys
    import orchestra as orc
    sys.path.insert(0, {tests!r})
    from orc_test_workers import Hazard

    async def main():
        orc.init(num_cpus=2)
        g = orc.WorkerGroup(orc.ResourcePool(process_on_nodes=[1], cpus_per_worker=0.1), Hazard)
        await g.ready()
        import ray
        print("NODE_IP", ",".join(n["NodeManagerAddress"] for n in ray.nodes()))
        fut = g.sleep(30.0)
        orc.shutdown()
        with anyio.fail_after(10):
            try:
                await fut
            except orc.OrchestraError as e:
                print("RAISED", type(e).__name__, e)

    anyio.run(main)
""")


def test_await_after_orc_shutdown_fails_at_once_and_cluster_is_loopback_with_auth():
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    code = _AFTER_SHUTDOWN.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAISED" in out.stdout and "shut down" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "NODE_IP 127.0.0.1" in out.stdout
    assert "Token authentication is disabled" not in out.stderr


async def test_supervision_sees_a_death_while_the_controller_awaits_another_group():
    async with WorkerGroup(pool(2), Hazard, group_name="watched") as g, \
            WorkerGroup(pool(1), Hazard, group_name="busy") as other:
        died = anyio.Event()
        seen: list[orc.WorkerDiedError] = []
        g.on_death(lambda e: (seen.append(e), died.set()))
        inflight = g.sleep(30.0)
        pid = (await g.describe())[1]["pid"]
        assert [h["alive"] for h in g.health()] == [True, True]
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(30):
            await other.sleep(0.2)  # the controller is busy with another group meanwhile
            await died.wait()
        assert (seen[0].group, seen[0].rank) == ("watched", 1)
        assert [h["alive"] for h in g.health()] == [True, False]
        with pytest.raises(orc.WorkerDiedError) as info:
            await inflight
        assert info.value.rank == 1 and info.value.endpoint == "sleep"
        with pytest.raises(orc.WorkerDiedError, match="nothing was sent"):
            g.sleep(1.0)
