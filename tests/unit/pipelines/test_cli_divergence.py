"""A run that stops because training diverged is reported like the other CLI errors: one ``orchestra train: ...``
line naming the step and the metric, exit status 1, no traceback."""

import sys
import types

from pipelines.cli import main as cli_main
from pipelines.health import TrainingDivergedError


def test_divergence_prints_one_line_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    def diverge(cfg, resume_from=None, overwrite=False, progress=True):
        raise TrainingDivergedError("training diverged at step 4: actor/grad_norm=nan (non-finite for 3 consecutive "
                                    "steps, runner.max_bad_steps=3)", 4, "actor/grad_norm")

    # a stand-in for pipelines.runner: the CLI imports ``run`` from it only after the config checks
    monkeypatch.setitem(sys.modules, "pipelines.runner", types.SimpleNamespace(run=diverge))
    rc = cli_main(["train", f"runner.output_dir={tmp_path / 'run'}", "runner.total_steps=5", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err == ("orchestra train: training diverged at step 4: actor/grad_norm=nan (non-finite for 3 consecutive "
                   "steps, runner.max_bad_steps=3)\n")
    assert "Traceback" not in err
