"""runner.tensorboard=true without the tensorboard package is refused when the config is loaded, naming the
package (the run wrote no events and said nothing); the metrics sink does not swallow the missing import either."""

from __future__ import annotations

import importlib.util

import pytest

from pipelines.cli import main as cli_main
from pipelines.config import ConfigError, load_config
from pipelines.metrics import MetricsSink


@pytest.fixture
def no_tensorboard(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "tensorboard" else find_spec(name, *a))


def test_tensorboard_without_the_package_is_a_config_error(no_tensorboard, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"runner.tensorboard: .*pip install tensorboard"):
        load_config(None, ["runner.tensorboard=true"])
    assert load_config(None, ["runner.tensorboard=false"]).runner.tensorboard is False
    assert cli_main(["train", "runner.tensorboard=true", f"runner.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.startswith("orchestra train: runner.tensorboard: ")


def test_the_sink_raises_instead_of_writing_no_events(no_tensorboard, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsSink(tmp_path, tensorboard=True)
