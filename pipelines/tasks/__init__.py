"""Tasks: prompts plus a rule reward, looked up by ``task.name`` in a registry (one module per task).

``digits`` (the main job: single-digit arithmetic) and ``addition`` (multi-digit addition with carries, longer
answers) are built in. A new task is a module with a builder decorated by :func:`register_task`, imported below
(or imported by your own script before the config is loaded); see docs/algorithms.md, "Tasks".
"""

from ._common import is_correct, is_well_formed, read_jsonl, whole_number, write_jsonl
from .registry import TaskEntry, UnknownTaskError, check_task_params, get_task_entry, register_task, task_names

# the built-in tasks register themselves on import
from .addition import addition_reward, count_carries, make_addition_task  # noqa: E402
from .digits import digit_accuracy, digit_reward, make_digit_task, write_digit_task_jsonl  # noqa: E402

__all__ = [
    "TaskEntry",
    "UnknownTaskError",
    "addition_reward",
    "check_task_params",
    "count_carries",
    "digit_accuracy",
    "digit_reward",
    "get_task_entry",
    "is_correct",
    "is_well_formed",
    "make_addition_task",
    "make_digit_task",
    "read_jsonl",
    "register_task",
    "task_names",
    "whole_number",
    "write_digit_task_jsonl",
    "write_jsonl",
]
