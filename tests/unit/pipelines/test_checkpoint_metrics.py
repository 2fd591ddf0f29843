"""metrics.jsonl on resume: a line torn by a crash is dropped with a warning; other bad lines name the file."""

from __future__ import annotations

import json
import logging

import pytest

from pipelines.checkpoint import CheckpointError
from pipelines.metrics import MetricsSink, read_metrics


def test_resume_drops_lines_after_the_checkpoint_and_a_torn_last_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)) + '{"step": 4, "rew')
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        MetricsSink(tmp_path, truncate_after=1).close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    assert any("metrics.jsonl" in r.getMessage() and "line 5" in r.getMessage() for r in caplog.records)


def test_a_corrupt_line_in_the_middle_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl line 2 is not valid JSON"):
        MetricsSink(tmp_path, truncate_after=1)
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl line 2"):
        read_metrics(path)


def test_fresh_run_starts_an_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    sink = MetricsSink(tmp_path)
    sink.write({"step": 0, "x": 1.0})
    sink.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "x": 1.0}]


def _strict(line):
    """json.loads that refuses the NaN / Infinity tokens, as jq and every strict JSON reader do."""
    return json.loads(line, parse_constant=lambda token: pytest.fail(f"non-JSON token {token} in {line!r}"))


def test_non_finite_metrics_are_written_as_strict_json_and_read_back(tmp_path):
    import math

    sink = MetricsSink(tmp_path)
    sink.write({"step": 0, "actor/loss": math.nan, "actor/grad_norm": math.inf, "x": -math.inf, "y": 1.5})
    sink.event({"event": "restart", "step": 0, "lost": math.nan})
    sink.close()
    step, event = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert step == {"step": 0, "actor/loss": None, "actor/grad_norm": None, "x": None, "y": 1.5,
                    "nonfinite": {"actor/loss": "NaN", "actor/grad_norm": "Infinity", "x": "-Infinity"}}
    assert event == {"event": "restart", "step": 0, "lost": None, "nonfinite": {"lost": "NaN"}}
    back = read_metrics(tmp_path / "metrics.jsonl")  # the Python reader restores the values
    assert math.isnan(back[0]["actor/loss"]) and back[0]["actor/grad_norm"] == math.inf and back[0]["x"] == -math.inf
    assert back[0]["y"] == 1.5 and "nonfinite" not in back[0] and math.isnan(back[1]["lost"])
