"""Choosing an advantage estimator and a policy loss from the config: typos get a did-you-mean, combinations that
cannot work are refused naming the key to change, and the config's choices stay in sync with the algorithms."""

import math
from pathlib import Path
from typing import get_args

import pytest

from pipelines import algorithms
from pipelines.config import ConfigError, PolicyLossKind, load_config
from pipelines.runner import Runner


def test_policy_loss_choices_match_the_algorithms():
    assert get_args(PolicyLossKind) == algorithms.POLICY_LOSSES


@pytest.mark.parametrize("override,message", [
    ("algorithm.adv_estimator=rlo", r"algorithm.adv_estimator: bad value 'rlo'.*\(did you mean 'rloo'\?\)"),
    ("actor.policy_loss=gpso", r"actor.policy_loss: bad value 'gpso'.*\(did you mean 'gspo'\?\)"),
    ("algorithm.adv_estimator=gae", r"algorithm.adv_estimator: bad value 'gae'; GAE needs a critic"),
    ("actor.rollout_is_cap=0", r"actor.rollout_is_cap: bad value 0.0; expected float > 0"),
])
def test_bad_recipe_choices_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_ppo_refuses_a_critic_free_estimator():
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: bad value 'rloo'; PPO computes GAE"):
        load_config(None, ["algorithm.name=ppo", "rollout.n=1", "algorithm.adv_estimator=rloo"])
    assert load_config(None, ["algorithm.name=ppo", "rollout.n=1", "algorithm.adv_estimator=gae"])


def test_dual_clip_only_with_the_ppo_clip():
    with pytest.raises(ConfigError, match="actor.dual_clip_c: .*not of actor.policy_loss='gmpo'"):
        load_config(None, ["actor.policy_loss=gmpo", "actor.dual_clip_c=3"])
    assert load_config(None, ["actor.dual_clip_c=3"]).actor.dual_clip_c == 3.0


def test_group_estimators_need_groups_and_reinforce_pp_does_not():
    with pytest.raises(ConfigError, match="rollout.n: bad value 1; .*adv_estimator='reinforce_pp_baseline'"):
        load_config(None, ["rollout.n=1", "algorithm.adv_estimator=reinforce_pp_baseline"])
    cfg = load_config(None, ["rollout.n=1", "algorithm.adv_estimator=reinforce_pp", "algorithm.kl_in=reward",
                             "algorithm.kl_coef=0.01"])
    assert (cfg.rollout.n, cfg.algorithm.kl_in) == (1, "reward")


def test_kl_in_reward_without_a_critic_only_for_reinforce_pp():
    with pytest.raises(ConfigError, match="algorithm.kl_in: bad value 'reward'; GRPO with adv_estimator 'rloo'"):
        load_config(None, ["algorithm.adv_estimator=rloo", "algorithm.kl_in=reward"])


DOC_COMMANDS = [  # the recipe commands of docs/algorithms.md, on the main job's file
    "algorithm.adv_estimator=rloo",
    "algorithm.adv_estimator=dr_grpo actor.loss_agg=seq-mean-token-sum-norm",
    "algorithm.adv_estimator=reinforce_pp_baseline",
    "algorithm.adv_estimator=reinforce_pp algorithm.kl_in=reward algorithm.kl_coef=0.01",
    "actor.clip_ratio_high=0.28",
    "actor.clip_ratio_high=0.28 algorithm.overlong_buffer=1",
    "actor.policy_loss=gspo actor.clip_ratio_low=3e-4 actor.clip_ratio_high=4e-4 actor.loss_agg=seq-mean-token-mean",
    "actor.policy_loss=gmpo actor.clip_ratio_low=0.4 actor.clip_ratio_high=0.4",
    "actor.policy_loss=cispo",
    "runner.max_staleness=1 actor.rollout_is_cap=2",
]


@pytest.mark.parametrize("command", DOC_COMMANDS)
def test_the_documented_recipe_commands_are_valid_configs(command):
    root = Path(__file__).resolve().parents[3]
    assert command in " ".join((root / "docs" / "algorithms.md").read_text().split())
    cfg = load_config(root / "examples" / "grpo_digits.yaml", command.split())
    for override in command.split():
        section, _, rest = override.partition(".")
        key, _, value = rest.partition("=")
        assert str(getattr(getattr(cfg, section), key)) in (value, str(float(value)) if value[0].isdigit() else value)


def test_adaptive_kl_needs_a_starting_coefficient():
    with pytest.raises(ConfigError, match="algorithm.kl_target: bad value 0.05; .*set algorithm.kl_coef > 0"):
        load_config(None, ["algorithm.kl_target=0.05"])
    cfg = load_config(None, ["algorithm.kl_target=0.05", "algorithm.kl_coef=0.01", "algorithm.kl_horizon=500"])
    assert (cfg.algorithm.kl_target, cfg.algorithm.kl_horizon) == (0.05, 500)


def test_overlong_penalty_only_where_it_is_wired_and_within_the_response_budget():
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer: .*not wired for algorithm.name='ppo'"):
        load_config(None, ["algorithm.name=ppo", "rollout.n=1", "algorithm.overlong_buffer=1"])
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer: .*adv_estimator 'reinforce_pp'"):
        load_config(None, ["algorithm.adv_estimator=reinforce_pp", "algorithm.overlong_buffer=1"])
    with pytest.raises(ConfigError, match=r"algorithm.overlong_buffer: bad value 4; must be <= rollout.max_new_tokens"):
        load_config(None, ["algorithm.overlong_buffer=4"])
    assert load_config(None, ["algorithm.overlong_buffer=2"]).algorithm.overlong_penalty == 1.0


_TINY_RUN = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "runner.micro_batches_per_step=2",
             "runner.total_steps=1", "runner.checkpoint_every=0", "runner.plot=false",
             "actor.warmup_steps=0"]  # the file's 80 warmup steps would outlast the one step


@pytest.mark.parametrize("command", DOC_COMMANDS)
@pytest.mark.slow  # ~2 s each: a real (in-process) cluster
async def test_every_documented_recipe_trains(tmp_path, command):
    """Each recipe command of docs/algorithms.md, on the main job's file, trains a step end to end (the in-process
    backend, no Ray; tiny batch): finite loss and grad norm, and the actor's weights move."""
    cfg = load_config(Path(__file__).resolve().parents[3] / "examples" / "grpo_digits.yaml",
                      [*command.split(), *_TINY_RUN, "resources.backend=local",
                       "resources.actor_workers=1", "resources.rollout_workers=1", "runner.trace=false",
                       f"runner.output_dir={tmp_path}"])
    (rec,) = await Runner(cfg, progress=False).run()
    assert math.isfinite(rec["actor/loss"]) and math.isfinite(rec["actor/grad_norm"]) and rec["actor/grad_norm"] > 0
    assert rec["actor/weights_version"] == 1 and rec["actor/skipped"] == 0


def test_adaptive_kl_horizon_must_keep_the_update_factor_positive():
    # 8 prompts x 4 samples = 32 samples a step: the factor 1 - 0.2 x 32 / horizon is > 0 only for horizon > 6.4
    job = ["data.prompts_per_step=8", "rollout.n=4", "algorithm.kl_coef=0.05", "algorithm.kl_target=10"]
    with pytest.raises(ConfigError, match=r"algorithm.kl_horizon: bad value 6; .*32 samples a step "
                                          r"\(data.prompts_per_step 8 x rollout.n 4\).*at least 7") as e:
        load_config(None, [*job, "algorithm.kl_horizon=6"])
    assert e.value.path == "algorithm.kl_horizon"
    assert load_config(None, [*job, "algorithm.kl_horizon=7"]).algorithm.kl_horizon == 7
    assert algorithms.min_kl_horizon(32) == 7 and algorithms.min_kl_horizon(35) == 8  # the controller's own bound
    with pytest.raises(ConfigError, match="algorithm.kl_horizon: set to 4, but algorithm.kl_target is null"):
        load_config(None, [*job[:2], "algorithm.kl_horizon=4"])  # no controller: never read


@pytest.mark.parametrize("key", ["runner.seed", "rollout.seed"])
def test_seeds_are_bounded_to_32_bits_in_the_config(key):
    # runner.seed goes to np.random.seed (< 2**32: it used to crash late, after config.json was written);
    # rollout.seed is folded to 32 bits by the sampling seed hash (2**32 used to run as seed 0)
    assert getattr(getattr(load_config(None, [f"{key}=4294967295"]), key.split(".")[0]), "seed") == 2**32 - 1
    with pytest.raises(ConfigError, match=rf"{key}.*4294967296.*<= 4294967295") as e:
        load_config(None, [f"{key}=4294967296"])
    assert e.value.path == key
