"""Elastic restarts of in-process jobs (``resources.backend=local``), driven from inside the run so each failure
lands where the test says: a restart needs no Ray (in-process pools take no node capacity); one failure reported
twice is one restart; a restart whose new job already has a dead rank is not recorded as done."""

from __future__ import annotations

import json

import pytest
import ray
from local_jobs import kill_actor_once_at, local_runner

import orchestra as orc
from pipelines.cluster import Cluster

ONE_RESTART = ("runner.total_steps=2", "runner.checkpoint_every=0", "runner.max_restarts=1")


def _events(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" in r]


@pytest.mark.slow  # a real (in-process) job, ~5 s
async def test_an_in_process_job_restarts_after_a_death_without_ray(tmp_path, monkeypatch):
    def no_ray() -> list:  # what ray.nodes() does in a process without Ray, whatever this test session started
        raise ray.exceptions.RaySystemError("Ray has not been started yet")

    monkeypatch.setattr(ray, "nodes", no_ray)
    runner = local_runner(tmp_path, *ONE_RESTART)
    kill_actor_once_at(runner, 1)
    hist = await runner.run()
    assert [h["step"] for h in hist] == [0, 1]
    assert [(e["event"], e["step"], e["restart"]) for e in _events(tmp_path)] == [("restart", 1, 1)]


@pytest.mark.slow  # a real (in-process) job, ~5 s
async def test_a_death_reported_by_the_job_being_torn_down_is_not_another_restart(tmp_path, monkeypatch):
    """One failure can reach the runner twice: the awaited call fails first, then supervision reports the dead rank
    (or a lost node's ranks are reported one by one). What the job being torn down reports is part of the failure
    being handled, not a new one: one restart, and the run finishes. The old job's second death is reported while
    the restart closes it."""
    from orchestra.testing import kill_rank

    closing = Cluster.aclose
    reported: list[orc.WorkerDiedError] = []

    async def aclose_after_another_death(self: Cluster) -> None:
        if not reported and not self.reward.closed:  # the first teardown: the old job's reward rank dies too
            reported.append(await kill_rank(self.reward, 0))
        await closing(self)

    monkeypatch.setattr(Cluster, "aclose", aclose_after_another_death)
    runner = local_runner(tmp_path, *ONE_RESTART)
    kill_actor_once_at(runner, 1)
    hist = await runner.run()
    assert [(r.group, r.rank) for r in reported] == [("reward", 0)]  # the old job reported a second death
    assert [h["step"] for h in hist] == [0, 1]
    assert [(e["event"], e["step"], e["restart"]) for e in runner.restarts] == [("restart", 1, 1)]
    assert "group 'actor' rank 0" in runner.restarts[0]["reason"]


@pytest.mark.slow  # a real (in-process) job, ~6 s
async def test_a_rank_of_the_new_job_dead_before_its_restore_is_the_next_restart_not_a_recovery(tmp_path,
                                                                                              monkeypatch):
    """A rank of the rebuilt job that dies after its group started, while another group still starts, is seen when
    the restore begins: no restart is recorded as done for a job already failing; the next restart follows."""
    from orchestra.testing import kill_rank

    starting = Cluster.ready
    rebuilds: list[Cluster] = []

    async def ready_then_a_death_in_the_first_rebuild(self: Cluster) -> None:
        await starting(self)
        if killed and not rebuilds:
            rebuilds.append(self)
            await kill_rank(self.reward, 0)

    monkeypatch.setattr(Cluster, "ready", ready_then_a_death_in_the_first_rebuild)
    runner = local_runner(tmp_path, "runner.total_steps=2", "runner.checkpoint_every=0", "runner.max_restarts=2")
    killed = kill_actor_once_at(runner, 1)
    hist = await runner.run()
    assert len(rebuilds) == 1 and [h["step"] for h in hist] == [0, 1]
    assert [r.get("restart") for r in runner.restarts] == [None, 2]  # the first never finished: its job was failing
    assert "group 'actor' rank 0" in runner.restarts[0]["reason"]
    assert "group 'reward' rank 0" in runner.restarts[1]["reason"]
    assert "the worker process of rank 0 died" in runner.restarts[1]["reason"]  # told at the watch's registration
    assert [(e["event"], e["restart"]) for e in _events(tmp_path)] == [("restart", 2)]


@pytest.mark.slow  # a real (in-process) job, ~5 s
async def test_a_peers_error_that_comes_before_the_death_is_reported_still_restarts(tmp_path):
    """When a rank dies, its peers' collectives fail at once ("connection closed by peer"), often before supervision
    reports the death. The runner asks the job's ranks whether they are alive, finds the dead one and restarts,
    instead of failing the run with the peer's error."""
    runner = local_runner(tmp_path, *ONE_RESTART)
    step_fn, killed = runner.step_fn, []

    async def step_where_a_peer_fails_first(ctx, rollouts) -> dict:
        if ctx.step == 1 and not killed:
            killed.append(ctx.cluster.actor)
            ctx.cluster.actor.pool.backend.kill(ctx.cluster.actor.actors[0])  # not yet reported: no await since
            raise orc.WorkerError("Connection closed by peer", group="actor", rank=1, endpoint="compute_log_prob",
                                  exc_type="RuntimeError")
        return await step_fn(ctx, rollouts)

    runner.step_fn = step_where_a_peer_fails_first
    hist = await runner.run()
    assert [h["step"] for h in hist] == [0, 1]
    assert [(e["event"], e["step"], e["restart"]) for e in runner.restarts] == [("restart", 1, 1)]
    assert "group 'actor' rank 0" in runner.restarts[0]["reason"]
