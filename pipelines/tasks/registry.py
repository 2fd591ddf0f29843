"""The task registry: ``task.name`` in a config names a builder registered here with :func:`register_task`.

A builder turns ``task.params`` into a :class:`~pipelines.taskspec.TaskSpec` (prompt records, reward function and
kwargs, warm start). Importing this module needs neither torch nor Ray, so a config can be checked against the
registry before anything heavy starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..taskspec import TaskSpec

__all__ = ["TaskEntry", "UnknownTaskError", "check_task_params", "get_task_entry", "register_task", "task_names"]

TaskBuilder = Callable[[Mapping[str, Any]], "TaskSpec"]


@dataclass(frozen=True)
class TaskEntry:
    """A registered task: its name, the builder and the ``task.params`` keys the builder accepts; ``prompt_params``:
    those that only shape the generated prompt records (``data.train_path`` replaces them, so there they would be
    ignored), of which ``answer_pool_params`` also shape the answer pool of a format warm start."""

    name: str
    build: TaskBuilder
    params: frozenset[str]
    check: Callable[[Mapping[str, Any]], Any] | None = None  # checks the values of task.params (torch-free)
    prompt_params: frozenset[str] = frozenset()
    answer_pool_params: frozenset[str] = frozenset()


class UnknownTaskError(ValueError):
    """``task.name`` names no registered task; the message lists the known ones."""


_REGISTRY: dict[str, TaskEntry] = {}


def register_task(name: str, build: TaskBuilder | None = None, *, params: Iterable[str] = (),
                  check: Callable[[Mapping[str, Any]], Any] | None = None, prompt_params: Iterable[str] = (),
                  answer_pool_params: Iterable[str] = (), overwrite: bool = False) -> Any:
    """Register ``build`` as task ``name`` (``task.name`` in a config); ``params`` are the ``task.params`` keys it
    takes (others are a config error) and ``check(params)`` (optional, torch-free) raises ``ValueError`` naming a
    key whose value is wrong, when the config is loaded. ``prompt_params``: the keys that only generate the prompt
    records (refused next to ``data.train_path``, which replaces the records), of which ``answer_pool_params`` also
    shape the answer pool of a format warm start (``warm_start_answers="random"``; accepted when that uses them).
    Use as a decorator, ``@register_task("mytask", params=("seed",))``, or call it with the builder. Registering a
    taken name raises unless ``overwrite=True``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_task: the name must be a non-empty string, got {name!r}")
    params, prompt_params, answer_pool_params = frozenset(params), frozenset(prompt_params), frozenset(
        answer_pool_params)
    for kind, keys, within, of in (("prompt_params", prompt_params, params, "params"),
                                   ("answer_pool_params", answer_pool_params, prompt_params, "prompt_params")):
        if not keys <= within:
            raise ValueError(f"register_task({name!r}): {kind} {sorted(keys - within)} are not in its {of} "
                             f"{sorted(within)}")

    def add(fn: TaskBuilder) -> TaskBuilder:
        if not callable(fn):
            raise TypeError(f"register_task({name!r}): the builder must be callable, got {type(fn).__name__}")
        if name in _REGISTRY and not overwrite and _REGISTRY[name].build is not fn:
            raise ValueError(f"register_task: a task named {name!r} is already registered "
                             f"({_REGISTRY[name].build.__module__}); pick another name or pass overwrite=True")
        if check is not None and not callable(check):
            raise TypeError(f"register_task({name!r}): check must be callable, got {type(check).__name__}")
        _REGISTRY[name] = TaskEntry(name=name, build=fn, params=params, check=check, prompt_params=prompt_params,
                                    answer_pool_params=answer_pool_params)
        return fn

    return add if build is None else add(build)


def task_names() -> list[str]:
    """The registered task names, sorted."""
    return sorted(_REGISTRY)


def get_task_entry(name: str) -> TaskEntry:
    """The task registered as ``name``; :class:`UnknownTaskError` with a did-you-mean and the known names if none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownTaskError(
            f"unknown task {name!r}{hint}; known tasks: {', '.join(task_names())} (a new task registers itself with "
            "pipelines.tasks.register_task, see docs/algorithms.md)") from None


def check_task_params(name: str, params: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the unknown ``task.params`` keys for task ``name`` and the allowed ones, or (the
    task's ``check``) a key whose value is wrong."""
    entry = get_task_entry(name)
    unknown = set(params) - entry.params
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} for task {name!r}; allowed: {sorted(entry.params)}")
    if entry.check is not None:
        entry.check(params)
