"""A ``section.key=value`` override of a string key keeps the text as typed (`` #`` is not a YAML comment there), an
empty path is refused, and ``~`` in runner.output_dir is the home directory, not a directory named ``~``."""

from __future__ import annotations

import pytest

import orchestra
from pipelines.cli import main as cli_main
from pipelines.config import ConfigError, load_config


@pytest.mark.parametrize("override, key, expected", [
    ("runner.output_dir=runs/exp #3", ("runner", "output_dir"), "runs/exp #3"),
    ("task.name=digits # the main one", ("task", "name"), None),  # a name with ' #': refused as unknown, not cut
    ("runner.output_dir=runs: 1", ("runner", "output_dir"), "runs: 1"),
    ("runner.output_dir=007", ("runner", "output_dir"), "007"),
    ('runner.output_dir="quoted #1"', ("runner", "output_dir"), "quoted #1"),
    ("data.train_path=null", ("data", "train_path"), None),
])
def test_a_string_override_is_kept_as_typed(override, key, expected):
    if key == ("task", "name"):
        with pytest.raises(ConfigError, match=r"unknown task 'digits # the main one'"):
            load_config(None, [override])
        return
    cfg = load_config(None, [override])
    assert getattr(getattr(cfg, key[0]), key[1]) == expected


@pytest.mark.parametrize("override", ["runner.output_dir=", 'runner.output_dir=""', "runner.output_dir=  ",
                                      'model.path=""', 'data.train_path=""'])
def test_an_empty_path_is_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: bad value '\s*'; an empty path"):
        load_config(None, [override])


def test_an_empty_output_dir_in_a_file_is_refused(tmp_path):
    (tmp_path / "job.yaml").write_text('runner:\n  output_dir: ""\n')
    with pytest.raises(ConfigError, match=r"runner.output_dir: bad value ''"):
        load_config(tmp_path / "job.yaml")


class _Started(Exception):
    pass


def test_a_tilde_output_dir_is_the_home_directory(tmp_path, monkeypatch, capsys):
    def started(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(orchestra, "init", started)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_Started):  # config.json is written just before the cluster would start
        cli_main(["train", "runner.output_dir=~/run", "--no-progress"])
    assert (tmp_path / "home" / "run" / "config.json").is_file()
    assert not (tmp_path / "~").exists()
