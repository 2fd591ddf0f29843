"""The examples of docs/testing.md, run as they are written there: a dispatch transform and a pipeline step
tested with the orchestra pytest plugin (testing a Worker is tests/plugin_user/test_user_worker.py)."""

from __future__ import annotations

import pytest
import torch

import orchestra as orc
from orchestra import Batch, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra.dispatch import Plan
from orchestra.testing import FailOnCue, fail_rank
from pipelines.advantage_worker import AdvantageWorker

# these examples check semantics only: their groups run in process, even in this directory's Ray session
pytestmark = pytest.mark.orc_backend("local")


# -- a dispatch transform --------------------------------------------------------------------------------------------
class EvenRanks(D.Dispatch):
    """Run on the even ranks only; ``await`` gives ``{rank: result}``."""

    def check(self, plan: Plan) -> Plan:
        return plan.with_(ranks=tuple(r for r in plan.ranks if r % 2 == 0))

    def collect(self, plan: Plan, results: list) -> dict:
        return dict(zip(plan.ranks, results))


class Where(Worker):
    @endpoint(D.broadcast() | EvenRanks())
    def where(self) -> int:
        return self.rank


def test_even_ranks_plans_the_even_ranks_and_collects_by_rank():
    plan = Plan(group=None, endpoint="where", world_size=4, ranks=(0, 1, 2, 3), args=(), kwargs={})
    planned = EvenRanks().check(plan)
    assert planned.ranks == (0, 2)
    assert EvenRanks().collect(planned, ["a", "b"]) == {0: "a", 2: "b"}


async def test_even_ranks_runs_the_endpoint_on_even_ranks_only(make_group):
    group = await make_group(Where, ranks=3)
    assert await group.where() == {0: 0, 2: 2}
    assert [s.get("where", {}).get("calls", 0) for s in await group.stats()] == [1, 0, 1]


# -- a pipeline step -------------------------------------------------------------------------------------------------
class FakeRollout(FailOnCue):
    """Stands in for the rollout: fixed advantages and masks, so the step's result is known exactly."""

    @endpoint(D.shard())
    def generate(self, prompts: Batch) -> Batch:
        n = len(prompts)
        adv = prompts["x"].float()[:, None] * torch.tensor([[1.0, -1.0, 2.0]])
        mask = torch.tensor([[1, 1, 0]]).repeat(n, 1)
        return Batch.from_dict({"advantages": adv, "response_mask": mask})


async def mean_advantage_step(rollout: WorkerGroup, advantage: WorkerGroup, prompts: Batch) -> dict[str, float]:
    """A pipeline step: sample, then reduce on the workers that hold the rows (the rollout future is forwarded
    worker to worker; only three numbers reach the controller)."""
    rollouts = rollout.generate(prompts)
    m = await advantage.moments(rollouts, key="advantages")
    return {"advantage/mean": m["sum"] / m["count"], "tokens": m["count"]}


async def test_mean_advantage_step_reduces_over_the_valid_tokens(make_group):
    rollout = await make_group(FakeRollout, ranks=2)
    advantage = await make_group(AdvantageWorker, ranks=1)
    prompts = Batch.from_dict({"x": torch.arange(1, 5)})
    metrics = await mean_advantage_step(rollout, advantage, prompts)
    # valid tokens are columns 0 and 1 (x and -x): they cancel
    assert metrics == {"advantage/mean": 0.0, "tokens": 8.0}


async def test_mean_advantage_step_reports_the_failing_rollout_rank(make_group):
    rollout = await make_group(FakeRollout, ranks=2)
    advantage = await make_group(AdvantageWorker, ranks=1)
    await fail_rank(rollout, 1, "generate")
    with pytest.raises(orc.WorkerError) as e:
        await mean_advantage_step(rollout, advantage, Batch.from_dict({"x": torch.arange(1, 5)}))
    assert (e.value.group, e.value.rank, e.value.endpoint) == ("FakeRollout", 1, "generate")
