"""examples/compute_log_prob.py as a user runs it: a fresh process (its own cluster) prints every response with
its summed log-prob and exits 0 because compute_log_prob reproduces the sampler's log-probs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # measured 40 s (28 s in the script) on the 2-core box
def test_compute_log_prob_example_agrees_with_the_sampler_and_exits_0():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "compute_log_prob.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    table = [ln for ln in lines if ln[:4] in ("1+2=", "7+8=", "3+5=", "9+9=")]
    assert len(table) == 8, proc.stdout  # 4 prompts x 2 samples
    assert all("disagrees" not in ln for ln in table)
    assert "OK: compute_log_prob reproduces the sampler's log-probs" in lines
