"""task.params of the built-in tasks are checked when the config is loaded: whole numbers stay whole (8.9 is not
8), bools are not numbers (true is not 1), ranges hold, and the format bonus stays below the exact answer's 1.0 (a
bonus >= 1 made every well-formed wrong answer count in reward/solved). Errors name the key."""

from __future__ import annotations

import pytest

from pipelines.config import ConfigError, load_config
from pipelines.taskspec import get_task
from pipelines.tasks import digit_reward

BAD = [
    ("digits", "{num_prompts: 8.9}", "num_prompts must be a whole number, got 8.9"),
    ("digits", "{num_prompts: true}", "num_prompts must be a whole number, got True"),
    ("digits", "{num_prompts: 0}", "num_prompts must be >= 1, got 0"),
    ("digits", "{seed: 3.9}", "seed must be a whole number, got 3.9"),
    ("digits", "{seed: -1}", "seed must be >= 0, got -1"),
    ("digits", "{format_bonus: yes}", "format_bonus must be a number, got True"),
    ("digits", "{format_bonus: '0.1'}", "format_bonus must be a number, got '0.1'"),
    ("digits", "{format_bonus: -5}", "format_bonus must be >= 0 and < 1, got -5"),
    ("digits", "{format_bonus: 1.0}", "format_bonus must be >= 0 and < 1, got 1.0"),
    ("digits", "{format_bonus: .nan}", "format_bonus must be a finite number, got nan"),
    ("digits", "{max_operand: 9.5}", "max_operand must be a whole number, got 9.5"),
    ("digits", "{min_operand: 5, max_operand: 3}", "min_operand must be <= max_operand (3), got 5"),
    ("digits", "{ops: '+/'}", "ops must be a list of '+', '-', '*' (or a string of them), got '+/'"),
    ("digits", "{ops: ['/']}", "ops must be a list of '+', '-', '*' (or a string of them), got ['/']"),
    ("digits", "{ops: []}", "ops must be a list of '+', '-', '*' (or a string of them), got []"),
    ("digits", "{ops: 1}", "ops must be a list of '+', '-', '*' (or a string of them), got 1"),
    ("digits", "{modulo: 0}", "modulo must be >= 1, got 0"),
    ("digits", "{warm_start_lr: true}", "warm_start_lr must be a number, got True"),
    ("digits", "{warm_start_lr: 0}", "warm_start_lr must be > 0, got 0"),
    ("digits", "{warm_start_steps: -1}", "warm_start_steps must be >= 0, got -1"),
    ("digits", "{warm_start_answers: 1}", "warm_start_answers must be one of 'random', 'correct', got 1"),
    ("addition", "{num_digits: 2.5}", "num_digits must be a whole number, got 2.5"),
    ("addition", "{num_digits: 10}", "num_digits must be >= 1 and <= 9, got 10"),
    ("addition", "{min_carries: true}", "min_carries must be a whole number, got True"),
    ("addition", "{digit_credit: yes}", "digit_credit must be a number, got True"),
    ("addition", "{format_bonus: 1.5}", "format_bonus must be >= 0 and < 1, got 1.5"),
    ("addition", "{num_prompts: 64.5}", "num_prompts must be a whole number, got 64.5"),
]


@pytest.mark.parametrize("task, params, message", BAD)
def test_bad_task_params_are_refused_when_the_config_is_loaded(task, params, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"task.name={task}", f"task.params={params}"])
    assert str(e.value).startswith(f"task.params: {message}"), str(e.value)


def test_good_params_build_as_given():
    spec = get_task(load_config(None, ["task.params={num_prompts: 1.0e+2, seed: 3, format_bonus: 0, ops: ['+', '*'], "
                                       "modulo: 10, max_operand: 5, warm_start_lr: 1}"]))
    assert len(spec.records) == 100 and spec.reward_kwargs == {"format_bonus": 0.0} and spec.warm_start_lr == 1.0
    assert {r["op"] for r in spec.records} == {"+", "*"} and all(int(r["answer"]) < 10 for r in spec.records)


def test_the_digit_reward_refuses_a_bonus_that_reaches_the_exact_answers():
    with pytest.raises(ValueError, match="format_bonus must be >= 0 and < 1"):
        digit_reward(["3"], ["4"], format_bonus=1.0)
