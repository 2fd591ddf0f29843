"""``orchestra train --help-config`` lists every config key with its type, default and description (from the
pydantic schema of ``pipelines.config``), before torch or Ray is imported, and exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipelines.cli import main as cli_main
from pipelines.config import ActorConfig, Config, ConfigError, config_help, replace


def test_help_config_prints_every_key_with_type_default_and_description(capsys):
    assert cli_main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert f"  actor.lr: float > 0, default 0.002\n      {ActorConfig.model_fields['lr'].description}\n" in out
    assert "  actor.grad_clip: float > 0 (or null), default 1.0\n" in out
    assert "  algorithm.name: one of 'grpo', 'ppo', 'dapo', default \"grpo\"\n" in out
    assert "  task.params: mapping, default {}\n" in out
    for section, info in Config.model_fields.items():
        assert f"\n{section}: {info.description}\n" in out
        for name, field in info.annotation.model_fields.items():
            assert f"  {section}.{name}: " in out and f"\n      {field.description}\n" in out
    assert out == config_help() + "\n"


def test_every_field_has_a_one_line_description():
    for section, info in Config.model_fields.items():
        assert info.description
        for name, field in info.annotation.model_fields.items():
            assert field.description and "\n" not in field.description, f"{section}.{name}"


def test_help_config_needs_neither_torch_nor_ray_and_ignores_the_other_arguments():
    code = ("import sys; from pipelines.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, "train", "examples/nope.yaml", "actor.lr=x", "--help-config"],
                          capture_output=True, text=True, check=True)
    assert "  rollout.n: int >= 1, default 8\n" in done.stdout
    assert done.stdout.rstrip().split("\n")[-1] == "0 []" and done.stderr == ""


def test_replace_validates_like_construction():
    cfg = Config()
    assert replace(cfg.actor, lr=1e-4).lr == 1e-4 and cfg.actor.lr == 2e-3
    assert replace(cfg, actor=replace(cfg.actor, lr=1)).actor.lr == 1.0
    with pytest.raises(ConfigError, match=r"actor.lr: bad value 0.0; expected float > 0"):
        replace(cfg.actor, lr=0)
    with pytest.raises(ConfigError, match=r"unknown key 'actor.lrr' \(did you mean 'actor.lr'\?\)"):
        replace(cfg.actor, lrr=1.0)
