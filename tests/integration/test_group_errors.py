"""Failures that only Ray shows: a rank's process exiting in the middle of a call, and placement checked against
the Ray cluster's resources.

Worker errors and their locations, fail-fast, deadlines, cancellation, bad input and colocation are checked
in-process by tests/unit/core/test_group_semantics_local.py; init errors, a pool that cannot fit, a rank killed
mid-call and cancellation on both backends by tests/contract."""

from __future__ import annotations

import asyncio

import anyio
import pytest

import orchestra as orc
from orchestra import ResourcePool, WorkerGroup
from orc_test_workers import Scorer


async def test_dead_actor_gives_worker_died_error(orc_sequencer):
    seq = orc_sequencer
    g = WorkerGroup(ResourcePool(process_on_nodes=[2]), Scorer, group_name="mortal")
    await g.ready()
    try:
        with pytest.raises(orc.WorkerDiedError) as info:
            # rank 0 passes 0 (it runs), rank 1 passes 1 and dies; rank 0 then waits for 3, after the test's 2
            await g.die_on(1, seq, [[0, 3], [1]])
        # reported without waiting for rank 0, whose call the failure cancelled (its wait for 3 then gives the
        # position back, or, if the cancel reaches it after the test passed 2, runs: either way nothing waits on it)
        async with seq(2):
            pass
        assert info.value.rank == 1 and info.value.endpoint == "die_on" and info.value.group == "mortal"
    finally:
        g.shutdown()


async def test_a_rank_that_aborts_leaves_every_python_threads_stack_in_its_log():
    """A rank's process killed by a fatal signal (here SIGABRT in the compute thread; in the wild a native library's
    heap check) writes the Python stack of each of its threads to its worker log, first, and not only the crashing
    thread's: the main thread (Ray's task loop) is there too, so a crash in a native thread is not left without a
    stack. The death, as supervision reports it, names that file (``describe()`` does too)."""
    import glob
    import os

    import ray

    async with WorkerGroup(ResourcePool(process_on_nodes=[2]), Scorer, group_name="aborts") as g:
        pid = (await g.pid())[1]
        described = await g.describe()
        died = asyncio.get_running_loop().create_future()
        g.on_death(lambda err: died.done() or died.set_result(err))
        # the call fails with the death supervision saw (naming the file), or with Ray's report of the call's
        # failure when that came first (pointing to supervision's)
        with pytest.raises(orc.WorkerDiedError, match=r"its log, /.*\.err|group\.health\(\) or on_death, names the"):
            await g.abort_on(1)
        with anyio.fail_after(60):  # a hang, not a threshold
            death = await died
        assert death.rank == 1
    logs = ray._private.worker._global_node.get_logs_dir_path()
    (err_log,) = glob.glob(os.path.join(logs, f"worker-*-{pid}.err"))
    assert all(d["log"] for d in described) and described[1]["log"] == err_log  # describe() names each rank's log
    assert f"its log, {err_log} (pid {pid}, on node " in death.message  # the death names the file to read
    with open(err_log, errors="replace") as f:
        text = f.read()
    crash = text[text.index("Fatal Python error: Aborted"):]
    assert "in abort_on" in crash  # the crashing thread (the compute lane)
    assert "in main_loop" in crash  # and another: Ray's main thread
    # written first, not after Ray's handler (which, on a corrupted heap, died before passing the signal on)
    assert "SIGABRT received" not in text[:text.index("Fatal Python error: Aborted")]


async def test_the_master_port_a_rank_hands_out_stays_bound_by_it():
    """``MASTER_PORT`` is picked by rank 0's process (``Host.address``), which keeps it bound (SO_REUSEADDR, not
    listening) for as long as it lives: no other process can bind it, or get it for an outgoing connection, before
    the rank's process group listens on it. Before, the port was picked free and released, and anything could take
    it in between, failing the group's start."""
    import socket

    async with WorkerGroup(ResourcePool(process_on_nodes=[1]), Scorer, group_name="port") as g:
        ip, port = await g._shared.hosts[0].address.remote()
        with socket.socket() as s, pytest.raises(OSError, match="Address already in use"):
            s.bind((ip, port))


async def test_placement_error_lists_needed_and_available():
    # fails at once, from the fit check (its message), not after waiting for placement: with an hour's
    # placement_timeout, only a hang would reach the bound
    pool = ResourcePool(process_on_nodes=[4], cpus_per_worker=64, placement_timeout=3600)
    g = WorkerGroup(pool, Scorer)
    with anyio.fail_after(120), pytest.raises(orc.PlacementError, match=r"CPU: need 256, available"):
        await g.ready()
    with pytest.raises(orc.PlacementError, match="GPU"):
        await WorkerGroup(ResourcePool(process_on_nodes=[1], use_gpu=True), Scorer).ready()
