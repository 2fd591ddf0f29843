"""``data.prompt_key`` names the column of ``data.train_path`` that holds the prompt; without a train_path the task
generates its prompts and the setting was dropped silently. It is refused, as other settings that would change
nothing are (algorithm.overlong_penalty without its buffer, task.params that train_path replaces)."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines.config import ConfigError, config_to_dict, load_config


def test_a_prompt_key_without_a_train_path_is_refused():
    with pytest.raises(ConfigError, match=r"data\.prompt_key: set to 'question', but data\.train_path is null") as e:
        load_config(None, ["data.prompt_key=question"])
    assert e.value.path == "data.prompt_key"
    assert "set data.train_path" in str(e.value) and "remove data.prompt_key" in str(e.value)


def test_a_prompt_key_with_a_train_path_is_taken(tmp_path):
    from pipelines.taskspec import get_task

    f = tmp_path / "q.jsonl"
    f.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    cfg = load_config(None, ["data.prompt_key=question", f"data.train_path={f}", "data.prompts_per_step=8",
                             "rollout.max_new_tokens=4"])
    assert get_task(cfg).records[0]["prompt"] == "0+1="


def test_a_saved_config_with_the_default_prompt_key_loads(tmp_path):
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(config_to_dict(load_config(None, []))))  # holds the default
    assert load_config(tmp_path / "saved.yaml") == load_config(None, [])


@pytest.mark.parametrize("key", ["q #1", "123"])
def test_a_prompt_key_override_keeps_its_text_with_a_train_path(tmp_path, key):
    """(What test_config_paths_and_overrides and test_job_config checked with a prompt_key alone, now refused.)"""
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({key: "1+1=", "answer": "2"}) + "\n")
    cfg = load_config(None, [f"data.prompt_key={key}", f"data.train_path={f}"])
    assert cfg.data.prompt_key == key
