"""Per-endpoint counters of the ranks (``group.stats()``; in-process backend, no Ray, and ``_Stats`` itself): failed
and cancelled calls counted apart; a stream's seconds; a reset of one colocated role leaves the others; a call running
across a reset is counted after it."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra._host import _Stats

import holding  # noqa: E402
from holding import Holding  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails


class Counted(Holding):
    @endpoint(D.broadcast())
    def boom(self) -> int:
        time.sleep(0.02)
        raise ValueError("boom")

    @endpoint(D.shard())
    def gen(self, batch: Batch):
        for i in range(3):
            time.sleep(0.05)
            yield Batch.from_dict({"y": batch["x"] + i})


class Other(Worker):
    @endpoint(D.broadcast())
    def ping2(self) -> int:
        return 1


def _pool(n: int) -> ResourcePool:
    return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend="local")


async def test_failed_and_cancelled_calls_are_counted_apart_from_the_calls_that_returned():
    """A failed or cancelled call counted in calls and seconds like one that returned: nothing told them apart."""
    g = WorkerGroup(_pool(1), Counted, group_name="counted")
    await g.ready()
    try:
        await holding.fail_cancel_and_hold(g)
        st = (await g.stats())[0]
        assert (st["boom"]["calls"], st["boom"]["errors"], st["boom"]["cancelled"]) == (1, 1, 0)
        assert st["boom"]["seconds"] > 0.01  # the time it ran, as before
        assert (st["hold"]["calls"], st["hold"]["errors"], st["hold"]["cancelled"]) == (2, 0, 1)
    finally:
        await g.aclose()


async def test_a_streaming_endpoint_counts_the_seconds_spent_in_its_generator():
    """A stream's seconds stayed 0 whatever it did."""
    g = WorkerGroup(_pool(2), Counted, group_name="streamed")
    await g.ready()
    try:
        parts = [p async for p in g.gen(Batch.from_dict({"x": torch.arange(4)})).parts()]
        assert len(parts) == 6
        st = [s["gen"] for s in await g.stats()]
        assert [s["calls"] for s in st] == [1, 1] and [s["parts_out"] for s in st] == [3, 3]
        assert all(0.12 < s["seconds"] < 2.0 for s in st), st
        assert [s["errors"] for s in st] == [0, 0]
    finally:
        await g.aclose()


async def test_resetting_one_colocated_roles_stats_leaves_the_other_roles():
    """A role's reset (the control call the group makes, with its role) wiped every role's counters of the rank."""
    views = WorkerGroup.colocate(_pool(2), {"actor": Counted, "critic": Other})
    a, c = views["actor"], views["critic"]
    await a.ready()
    try:
        await a.slow()
        await c.ping2()
        await a._control("reset_stats", a._role)
        assert [s["ping2"]["calls"] for s in await c.stats()] == [1, 1]
        assert await a.stats() == [{}, {}]
        await a._control("reset_stats")  # no role: every role of the rank, as before
        assert await c.stats() == [{}, {}]
    finally:
        await a.aclose()


async def test_group_reset_stats_of_one_colocated_role_leaves_the_other_roles():
    views = WorkerGroup.colocate(_pool(1), {"actor": Counted, "critic": Other})
    a, c = views["actor"], views["critic"]
    await a.ready()
    try:
        await a.slow()
        await c.ping2()
        await a.reset_stats()
        assert [s["ping2"]["calls"] for s in await c.stats()] == [1]
    finally:
        await a.aclose()


async def test_a_call_running_across_a_reset_is_counted_after_it():
    """reset swapped in new counters while the running call held the old ones: it vanished from stats."""
    g = WorkerGroup(_pool(1), Counted, group_name="across")
    await g.ready()
    try:
        holding.reset()
        fut = g.hold()
        await anyio.to_thread.run_sync(holding.began)  # it runs: the reset comes while it holds its counters
        await g.reset_stats()
        holding.RELEASE.set()
        await fut
        st = (await g.stats())[0]["hold"]
        assert st["calls"] == 1 and st["seconds"] > 0 and st["errors"] == 0
    finally:
        await g.aclose()


def test_stats_reset_while_calls_commit_loses_no_call_made_after_it():
    """The compute lane's updates and the control lane's reset under one lock: every call that begins after a reset
    and ends is counted exactly once, whatever the interleaving."""
    stats = _Stats()
    n = 20_000
    go = threading.Event()
    done = threading.Event()
    bad: list[dict] = []

    def compute() -> None:
        go.wait()
        for _ in range(n):
            tally, held = stats.begin("r", "ep")
            tally["bytes_in"] += 1
            stats.commit("r", "ep", tally, held, 0.0)
        done.set()

    def control() -> None:
        go.wait()
        while not done.is_set():
            stats.reset("r")
            snap = stats.snapshot("r").get("ep")
            if snap is not None and snap["bytes_in"] > snap["calls"]:  # a call's bytes without the call
                bad.append(snap)

    threads = [threading.Thread(target=compute), threading.Thread(target=control)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    assert bad == []
    stats.reset("r")
    tally, held = stats.begin("r", "ep")
    stats.reset("r")  # a reset while the call runs: the call counts after it
    tally["bytes_in"] += 5
    stats.commit("r", "ep", tally, held, 1.5)
    snap = stats.snapshot("r")["ep"]
    assert (snap["calls"], snap["bytes_in"], snap["seconds"]) == (1, 5, 1.5)
