"""YAML 1.1 number forms that change a value are not numbers in a config: ``0100`` is not octal 64 and ``1:00`` is
not base-60 60, in a file or an override; an int field refuses them naming the form, a float field reads decimal."""

from __future__ import annotations

import pytest

from pipelines.config import ConfigError, load_config


@pytest.mark.parametrize("override", ["runner.total_steps=0100", "runner.seed=0123", "data.prompts_per_step=064",
                                      "runner.checkpoint_every=1:00"])
def test_octal_and_base_60_ints_are_refused_in_overrides(override):
    key, text = override.split("=")
    with pytest.raises(ConfigError, match=rf"{key}: bad value '{text}' \(str\); expected int.*leading zero"):
        load_config(None, [override])


def test_a_base_60_float_is_refused_and_a_zero_padded_float_reads_decimal():
    with pytest.raises(ConfigError, match=r"actor.lr: bad value '1:30'"):
        load_config(None, ["actor.lr=1:30"])
    assert load_config(None, ["rollout.temperature=01.5"]).rollout.temperature == 1.5


def test_octal_in_a_file_is_refused(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("runner:\n  total_steps: 0100\n")
    with pytest.raises(ConfigError, match=r"runner.total_steps: bad value '0100'.*in .*job.yaml"):
        load_config(f)


def test_plain_numbers_still_read_as_numbers(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("runner:\n  total_steps: 100\n  seed: 0\nactor:\n  lr: 1e-3\nrollout:\n  n: 0x10\n")
    cfg = load_config(f, ["data.prompts_per_step=1_024"])
    assert (cfg.runner.total_steps, cfg.runner.seed, cfg.actor.lr, cfg.rollout.n) == (100, 0, 1e-3, 16)
    assert cfg.data.prompts_per_step == 1024
