"""Config knobs of the training math: finite floats, the two KL estimators, the critic's own schedule."""

import re

import pytest
import yaml

from pipelines.cluster import engine_config, optimizer_steps
from pipelines.config import ActorConfig, Config, ConfigError, CriticConfig, config_from_dict, load_config


@pytest.mark.parametrize("override, value", [
    ("actor.lr=.inf", "inf (float)"),
    ("actor.lr=inf", "'inf' (str)"),
    ("critic.lr=-.inf", "-inf (float)"),
    ("actor.entropy_coef=.nan", "nan (float)"),
    ("actor.grad_clip=.inf", "inf (float)"),  # optional float: still must be finite
    ("algorithm.kl_coef=1e999", "'1e999' (str)"),
])
def test_non_finite_floats_are_rejected_naming_the_field(override, value):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"{field}: bad value {value}; expected a finite float")) as e:
        load_config(None, [override])
    assert e.value.path == field


def test_kl_estimators_have_separate_roles_and_defaults():
    alg = load_config(None, []).algorithm
    assert (alg.kl_reward_estimator, alg.kl_loss_estimator) == ("k1", "k3")
    alg = load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_loss_estimator=abs"]).algorithm
    assert (alg.kl_reward_estimator, alg.kl_loss_estimator) == ("k1", "abs")
    alg = load_config(None, ["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_coef=0.1", "algorithm.kl_in=reward",
                             "algorithm.kl_reward_estimator=k2"]).algorithm
    assert (alg.kl_reward_estimator, alg.kl_loss_estimator) == ("k2", "k3")


def test_old_kl_estimator_key_says_what_replaced_it(tmp_path):
    message = ("unknown key 'algorithm.kl_estimator': it was split in two: algorithm.kl_reward_estimator (the KL "
               "penalty in the reward, default k1) and algorithm.kl_loss_estimator (the KL loss term, default k3)")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["algorithm.kl_estimator=k3"])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"algorithm": {"kl_estimator": "k3"}}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


def test_critic_has_every_optimizer_knob_of_the_actor():
    actor = set(ActorConfig.model_fields)
    critic = set(CriticConfig.model_fields)
    policy_only = {"clip_ratio_low", "clip_ratio_high", "dual_clip_c", "entropy_coef", "policy_loss",
                   "rollout_is_cap"}
    assert actor - policy_only <= critic


def test_critic_engine_gets_the_critics_own_schedule():
    cfg = config_from_dict({
        "algorithm": {"name": "ppo"}, "rollout": {"n": 1}, "runner": {"total_steps": 10},
        "actor": {"lr_schedule": "cosine", "min_lr_ratio": 0.5, "beta2": 0.99, "ppo_epochs": 4, "mini_batches": 2},
        "critic": {"lr": 3e-4, "lr_schedule": "cosine", "min_lr_ratio": 0.1, "beta2": 0.95, "warmup_steps": 2,
                   "ppo_epochs": 2, "mini_batches": 3, "grad_clip": 5.0, "micro_batch_size": 16},
    })
    assert optimizer_steps(cfg, cfg.critic) == 10 * 2 * 3
    assert optimizer_steps(cfg, cfg.actor) == 10 * 4 * 2
    eng = engine_config(cfg, cfg.critic, optimizer_steps(cfg, cfg.critic), seed=1)
    assert (eng.lr, eng.lr_schedule, eng.min_lr_ratio, eng.betas, eng.warmup_steps) == (3e-4, "cosine", 0.1,
                                                                                          (0.9, 0.95), 2)
    assert (eng.total_steps, eng.grad_clip, eng.micro_batch_size) == (60, 5.0, 16)


def test_critic_mini_batches_checked_against_the_step_rows():
    with pytest.raises(ConfigError, match=re.escape("critic.mini_batches: bad value 1000; a step has only 32 rows")):
        load_config(None, ["algorithm.name=ppo", "rollout.n=1", "critic.mini_batches=1000"])
    assert Config().critic.mini_batches == 1  # GRPO has no critic: a critic knob is refused as never read
    with pytest.raises(ConfigError, match=re.escape("critic.mini_batches: set to 1000, but algorithm.name=grpo has "
                                                    "no critic")):
        load_config(None, ["critic.mini_batches=1000"])


def test_kl_in_reward_needs_ppo():
    with pytest.raises(ConfigError, match=re.escape("algorithm.kl_in: bad value 'reward'; GRPO")):
        load_config(None, ["algorithm.kl_in=reward", "algorithm.kl_coef=0.1"])


def test_ppo_example_is_a_ppo_job_with_kl_in_the_reward():
    cfg = load_config("examples/ppo_digits.yaml")
    assert (cfg.algorithm.name, cfg.algorithm.kl_in, cfg.algorithm.kl_reward_estimator) == ("ppo", "reward", "k1")
    assert cfg.data.prompts_per_step * cfg.rollout.n >= 1024  # PPO needs the samples (docs/algorithms.md)
