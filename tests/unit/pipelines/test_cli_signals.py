"""SIGTERM and SIGINT end ``orchestra train`` the same way: the run is cancelled (its finally blocks run: the trace is
saved, metrics.jsonl holds whole lines, the cluster shuts down), one line says so, and the exit status is 128 + the
signal (143 for SIGTERM, 130 for SIGINT). SIGTERM used to kill it with no message and no trace; Ctrl-C printed a
traceback and exited 1, as a diverged run does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from local_jobs import LOCAL_TINY

ROOT = Path(__file__).resolve().parents[3]
BOUND_S = 300  # a bound on a hung run, not a timing threshold: the first step takes seconds


def _first_step_recorded(proc: subprocess.Popen, out: Path) -> None:
    """Wait (bounded) until the run has written its first metrics line and checkpoint; fail if it exits first."""
    metrics = out / "metrics.jsonl"
    for _ in range(BOUND_S * 10):
        if metrics.is_file() and metrics.read_text().count("\n") >= 1 and (out / "checkpoints" / "latest").is_file():
            return
        try:
            proc.wait(timeout=0.1)  # the poll's pause, and a run that died is seen at once
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"the run exited with {proc.returncode} before its first step: {proc.stderr.read()}")
    pytest.fail("no step recorded")


@pytest.mark.slow  # a subprocess job: about 10 s each
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_cancels_the_run_cleanly(tmp_path, sig, code):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "train", *LOCAL_TINY, "runner.total_steps=10000",
         "runner.checkpoint_every=1", "runner.trace=true", f"runner.output_dir={out}", "--no-progress"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _first_step_recorded(proc, out)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    name = signal.Signals(sig).name
    assert last.startswith(f"orchestra train: interrupted ({name}) at step ") and last.endswith(
        "; resume with --resume"), last
    step = int(last.split(" at step ")[1].split(";")[0])
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(step))  # whole lines, up to where it stopped
    assert json.loads((out / "trace.json").read_text())  # the trace was saved on the way out
    assert (out / "checkpoints" / "latest").is_file()


def test_the_interrupted_message_and_exit_codes():
    from pipelines.runner import RunInterrupted

    e = RunInterrupted(signal.SIGINT, 4, checkpointed=False)
    assert e.exit_code == 130 and str(e).startswith("interrupted (SIGINT) at step 4; no checkpoint was written yet")
    assert RunInterrupted(signal.SIGTERM, None, checkpointed=True).exit_code == 143
    assert str(RunInterrupted(signal.SIGTERM, None, checkpointed=True)) == "interrupted (SIGTERM); resume with --resume"
