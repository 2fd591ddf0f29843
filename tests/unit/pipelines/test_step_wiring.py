"""What the GRPO and PPO steps hand to the workers: each KL estimator in its own role, the critic's own schedule.

The cluster is a fake that records every call; futures resolve to fixed values at once.
"""

import torch

from pipelines.config import load_config
from pipelines.grpo import grpo_step
from pipelines.ppo import ppo_step
from pipelines.stage import StepContext


class FakeFuture:
    def __init__(self, value):
        self.value = value

    def __or__(self, other):
        return FakeFuture(("union", self, other))

    def __await__(self):
        async def get():
            return self.value
        return get().__await__()

    async def wait(self):
        return None


class FakeEndpoint:
    def __init__(self, calls, name, value):
        self.calls, self.name, self.value = calls, name, value

    def options(self, **_):
        return self

    def __call__(self, *args, **kwargs):
        self.calls.append((self.name, kwargs))
        return FakeFuture(self.value)


class FakeGroup:
    def __init__(self, calls, role, values):
        for endpoint, value in values.items():
            setattr(self, endpoint, FakeEndpoint(calls, f"{role}.{endpoint}", value))


def _cluster(calls, rows):
    class C:
        pass
    c = C()
    c.reward = FakeGroup(calls, "reward", {"score": {"scores": torch.linspace(0, 1, rows)}})
    c.actor = FakeGroup(calls, "actor", {"compute_log_prob": None, "compute_ref_log_prob": None,
                                         "update_actor": {"actor/loss": 0.1}})
    c.critic = FakeGroup(calls, "critic", {"compute_values": None, "update_critic": {"critic/loss": 0.2}})
    c.advantage = FakeGroup(calls, "advantage", {"gae": None, "moments": {"sum": 0.0, "sumsq": 4.0, "count": 4.0}})
    return c


def _kwargs(calls, name):
    found = [kw for n, kw in calls if n == name]
    assert len(found) == 1, (name, calls)
    return found[0]


async def _run(step_fn, overrides):
    cfg = load_config(None, overrides)
    calls = []
    rows = cfg.data.prompts_per_step * cfg.rollout.n
    ctx = StepContext(_cluster(calls, rows), cfg, 0)
    metrics = await step_fn(ctx, FakeFuture(None))
    await ctx.settle()
    return calls, metrics


async def test_ppo_critic_trains_with_its_own_epochs_and_mini_batches():
    calls, metrics = await _run(ppo_step, ["algorithm.name=ppo", "rollout.n=1", "actor.ppo_epochs=4",
                                           "actor.mini_batches=2", "critic.ppo_epochs=1", "critic.mini_batches=8"])
    assert {k: _kwargs(calls, "critic.update_critic")[k] for k in ("ppo_epochs", "mini_batches")} == \
        {"ppo_epochs": 1, "mini_batches": 8}
    assert {k: _kwargs(calls, "actor.update_actor")[k] for k in ("ppo_epochs", "mini_batches")} == \
        {"ppo_epochs": 4, "mini_batches": 2}
    assert metrics["critic/loss"] == 0.2 and metrics["actor/loss"] == 0.1


async def test_ppo_kl_in_reward_uses_the_reward_estimator_and_no_loss_term():
    calls, _ = await _run(ppo_step, ["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_coef=0.1",
                                     "algorithm.kl_in=reward"])
    gae = _kwargs(calls, "advantage.gae")
    assert (gae["kl_coef"], gae["kl_estimator"]) == (0.1, "k1")
    policy = _kwargs(calls, "actor.update_actor")["loss_fn"]
    assert policy.kl_coef == 0.0


async def test_ppo_kl_in_loss_uses_the_loss_estimator():
    calls, _ = await _run(ppo_step, ["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_coef=0.1",
                                     "algorithm.kl_in=loss", "algorithm.kl_loss_estimator=k2"])
    assert _kwargs(calls, "advantage.gae")["kl_coef"] == 0.0
    policy = _kwargs(calls, "actor.update_actor")["loss_fn"]
    assert (policy.kl_coef, policy.kl_estimator) == (0.1, "k2")


async def test_grpo_kl_loss_uses_the_loss_estimator():
    calls, _ = await _run(grpo_step, ["algorithm.kl_coef=0.05", "algorithm.kl_reward_estimator=abs"])
    policy = _kwargs(calls, "actor.update_actor")["loss_fn"]
    assert (policy.kl_coef, policy.kl_estimator) == (0.05, "k3")
