"""A key given twice in a config file (or in an override's mapping) is refused naming the key and both lines: YAML
keeps the last one and would drop the first one's values silently."""

from __future__ import annotations

import pytest

from pipelines.config import ConfigError, load_config


def test_a_section_given_twice_is_refused_naming_both_lines(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("actor:\n  lr: 1.0e-4\n  ppo_epochs: 4\nrunner:\n  total_steps: 1\nactor:\n  micro_batch_size: 32\n")
    with pytest.raises(ConfigError, match=r"job.yaml: duplicate key 'actor' at line 6 \(first at line 1\)"):
        load_config(f)


def test_a_key_given_twice_in_a_section_is_refused_with_its_path(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("rollout:\n  n: 4\n  n: 16\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'rollout.n' at line 3 \(first at line 2\)"):
        load_config(f)


def test_a_key_given_twice_in_an_override_mapping_is_refused():
    with pytest.raises(ConfigError, match=r"duplicate key 'format_bonus'.*\[from override"):
        load_config(None, ["task.params={format_bonus: 0.1, format_bonus: 0.5}"])


def test_merge_keys_may_be_overridden(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("rollout:\n  <<: {n: 4, top_k: 3}\n  n: 2\n")
    assert (load_config(f).rollout.n, load_config(f).rollout.top_k) == (2, 3)
