"""What `orchestra train` refuses before it starts anything, and what it does not write: a resume with nothing left
to run, or with prompts sampled another way than the checkpoint's, stops with exit 2 and a message, leaving the
run's config.json as it was; runner.metrics=false writes no metrics.jsonl (runner.plot with it is refused as never
read: test_config_unread_settings.py)."""

from __future__ import annotations

import pytest

from local_jobs import LOCAL_TINY

from pipelines.cli import main as cli_main


@pytest.mark.slow  # one real (in-process) job, ~4 s
def test_resumes_this_config_cannot_continue_stop_before_anything_starts(tmp_path, capsys):
    out = [*LOCAL_TINY, "runner.checkpoint_every=1", f"runner.output_dir={tmp_path}"]
    assert cli_main(["train", *out, "runner.total_steps=1", "runner.metrics=false",
                     "--no-progress"]) == 0
    assert not (tmp_path / "reward.png").exists() and not (tmp_path / "metrics.jsonl").exists()
    config = (tmp_path / "config.json").read_text()
    capsys.readouterr()

    assert cli_main(["train", *out, "runner.total_steps=1", "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "after step 0" in err and "runner.total_steps=1 leaves no step to run" in err

    assert cli_main(["train", *out, "runner.total_steps=2", "data.prompts_per_step=16", "--resume",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "sampled another way" in err and "batch_size: saved 8, now 16" in err

    # as many prompts, but other ones (the digits task draws them from its own seed)
    assert cli_main(["train", *out, "runner.total_steps=2", "task.params={format_bonus: 0.5, seed: 99}", "--resume",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "sampled another way" in err and "not the same ones" in err
    assert (tmp_path / "config.json").read_text() == config
