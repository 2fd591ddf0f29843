"""Failures: worker exceptions, dead actors, deadlines, cancellation, bad input, placement."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orc_test_workers import Actor, BadInit, Critic, Scorer


@pytest.fixture(scope="module")
async def g3(scorers):
    """The session's 3-rank Scorer group (conftest)."""
    return scorers[3]


def xs(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


async def test_worker_error_names_location_and_fails_fast(g3, sequencer):
    seq = sequencer
    with pytest.raises(orc.WorkerError) as info:
        await g3.fail_on(1, seq, [[1], [], [2]])  # ranks 0 and 2 wait for position 0, which the test holds
    # did not wait for the other ranks: they are let through only now, and pass positions 1 and 2 before 3
    async with seq(0):
        pass
    async with seq(3):
        pass
    e = info.value
    assert type(e) is orc.WorkerError
    assert (e.group, e.rank, e.endpoint, e.exc_type) == (g3.name, 1, "fail_on", "ValueError") and g3.name == "s3"
    assert "boom on 1" in str(e) and "Traceback" in e.remote_traceback and "fail_on" in e.remote_traceback
    assert await g3.get_scale() == [1.0] * 3


async def test_upstream_error_surfaces_downstream(g3):
    # the upstream result lacks the column that score requires: the worker rejects it with the location
    with pytest.raises(orc.WorkerError, match="missing column") as info:
        await g3.score(g3.echo(Batch.from_dict({"y": torch.arange(6)})))
    assert info.value.endpoint == "score"
    # an upstream failure fails the forwarded call with the upstream's own error
    with pytest.raises(orc.WorkerError, match="missing column") as info:
        await g3.plus_one(g3.score(g3.echo(Batch.from_dict({"y": torch.arange(6)}))))
    assert info.value.endpoint == "score"
    # a plain-value future cannot be split by rows: the error says so
    with pytest.raises(orc.WorkerError, match="not a Batch"):
        await g3.score(g3.get_scale())


async def test_deadline_names_running_ranks_and_cancels_work(g3):
    await g3.take_outcomes()
    with pytest.raises(orc.CallTimeoutError) as info:
        await g3.hold_until_cancelled.options(timeout=0.5)()  # ends only when cancelled
    assert isinstance(info.value, TimeoutError)
    assert info.value.pending_ranks == (0, 1, 2)
    assert "rank(s) [0, 1, 2] still running" in str(info.value)
    # every rank stopped because of the deadline's cancel: it saw it while running, or skipped the queued call
    assert all(o in ([], ["cancelled"]) for o in await g3.take_outcomes())
    assert await g3.get_scale() == [1.0] * 3


async def test_cancelling_the_awaiting_task_cancels_ray_work(g3, sequencer):
    await g3.take_outcomes()

    async def waiter():
        return await g3.hold_until_cancelled(sequencer)

    task = asyncio.create_task(waiter())
    async with sequencer(3):  # ranks 0..2 passed positions 0..2: the call runs on every rank
        pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await g3.take_outcomes() == [["cancelled"]] * 3  # each running rank saw the cancel and stopped
    assert await g3.get_scale() == [1.0] * 3


async def test_bad_input_rejected_before_sending(g3):
    await g3.reset_stats()
    with pytest.raises(orc.DispatchError, match=r"missing column\(s\) \['x'\]"):
        g3.score(Batch.from_dict({"y": torch.arange(6)}))
    with pytest.raises(orc.DispatchError, match="2 rows cannot be sharded over 3"):
        g3.score(xs(2))
    with pytest.raises(orc.DispatchError, match="argument 0 has 2 entries but the group has 3 ranks"):
        g3.take([1, 2])
    with pytest.raises(orc.DispatchError, match="signature"):
        g3.score(xs(6), 1, 2)
    with pytest.raises(orc.DispatchError, match="needs at least one Batch"):
        g3.score(None)
    with pytest.raises(AttributeError, match="has no endpoint 'nope'"):
        g3.nope
    stats = await g3.stats()
    assert all("score" not in s or s["score"]["calls"] == 0 for s in stats)


async def test_dead_actor_gives_worker_died_error(sequencer):
    seq = sequencer
    g = WorkerGroup(ResourcePool(process_on_nodes=[2]), Scorer, group_name="mortal")
    await g.ready()
    try:
        with pytest.raises(orc.WorkerDiedError) as info:
            # rank 0 passes 0 (it runs), rank 1 passes 1 and dies; rank 0 then waits for 3, after the test's 2
            await g.die_on(1, seq, [[0, 3], [1]])
        # reported without waiting for rank 0: it is let through only now, passes 3, and the test enters 4
        async with seq(2):
            pass
        async with seq(4):
            pass
        assert info.value.rank == 1 and info.value.endpoint == "die_on" and info.value.group == "mortal"
    finally:
        g.shutdown()


async def test_killed_actor_mid_call(sequencer):
    import ray

    g = WorkerGroup(ResourcePool(process_on_nodes=[2]), Scorer, group_name="victim")
    await g.ready()
    try:
        fut = g.hold_until_cancelled(sequencer)
        async with sequencer(2):  # both ranks passed positions 0 and 1: the call runs on each
            pass
        ray.kill(g.actors[0])
        with pytest.raises(orc.WorkerDiedError) as info:
            await fut
        assert info.value.rank == 0
    finally:
        g.shutdown()


async def test_init_error_names_rank():
    g = WorkerGroup(ResourcePool(process_on_nodes=[2]), BadInit)
    with pytest.raises(orc.WorkerError) as info:
        await g.ready()
    assert info.value.rank == 1 and info.value.endpoint == "__init__"
    assert "cannot build model on rank 1" in str(info.value)
    g.shutdown()


async def test_placement_error_lists_needed_and_available():
    # fails at once, from the fit check (its message), not after waiting for placement: with an hour's
    # placement_timeout, only a hang would reach the bound
    pool = ResourcePool(process_on_nodes=[4], cpus_per_worker=64, placement_timeout=3600)
    g = WorkerGroup(pool, Scorer)
    with anyio.fail_after(120), pytest.raises(orc.PlacementError, match=r"CPU: need 256, available"):
        await g.ready()
    with pytest.raises(orc.PlacementError, match="GPU"):
        await WorkerGroup(ResourcePool(process_on_nodes=[1], use_gpu=True), Scorer).ready()


async def test_colocated_roles_share_processes():
    views = WorkerGroup.colocate(ResourcePool(process_on_nodes=[2]), {"actor": Actor, "critic": Critic},
                                 actor={"lr": 0.5}, critic=(1.0,))
    actor, critic = views["actor"], views["critic"]
    try:
        await actor.ready()
        assert await actor.pid() == await critic.pid()
        assert await actor.get_lr() == [0.5, 0.5]
        out = await critic.values(xs(5))
        assert torch.equal(out["v"], torch.arange(5).double() + 1.0)
        d = await critic.describe()
        assert d[0]["roles"] == ["actor", "critic"]
        assert actor.name == "actor+critic/actor"
        with pytest.raises(TypeError, match="unknown role"):
            WorkerGroup.colocate(ResourcePool(process_on_nodes=[1]), {"a": Actor}, b={})
    finally:
        actor.shutdown()
