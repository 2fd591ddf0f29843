"""Settings the chosen configuration never reads are refused (the run behaved as if they were not given), naming the
field, why it is not read and what would make it count; the same settings at their defaults, a saved config (which
holds every default) and the configurations that do read them still load.

- ``algorithm.whiten_advantages=false`` under GRPO/DAPO: only PPO reads it (REINFORCE++ whitened anyway);
- ``critic.*`` under GRPO/DAPO (no critic); ``algorithm.lam`` / ``gamma`` / ``norm_adv_by_std`` / ``adv_eps`` /
  ``dynamic_sampling_max_rounds`` where the step or estimator does not read them;
- the KL knobs of a KL form that is not used (``kl_horizon`` without ``kl_target``, the estimator of the other
  ``kl_in``, ``kl_in=reward`` with no KL);
- ``min_lr_ratio`` with a constant schedule, ``data.seed`` unshuffled, ``runner.restart_timeout_s`` with no restarts,
  ``runner.keep_checkpoints`` with no checkpoints, ``runner.plot`` without metrics or without matplotlib;
- (not refused) a warmup as long as the run: a warning naming the numbers, set or default (it acts as set, cut short);
- ``runner.output_dir`` given as ``~`` / ``null`` (YAML's no value) on the command line as in a file.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import yaml

from pipelines.cli import main as cli_main
from pipelines.config import ConfigError, config_from_dict, config_to_dict, load_config

# (overrides, the field the error names, a phrase of the reason)
REFUSED = [
    # 1. whitening: only PPO reads it
    (["algorithm.whiten_advantages=false"], "algorithm.whiten_advantages", "normalizes each prompt's group"),
    (["algorithm.adv_estimator=reinforce_pp", "algorithm.whiten_advantages=false"], "algorithm.whiten_advantages",
     "by definition"),
    (["algorithm.adv_estimator=reinforce_pp_baseline", "algorithm.whiten_advantages=false"],
     "algorithm.whiten_advantages", "by definition"),
    (["algorithm.name=dapo", "algorithm.whiten_advantages=false"], "algorithm.whiten_advantages", "only PPO"),
    (["algorithm.adv_estimator=remax", "algorithm.whiten_advantages=false"], "algorithm.whiten_advantages",
     "only PPO"),
    # 2. the critic: PPO only
    (["critic.lr=5e-2"], "critic.lr", "no critic"),
    (["critic.value_clip=0.5"], "critic.value_clip", "no critic"),
    (["critic.value_clip=null"], "critic.value_clip", "no critic"),
    (["critic.ppo_epochs=4"], "critic.ppo_epochs", "no critic"),
    (["critic.mini_batches=4"], "critic.mini_batches", "no critic"),
    (["critic.warmup_steps=3"], "critic.warmup_steps", "no critic"),
    (["critic.lr_schedule=cosine"], "critic.lr_schedule", "no critic"),
    (["critic.beta2=0.99"], "critic.beta2", "no critic"),
    (["critic.weight_decay=0.1"], "critic.weight_decay", "no critic"),
    (["critic.grad_clip=null"], "critic.grad_clip", "no critic"),
    (["critic.micro_batch_size=8"], "critic.micro_batch_size", "no critic"),
    (["critic.loss_agg=seq-mean-token-mean"], "critic.loss_agg", "no critic"),
    (["algorithm.name=dapo", "critic.lr=5e-2"], "critic.lr", "no critic"),
    # 3. advantage settings of another step or estimator
    (["algorithm.lam=0.9"], "algorithm.lam", "GAE"),
    (["algorithm.name=dapo", "algorithm.lam=0.9"], "algorithm.lam", "GAE"),
    (["algorithm.gamma=0.5"], "algorithm.gamma", "reinforce_pp"),
    (["algorithm.adv_estimator=reinforce_pp_baseline", "algorithm.gamma=0.5"], "algorithm.gamma", "reinforce_pp"),
    (["algorithm.name=ppo", "rollout.n=1", "algorithm.norm_adv_by_std=false"], "algorithm.norm_adv_by_std",
     "PPO"),
    (["algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std=false"], "algorithm.norm_adv_by_std", "rloo"),
    (["algorithm.adv_estimator=dr_grpo", "algorithm.norm_adv_by_std=false"], "algorithm.norm_adv_by_std",
     "dr_grpo"),
    (["algorithm.name=ppo", "rollout.n=1", "algorithm.adv_eps=0.1"], "algorithm.adv_eps", "PPO"),
    (["algorithm.adv_estimator=dr_grpo", "algorithm.adv_eps=0.5"], "algorithm.adv_eps", "dr_grpo"),
    (["algorithm.norm_adv_by_std=false", "algorithm.adv_eps=0.5"], "algorithm.adv_eps", "norm_adv_by_std=false"),
    (["algorithm.dynamic_sampling_max_rounds=10"], "algorithm.dynamic_sampling_max_rounds", "dapo"),
    (["algorithm.name=ppo", "rollout.n=1", "algorithm.dynamic_sampling_max_rounds=0"],
     "algorithm.dynamic_sampling_max_rounds", "dapo"),
    # 4. KL settings of a KL form that is not used
    (["algorithm.kl_horizon=500"], "algorithm.kl_horizon", "kl_target"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_horizon=500"], "algorithm.kl_horizon", "kl_target"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_reward_estimator=k3"], "algorithm.kl_reward_estimator", "kl_in=loss"),
    (["algorithm.kl_reward_estimator=k3"], "algorithm.kl_reward_estimator", "kl_coef is 0"),
    (["algorithm.kl_loss_estimator=k1"], "algorithm.kl_loss_estimator", "kl_coef is 0"),
    (["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_coef=0.1", "algorithm.kl_in=reward",
      "algorithm.kl_loss_estimator=k1"], "algorithm.kl_loss_estimator", "kl_in=reward"),
    (["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_in=reward"], "algorithm.kl_in", "kl_coef is 0"),
    (["algorithm.adv_estimator=reinforce_pp", "algorithm.kl_in=reward"], "algorithm.kl_in", "kl_coef is 0"),
    # 5. schedule, data and runner settings with nothing to act on
    (["actor.min_lr_ratio=0.5"], "actor.min_lr_ratio", "lr_schedule is constant"),
    (["algorithm.name=ppo", "rollout.n=1", "critic.min_lr_ratio=0.5"], "critic.min_lr_ratio",
     "lr_schedule is constant"),
    (["data.shuffle=false", "data.seed=7"], "data.seed", "data.shuffle=false"),
    (["runner.max_restarts=0", "runner.restart_timeout_s=5"], "runner.restart_timeout_s", "max_restarts"),
    (["runner.checkpoint_every=0", "runner.keep_checkpoints=1"], "runner.keep_checkpoints", "checkpoint_every"),
    (["runner.metrics=false", "runner.plot=true"], "runner.plot", "runner.metrics=false"),
    # 8. YAML's no value as runner.output_dir
    (["runner.output_dir=~"], "runner.output_dir", "YAML reads"),
    (["runner.output_dir=null"], "runner.output_dir", "YAML reads"),
    (["runner.output_dir=NULL"], "runner.output_dir", "YAML reads"),
    (["data.prompt_key=~"], "data.prompt_key", "YAML reads"),
]


@pytest.mark.parametrize("overrides, field, reason", REFUSED, ids=[" ".join(o) for o, _, _ in REFUSED])
def test_a_setting_that_is_never_read_is_refused(overrides, field, reason):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.path == field
    assert str(e.value).startswith(f"{field}: ")
    assert reason in str(e.value)


@pytest.mark.parametrize("overrides, field, reason", REFUSED, ids=[" ".join(o) for o, _, _ in REFUSED])
def test_the_same_setting_at_its_default_loads(overrides, field, reason):
    """Each refused combination with the offending field left out (at its default) is a valid config."""
    section, key = field.split(".")
    rest = [o for o in overrides if o.split("=")[0] != field]
    cfg = load_config(None, rest)
    cls = type(getattr(cfg, section))
    assert getattr(getattr(cfg, section), key) == cls.model_fields[key].default


READ = [
    # the settings above, where they are read
    ["algorithm.name=ppo", "rollout.n=1", "algorithm.whiten_advantages=false"],
    ["algorithm.name=ppo", "rollout.n=1", "critic.lr=5e-2", "critic.value_clip=0.5", "critic.ppo_epochs=4",
     "critic.mini_batches=4", "critic.lr_schedule=cosine", "critic.min_lr_ratio=0.1", "critic.warmup_steps=3",
     "critic.beta2=0.99", "critic.grad_clip=null", "critic.loss_agg=seq-mean-token-mean"],
    ["algorithm.name=ppo", "rollout.n=1", "algorithm.lam=0.9", "algorithm.gamma=0.5"],
    ["algorithm.adv_estimator=reinforce_pp", "algorithm.gamma=0.5"],
    ["algorithm.norm_adv_by_std=false"],
    ["algorithm.adv_eps=0.1"],
    ["algorithm.name=dapo", "algorithm.norm_adv_by_std=false"],
    ["algorithm.name=dapo", "algorithm.dynamic_sampling_max_rounds=10"],
    ["algorithm.kl_coef=0.1", "algorithm.kl_target=0.05", "algorithm.kl_horizon=500"],
    ["algorithm.kl_coef=0.1", "algorithm.kl_loss_estimator=k1"],
    ["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_coef=0.1", "algorithm.kl_in=reward",
     "algorithm.kl_reward_estimator=k3"],
    ["algorithm.adv_estimator=reinforce_pp", "algorithm.kl_coef=0.1", "algorithm.kl_in=reward",
     "algorithm.kl_reward_estimator=k2"],
    ["actor.lr_schedule=cosine", "actor.min_lr_ratio=0.5"],
    ["data.seed=7"],
    ["runner.max_restarts=1", "runner.restart_timeout_s=5"],
    ["runner.checkpoint_every=5", "runner.keep_checkpoints=1"],
    ["runner.plot=true"],
    ["runner.total_steps=20", "actor.warmup_steps=19", "actor.lr_schedule=cosine"],
    ["runner.total_steps=5", "actor.ppo_epochs=2", "actor.mini_batches=2", "actor.warmup_steps=19"],
    ["runner.total_steps=2", "actor.warmup_steps=0", "actor.lr_schedule=cosine"],
    ["runner.output_dir=~/runs/x"],
    ["runner.output_dir='null'"],  # quoted: the text, a directory named null
    ["model.path=~"],  # YAML's null, as in a file: the tiny model
    ["data.train_path=null"],
]


@pytest.mark.parametrize("overrides", READ, ids=[" ".join(o) for o in READ])
def test_a_setting_that_is_read_is_taken(overrides):
    cfg = load_config(None, overrides)
    for o in overrides:
        key, _, _ = o.partition("=")
        section, name = key.split(".")
        assert name in type(getattr(cfg, section)).model_fields


def test_the_taken_values_are_the_given_ones():
    cfg = load_config(None, ["algorithm.name=ppo", "rollout.n=1", "algorithm.whiten_advantages=false",
                             "critic.lr=5e-2", "algorithm.lam=0.9"])
    assert (cfg.algorithm.whiten_advantages, cfg.critic.lr, cfg.algorithm.lam) == (False, 5e-2, 0.9)
    assert load_config(None, ["model.path=~"]).model.path is None
    assert load_config(None, ["runner.output_dir='null'"]).runner.output_dir == "null"


@pytest.mark.parametrize("overrides", [[], ["algorithm.name=ppo", "rollout.n=1"], ["algorithm.name=dapo"],
                                       ["algorithm.adv_estimator=reinforce_pp"], ["runner.total_steps=2"]])
def test_a_saved_config_with_every_default_loads(tmp_path, overrides):
    """config.json holds every field, defaults included: it must load again, as JSON and as a YAML file."""
    cfg = load_config(None, overrides)
    saved = config_to_dict(cfg)
    assert config_from_dict(saved) == cfg
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(saved))
    assert load_config(tmp_path / "saved.yaml") == cfg


@pytest.mark.parametrize("text", ["runner:\n  output_dir: ~\n", "runner:\n  output_dir: null\n",
                                  "runner:\n  output_dir:\n"])
def test_a_no_value_output_dir_in_a_file_says_the_same(tmp_path, text):
    (tmp_path / "job.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"^runner.output_dir: bad value None; YAML reads ~ and null as no value.*"
                                          r"give a directory path"):
        load_config(tmp_path / "job.yaml")


def test_a_no_value_output_dir_override_is_refused_like_the_file(tmp_path):
    (tmp_path / "job.yaml").write_text("runner:\n  output_dir: ~\n")
    with pytest.raises(ConfigError) as from_file:
        load_config(tmp_path / "job.yaml")
    with pytest.raises(ConfigError) as from_override:
        load_config(None, ["runner.output_dir=~"])
    assert str(from_file.value).split(" [")[0] == str(from_override.value).split(" [")[0]


def test_the_message_says_what_to_do():
    with pytest.raises(ConfigError, match=r"algorithm.whiten_advantages: set to false, but only PPO reads it.*"
                                          r"REINFORCE\+\+.*whitens.*by definition.*remove algorithm.whiten_advantages"):
        load_config(None, ["algorithm.adv_estimator=reinforce_pp", "algorithm.whiten_advantages=false"])
    with pytest.raises(ConfigError, match=r"critic.lr: set to 0.05, but algorithm.name=grpo has no critic.*"
                                          r"remove critic.lr \(or use algorithm.name=ppo\)"):
        load_config(None, ["critic.lr=5e-2"])
    with pytest.raises(ConfigError, match=r"norm_adv_by_std"):  # the group estimators: norm_adv_by_std is theirs
        load_config(None, ["algorithm.whiten_advantages=false"])


def test_an_unread_setting_exits_2_before_anything_starts(tmp_path, capsys):
    assert cli_main(["train", "algorithm.whiten_advantages=false", f"runner.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.startswith("orchestra train: algorithm.whiten_advantages: ")
    assert not (tmp_path / "config.json").exists()


# -- the default warmup on a short run: a warning, not an error ---------------------------------------------------
def test_the_engines_get_the_optimizer_steps_the_config_checks():
    import pipelines.cluster
    import pipelines.config

    assert pipelines.cluster.optimizer_steps is pipelines.config.optimizer_steps  # one count, not two copies


WARMUP_AS_LONG_AS_THE_RUN = [
    (["runner.total_steps=20", "actor.warmup_steps=100"], "actor.warmup_steps", "20 optimizer steps"),
    (["runner.total_steps=20", "actor.warmup_steps=20"], "actor.warmup_steps", "20 optimizer steps"),
    (["runner.total_steps=5", "actor.ppo_epochs=2", "actor.mini_batches=2", "actor.warmup_steps=20"],
     "actor.warmup_steps", "20 optimizer steps"),
    (["runner.total_steps=20", "actor.warmup_steps=100", "actor.lr_schedule=cosine", "actor.min_lr_ratio=0.1"],
     "actor.warmup_steps", "cosine never starts"),
    (["runner.total_steps=3", "actor.lr_schedule=cosine"], "actor.warmup_steps", "cosine never starts"),
    (["runner.total_steps=2", "actor.mini_batches=2", "actor.lr_schedule=cosine"], "actor.warmup_steps",
     "4 optimizer steps"),
    (["algorithm.name=ppo", "rollout.n=1", "runner.total_steps=20", "critic.warmup_steps=50"],
     "critic.warmup_steps", "20 optimizer steps"),
]


@pytest.mark.parametrize("overrides, field, phrase", WARMUP_AS_LONG_AS_THE_RUN)
def test_a_warmup_as_long_as_the_run_is_a_warning_naming_it(caplog, overrides, field, phrase):
    # not refused: the warmup acts as set, only cut short (a smoke run of an example file for a few steps)
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        load_config(None, overrides)
    warnings = [r.getMessage() for r in caplog.records if r.name == "orchestra" and "warmup" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(field) and phrase in warnings[0], warnings


def test_the_default_warmup_longer_than_a_short_run_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        cfg = load_config(None, ["runner.total_steps=3"])
    assert cfg.actor.warmup_steps == 5
    warnings = [r for r in caplog.records if r.name == "orchestra" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "actor.warmup_steps" in message and "5" in message and "3 optimizer steps" in message


def test_no_warmup_warning_when_the_run_is_longer(caplog):
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        load_config(None, ["runner.total_steps=6"])
        load_config(None, ["runner.total_steps=2", "actor.warmup_steps=0"])
        load_config(None, ["runner.total_steps=2", "actor.ppo_epochs=3"])  # 6 optimizer steps > 5
    assert not [r for r in caplog.records if "warmup" in r.getMessage()]


# -- runner.plot without matplotlib: refused as runner.tensorboard without its package ----------------------------
@pytest.fixture
def no_matplotlib(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "matplotlib" else find_spec(name, *a))


def test_plot_without_matplotlib_is_a_config_error(no_matplotlib, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"runner.plot: .*pip install matplotlib"):
        load_config(None, ["runner.plot=true"])
    assert load_config(None, ["runner.plot=false"]).runner.plot is False
    assert cli_main(["train", "runner.plot=true", f"runner.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.startswith("orchestra train: runner.plot: ")
