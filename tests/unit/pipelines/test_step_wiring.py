"""What the GRPO and PPO steps hand to the workers: each KL estimator in its own role, the critic's own schedule,
the advantage estimator, policy loss and truncated IS cap the config picks.

The cluster is a fake that records every call; futures resolve to fixed values at once.
"""

import pytest
import torch

from orchestra import Batch
from pipelines.config import load_config
from pipelines.grpo import grpo_step, whitening
from pipelines.kl_control import make_kl_controller
from pipelines.ppo import ppo_step
from pipelines.stage import StepContext
from step_fakes import FakeFuture


class FakeEndpoint:
    def __init__(self, calls, name, value):
        self.calls, self.name, self.value = calls, name, value

    def options(self, **_):
        return self

    def __call__(self, *args, **kwargs):
        self.calls.append((self.name, {**kwargs, "_args": args}))
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
    c.advantage = FakeGroup(calls, "advantage", {"gae": None, "reinforce_pp": None,
                                                 "moments": {"sum": 2.0, "sumsq": 6.0, "count": 4.0},
                                                 "kl_moments": {"sum": 0.9, "count": 10.0},
                                                 "response_lengths": {"response_length": torch.tensor([1, 2, 3, 3])}})
    return c


def _kwargs(calls, name):
    found = [kw for n, kw in calls if n == name]
    assert len(found) == 1, (name, calls)
    return found[0]


async def _run(step_fn, overrides, kl_ctl=None):
    cfg = load_config(None, overrides)
    calls = []
    rows = cfg.data.prompts_per_step * cfg.rollout.n
    ctx = StepContext(_cluster(calls, rows), cfg, 0, kl_ctl=kl_ctl)
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
    calls, _ = await _run(grpo_step, ["algorithm.kl_coef=0.05"])
    policy = _kwargs(calls, "actor.update_actor")["loss_fn"]
    assert (policy.kl_coef, policy.kl_estimator) == (0.05, "k3")


def _advantages(loss_call) -> list[float]:
    """The per-sequence advantages the controller put into the update's batch (a union of futures and one Batch)."""
    stack, found = [loss_call], []
    while stack:
        x = stack.pop()
        if isinstance(x, Batch):
            found.append(x)
        elif isinstance(x, FakeFuture):
            stack.append(x.value)
        elif isinstance(x, tuple):
            stack.extend(x)
    assert len(found) == 1, found
    return found[0]["advantages"].tolist()


ONE_GROUP = ["data.prompts_per_step=1", "rollout.n=4"]  # scores linspace(0, 1, 4) = [0, 1/3, 2/3, 1], mean 0.5


def test_whitening_is_the_population_mean_and_std_of_the_tokens():
    # sum 2, sumsq 6, count 4: mean 0.5, var 6/4 - 0.25 = 1.25, std 1.118034
    assert whitening({"sum": 2.0, "sumsq": 6.0, "count": 4.0}) == (0.5, pytest.approx(1.118034, abs=1e-6))


async def test_rloo_estimator_gives_leave_one_out_advantages():
    # n/(n-1) (s - mean) = 4/3 * [-1/2, -1/6, 1/6, 1/2] = [-2/3, -2/9, 2/9, 2/3]
    calls, metrics = await _run(grpo_step, [*ONE_GROUP, "algorithm.adv_estimator=rloo"])
    assert _advantages(_update_batch(calls)) == pytest.approx([-2 / 3, -2 / 9, 2 / 9, 2 / 3], abs=1e-6)
    assert "adv/std" not in metrics


async def test_dr_grpo_estimator_does_not_divide_by_the_group_std():
    calls, _ = await _run(grpo_step, [*ONE_GROUP, "algorithm.adv_estimator=dr_grpo"])
    assert _advantages(_update_batch(calls)) == pytest.approx([-0.5, -1 / 6, 1 / 6, 0.5], abs=1e-6)


async def test_reinforce_pp_baseline_centres_in_the_group_and_whitens_with_batch_moments():
    calls, metrics = await _run(grpo_step, [*ONE_GROUP, "algorithm.adv_estimator=reinforce_pp_baseline"])
    assert _advantages(_update_batch(calls)) == pytest.approx([-0.5, -1 / 6, 1 / 6, 0.5], abs=1e-6)
    policy = _kwargs(calls, "actor.update_actor")["loss_fn"]
    assert (policy.adv_mean, policy.adv_std) == (0.5, pytest.approx(1.118034, abs=1e-6))  # the fake moments
    assert metrics["adv/mean"] == 0.5


async def test_reinforce_pp_puts_the_kl_in_the_reward_on_the_advantage_workers():
    calls, metrics = await _run(grpo_step, ["rollout.n=1", "algorithm.adv_estimator=reinforce_pp",
                                            "algorithm.kl_coef=0.01", "algorithm.kl_in=reward", "algorithm.gamma=0.9"])
    rpp = _kwargs(calls, "advantage.reinforce_pp")
    assert (rpp["gamma"], rpp["kl_coef"], rpp["kl_estimator"]) == (0.9, 0.01, "k1")
    policy = _kwargs(calls, "actor.update_actor")["loss_fn"]
    assert policy.kl_coef == 0.0 and policy.adv_std == pytest.approx(1.118034, abs=1e-6)
    assert "adv/std" in metrics


@pytest.mark.parametrize("step,extra", [(grpo_step, []), (ppo_step, ["algorithm.name=ppo", "rollout.n=1"])])
async def test_policy_loss_and_is_cap_reach_the_loss_object(step, extra):
    calls, _ = await _run(step, [*extra, "actor.policy_loss=cispo", "actor.rollout_is_cap=2.5",
                                 "actor.clip_ratio_high=0.28"])
    policy = _kwargs(calls, "actor.update_actor")["loss_fn"]
    assert (policy.loss_type, policy.rollout_is_cap, policy.clip_ratio_high) == ("cispo", 2.5, 0.28)


def _update_batch(calls):
    return _kwargs(calls, "actor.update_actor")["_args"][0]


@pytest.mark.parametrize("step,extra,role", [
    (grpo_step, [], "loss"),
    (ppo_step, ["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_in=reward"], "reward"),
])
async def test_adaptive_kl_coefficient_is_used_then_moved_by_the_measured_kl(step, extra, role):
    overrides = [*extra, "algorithm.kl_coef=0.1", "algorithm.kl_target=0.06", "algorithm.kl_horizon=1000"]
    ctl = make_kl_controller(load_config(None, overrides))
    ctl.coef = 0.2  # as if earlier steps had raised it
    calls, metrics = await _run(step, overrides, kl_ctl=ctl)
    if role == "loss":
        assert _kwargs(calls, "actor.update_actor")["loss_fn"].kl_coef == 0.2
    else:
        assert _kwargs(calls, "advantage.gae")["kl_coef"] == 0.2
    # measured KL 0.9 / 10 = 0.09 per token: error 0.09 / 0.06 - 1 = 0.5 -> capped 0.2;
    # rows 32 x 8 = 256 (grpo) or 32 x 1 = 32 (ppo): coef 0.2 * (1 + 0.2 * rows / 1000)
    rows = 256 if role == "loss" else 32
    assert metrics["kl/mean"] == pytest.approx(0.09) and metrics["kl/coef"] == 0.2
    assert ctl.coef == pytest.approx(0.2 * (1 + 0.2 * rows / 1000))


async def test_fixed_kl_coefficient_without_a_target():
    calls, metrics = await _run(grpo_step, ["algorithm.kl_coef=0.05"])
    assert _kwargs(calls, "actor.update_actor")["loss_fn"].kl_coef == 0.05
    assert "kl/coef" not in metrics and not [n for n, _ in calls if n == "advantage.kl_moments"]


async def test_overlong_penalty_shapes_the_scores_before_the_group_baseline():
    # max_new_tokens 3, buffer 2: free up to 1 token; lengths [1, 2, 3, 3] -> penalty [0, -0.5, -1, -1]
    # scores [0, 1/3, 2/3, 1] -> shaped [0, -1/6, -1/3, 0]; mean -1/8; dr_grpo: [1/8, -1/24, -5/24, 1/8]
    calls, metrics = await _run(grpo_step, [*ONE_GROUP, "algorithm.adv_estimator=dr_grpo",
                                            "algorithm.overlong_buffer=2"])
    assert _advantages(_update_batch(calls)) == pytest.approx([1 / 8, -1 / 24, -5 / 24, 1 / 8], abs=1e-6)
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.625)
    assert metrics["reward/mean"] == pytest.approx(0.5)  # the task's reward, unshaped
