"""Config: defaults, YAML + overrides, round trip, and every kind of error message."""

import re
import subprocess
import sys
from typing import get_args

import pytest
import yaml
from pydantic import ValidationError

from pipelines import algorithms
from pipelines.config import (
    ActorConfig,
    AggMode,
    Config,
    ConfigError,
    KLKind,
    RolloutConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    replace,
)


def write_yaml(tmp_path, data, name="job.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data), encoding="utf-8")
    return path


def test_defaults_are_a_valid_tiny_grpo_run():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.algorithm.name == "grpo" and cfg.rollout.n >= 2
    assert cfg.resources.device == "cpu" and cfg.model.path is None


def test_yaml_then_overrides(tmp_path):
    path = write_yaml(
        tmp_path,
        "algorithm: {name: ppo, kl_coef: 0.05}\n"
        "actor: {lr: 1e-3, grad_clip: null}\n"  # YAML 1.1 reads 1e-3 as a string; floats accept it
        "critic: {lr: 1}\n"  # an int where a float goes is widened
        "task: {name: digits, params: {max_operand: 9, ops: '+-'}}\n",
    )
    cfg = load_config(path, ["actor.lr=5e-4", "rollout.n=4", "task.params.max_operand=20", "runner.plot=true"])
    assert cfg.algorithm.name == "ppo" and cfg.algorithm.kl_coef == 0.05
    assert cfg.actor.lr == 5e-4 and cfg.actor.grad_clip is None
    assert cfg.critic.lr == 1.0 and isinstance(cfg.critic.lr, float)
    assert cfg.rollout.n == 4 and cfg.runner.plot is True
    assert cfg.task.params == {"max_operand": 20, "ops": "+-"}


def test_string_fields_keep_override_text(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"123": "1+1=", "answer": "2"}\n')  # data.prompt_key needs a train_path
    cfg = load_config(None, ["data.prompt_key=123", f"data.train_path={tmp_path / 'p.jsonl'}",
                             "runner.output_dir=runs/2024", "model.path=null"])
    assert cfg.data.prompt_key == "123" and cfg.runner.output_dir == "runs/2024" and cfg.model.path is None


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["algorithm.name=ppo", "actor.dual_clip_c=3", "task.params={ops: [+, -]}"])
    saved = config_to_dict(cfg)
    assert saved["actor"]["dual_clip_c"] == 3.0 and saved["task"]["params"] == {"ops": ["+", "-"]}
    assert load_config(write_yaml(tmp_path, saved), []) == cfg
    assert config_from_dict(saved) == cfg


def test_sections_are_frozen_and_validated_on_construction():
    cfg = Config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.actor.lr = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"actor.lr: bad value -1.0; expected float > 0"):
        ActorConfig(lr=-1.0)
    with pytest.raises(ConfigError, match="rollout.top_p"):
        replace(cfg.rollout, top_p=1.5)
    with pytest.raises(ConfigError, match="rollout.n: bad value 1; GRPO needs at least 2"):
        Config(rollout=RolloutConfig(n=1))


@pytest.mark.parametrize(
    "override, message",
    [
        # unknown keys, with "did you mean"
        ("modle.hidden_size=8", "unknown section 'modle' (did you mean 'model'?); sections: model, data"),
        ("actor.lrr=0.1", "unknown key 'actor.lrr' (did you mean 'actor.lr'?); keys in 'actor': lr,"),
        ("actor.gamma=0.9", "unknown key 'actor.gamma' (did you mean 'algorithm.gamma'?)"),
        ("actor.zzz=1", "unknown key 'actor.zzz'; keys in 'actor'"),
        # wrong types
        ("actor.lr=fast", "actor.lr: bad value 'fast' (str); expected float"),
        ("rollout.n=2.5", "rollout.n: bad value 2.5 (float); expected int"),
        ("rollout.n=true", "rollout.n: bad value True (bool); expected int"),
        ("runner.plot=3", "runner.plot: bad value 3 (int); expected bool"),
        ("actor.grad_clip=x", "actor.grad_clip: bad value 'x' (str); expected float or null"),
        ("rollout.n=null", "rollout.n: bad value None (NoneType); expected int"),
        ("task.params=5", "task.params: bad value 5 (int); expected mapping with string keys"),
        # out of range
        ("actor.lr=0", "actor.lr: bad value 0.0; expected float > 0"),
        ("rollout.top_p=1.5", "rollout.top_p: bad value 1.5; expected float > 0 and <= 1"),
        ("runner.max_staleness=2", "runner.max_staleness: bad value 2; expected int >= 0 and <= 1"),
        ("actor.dual_clip_c=0.5", "actor.dual_clip_c: bad value 0.5; expected float > 1 (or null)"),
        # unknown choices
        ("algorithm.name=ppo2", "algorithm.name: bad value 'ppo2' (str); expected one of 'grpo', 'ppo', "
                                "'dapo' (did you mean 'ppo'?)"),
        ("algorithm.kl_loss_estimator=k5", "expected one of 'k1', 'k2', 'k3', 'abs'"),
        ("resources.placement=remote", "expected one of 'colocated', 'split'"),
        # constraints across sections
        ("rollout.n=1", "rollout.n: bad value 1; GRPO needs at least 2 responses"),
        ("runner.micro_batches_per_step=5", "runner.micro_batches_per_step: bad value 5; must divide "
                                            "data.prompts_per_step (32)"),
        ("model.num_heads=5", "model.num_heads: bad value 5; must divide model.hidden_size (64)"),
        ("rollout.max_new_tokens=64", "must be below model.max_seq_len (64)"),
        ("actor.mini_batches=1000", "a step has only 256 rows"),
        ("resources.rollout_workers=2", "must equal resources.actor_workers (1)"),
        # malformed overrides
        ("actor.l", "bad override: expected section.key=value"),
        ("actor=1", "bad override: expected section.key=value"),
        ("actor..lr=1", "bad override: expected section.key=value"),
        ("actor.lr=[1", "actor.lr: cannot parse '[1' as YAML"),
        ("model.hidden_size.x=1", "model.hidden_size: has type int, not a mapping"),
    ],
)  # messages are literal substrings
def test_override_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(None, [override])
    assert str(info.value).endswith(f"[from override {override!r}]")
    assert isinstance(info.value, ValueError)


def test_error_path_attribute():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor.lr=-1"])
    assert info.value.path == "actor.lr"


def test_file_errors_name_the_file(tmp_path):
    bad_value = write_yaml(tmp_path, {"actor": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=r"actor.lr: bad value 'fast' \(str\); expected float \[in .*job.yaml\]"):
        load_config(bad_value, [])
    unknown = write_yaml(tmp_path, {"rollout": {"temprature": 0.7}})
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.temprature' \(did you mean 'rollout.temperature'"):
        load_config(unknown, [])
    not_mapping = write_yaml(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="job.yaml: expected a mapping of sections, got list"):
        load_config(not_mapping, [])
    section_not_mapping = write_yaml(tmp_path, "model: 5\n")
    with pytest.raises(ConfigError, match=r"model: expected a mapping of keys, got 5 \[in .*job.yaml\]"):
        load_config(section_not_mapping, [])
    with pytest.raises(ConfigError, match=r"model: is 5, not a mapping, so model.num_layers cannot be set"):
        load_config(section_not_mapping, ["model.num_layers=1"])
    broken = write_yaml(tmp_path, "actor: {lr: [\n")
    with pytest.raises(ConfigError, match="job.yaml: invalid YAML"):
        load_config(broken, [])


def test_override_fixes_a_file_value_and_is_blamed_only_for_its_own_key(tmp_path):
    path = write_yaml(tmp_path, {"rollout": {"n": 1}})
    assert load_config(path, ["rollout.n=2"]).rollout.n == 2
    with pytest.raises(ConfigError, match=r"rollout.n: .*\[in .*job.yaml\]"):
        load_config(path, ["actor.lr=0.1"])


def test_literals_match_the_algorithms():
    assert get_args(AggMode) == algorithms.AGG_MODES
    assert get_args(KLKind) == algorithms.KL_KINDS


def test_pipelines_layers_stay_light():
    code = (
        "import sys, pipelines.config, pipelines.data;"
        "assert 'torch' not in sys.modules, 'config/data must not import torch';"
        "import pipelines.algorithms;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('orchestra', 'engines', 'ray')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_each_section_knows_its_key():
    cfg = Config()
    for name in Config.model_fields:
        assert type(getattr(cfg, name))._section == name
