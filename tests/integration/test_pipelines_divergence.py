"""A run whose weights blow up stops with an error naming the step and the metric, instead of finishing."""

from __future__ import annotations

import json

import pytest

from pipelines.config import load_config
from pipelines.health import TrainingDivergedError
from pipelines.runner import Runner


async def test_diverging_run_stops_naming_step_and_metric(tmp_path):
    # the runner's health check is the same on both backends (tests/integration/test_pipelines_backends.py):
    # in process, this costs no worker processes
    out = tmp_path / "div"
    cfg = load_config(None, ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32",
                             "actor.warmup_steps=0", "resources.actor_workers=1", "resources.rollout_workers=1",
                             "resources.backend=local", "actor.lr=1e30", "runner.total_steps=6",
                             f"runner.output_dir={out}"])
    with pytest.raises(TrainingDivergedError, match=r"training diverged at step \d: .*actor") as e:
        await Runner(cfg, progress=False).run()
    assert e.value.step < 4 and e.value.metric.startswith("actor/")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == e.value.step  # the bad step is on record
