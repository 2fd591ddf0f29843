"""Settings that would change nothing are refused: a config file with no YAML document (empty, or comments only) ran
the default 200-step job, and algorithm.overlong_penalty without algorithm.overlong_buffer applied no penalty."""

from __future__ import annotations

import pytest

import orchestra
from pipelines.cli import main as cli_main
from pipelines.config import ConfigError, config_to_dict, load_config


@pytest.mark.parametrize("text", ["", "# my job\n", "\n   \n# runner:\n#   total_steps: 5\n", "---\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    f = tmp_path / "job.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"job.yaml: the config file holds no settings"):
        load_config(f)


def test_an_empty_config_file_exits_2(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the default job was started")

    monkeypatch.setattr(orchestra, "init", refuse)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("# truncated\n")
    assert cli_main(["train", str(tmp_path / "job.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"orchestra train: {tmp_path / 'job.yaml'}: the config file holds")


def test_an_explicitly_empty_mapping_is_the_defaults(tmp_path):
    (tmp_path / "job.yaml").write_text("{}\n")
    assert load_config(tmp_path / "job.yaml").runner.total_steps == 200


@pytest.mark.parametrize("penalty", ["0.5", "0", "2"])
def test_an_overlong_penalty_without_its_buffer_is_refused(penalty):
    with pytest.raises(ConfigError, match=r"algorithm.overlong_penalty: .*algorithm.overlong_buffer is null"):
        load_config(None, [f"algorithm.overlong_penalty={penalty}"])


def test_an_overlong_penalty_with_its_buffer_is_taken_and_a_saved_config_loads(tmp_path):
    import yaml

    cfg = load_config(None, ["algorithm.name=dapo", "algorithm.overlong_buffer=1", "algorithm.overlong_penalty=0.5",
                             "rollout.max_new_tokens=4"])
    assert cfg.algorithm.overlong_penalty == 0.5
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(config_to_dict(load_config(None, []))))  # holds the default
    assert load_config(tmp_path / "saved.yaml") == load_config(None, [])
