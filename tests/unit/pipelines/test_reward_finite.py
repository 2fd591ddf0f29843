"""A task whose reward is NaN or infinite for one response stops the run at the reward stage, naming the task and
what to change (it used to train on NaN advantages, write NaN metrics and exit 0)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from local_jobs import local_runner

import orchestra as orc
from pipelines.tasks import registry
from pipelines.tasks.digits import build_digits, digit_reward

TASK = "non_finite_reward_test"


@pytest.fixture
def bad_task():
    """A digits task whose reward gives row 0 ``values[call]`` on its ``call``-th call (finite calls: normal)."""
    calls, values = [0], {}

    def reward(texts, answers, **kw):
        out = list(digit_reward(texts, answers, **kw))
        out[0] = values.get(calls[0], out[0])
        calls[0] += 1
        return out

    @registry.register_task(TASK, params=("format_bonus",))
    def build(params):
        return replace(build_digits(params), name=TASK, reward_fn=reward)

    try:
        yield values
    finally:
        registry._REGISTRY.pop(TASK, None)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_task_reward_stops_the_run_at_the_reward_stage(tmp_path, bad_task, bad):
    bad_task[1] = bad  # the second step's reward call
    runner = local_runner(tmp_path, "runner.total_steps=3", f"task.name={TASK}")
    with pytest.raises(orc.WorkerError, match=rf"task '{TASK}'.*returned {bad} for 1 of 32 responses") as e:
        orc.run(runner.run())
    assert "finite float" in e.value.message
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0]  # step 0 trained; step 1 never reached the update
