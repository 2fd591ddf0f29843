"""Property: cancel or time out a call at any point of its life and nothing is left behind — no task, no entry in
the group's calls in flight, no placement group — and the group answers the next call correctly."""

from __future__ import annotations

import asyncio
import gc

import anyio
import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orc_test_workers import Hazard


@pytest.fixture(scope="module")
async def hp():
    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.1), Hazard, group_name="prop") as g:
        yield g


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


def _call(g: WorkerGroup, kind: str, timeout: float | None) -> orc.DataFuture:
    opts = {"timeout": timeout} if timeout else {}
    if kind == "broadcast":
        return g.sleep.options(**opts)(0.3)
    if kind == "shard-large":  # goes through the invocation's task: off-loop puts, then send
        return g.total.options(**opts)(xs(40_000))
    if kind == "generator":
        return g.slow_gen.options(**opts)(xs(8), pieces=4, delay=0.05)
    if kind == "stream":
        return g.per_part.options(**opts)(g.slow_gen(xs(8), pieces=4, delay=0.05))
    return g.total.options(**opts)(g.echo(xs(16)))  # forwarded


def _our_tasks() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t.get_name().startswith("orchestra:")}


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["broadcast", "shard-large", "generator", "stream", "forwarded"]),
       action=st.sampled_from(["cancel", "timeout", "cancel-awaiter", "none"]),
       ticks=st.integers(0, 3), wait_ms=st.sampled_from([0, 5, 50, 200]))
async def test_cancel_or_timeout_anywhere_leaves_nothing(hp, kind, action, ticks, wait_ms):
    pgs_before = len(ray.util.placement_group_table())
    fut = _call(hp, kind, 0.02 + wait_ms / 2000 if action == "timeout" else None)
    for _ in range(ticks):
        await asyncio.sleep(0)
    await asyncio.sleep(wait_ms / 1000)
    if action == "cancel":
        fut.cancel()
    if action == "cancel-awaiter":
        task = asyncio.ensure_future(fut.wait())
        await asyncio.sleep(0)
        if task.cancel():  # the awaiting task itself sees CancelledError; the call is cancelled for everyone
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            await task
    try:
        await fut
    except (orc.CallCancelledError, orc.CallTimeoutError):
        assert action != "none"
    del fut
    gc.collect()
    with anyio.fail_after(20):
        while _our_tasks() or len(hp._shared.live):
            await asyncio.sleep(0.01)
    assert len(ray.util.placement_group_table()) == pgs_before
    out = await hp.total(xs(10))
    assert out["t"].tolist() == [10] * 5 + [35] * 5
