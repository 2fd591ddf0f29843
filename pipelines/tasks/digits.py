"""Toy digit-arithmetic task for the GRPO demo (``task.name=digits``, the main job), plus its rule-based reward.

A record is ``{"prompt": "3+5=", "answer": "8"}``.  The policy sees
``<bos>`` + prompt and must emit the answer followed by ``<eos>``.

Everything here is deterministic for a given seed and free of heavy deps,
so trainer / rollout / reward workers can all import it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import is_correct, is_well_formed, one_of, real_number, whole_number, write_jsonl
from .registry import register_task

if TYPE_CHECKING:
    from ..taskspec import TaskSpec

__all__ = ["build_digits", "digit_accuracy", "digit_reward", "make_digit_task", "write_digit_task_jsonl"]

PARAMS = (
    "max_operand", "min_operand", "ops", "modulo", "num_prompts", "format_bonus", "warm_start_steps",
    "warm_start_answers", "warm_start_lr", "seed",
)
# the params that generate the prompt records (data.train_path replaces them); the operand/op ones also shape the
# answer pool of a format warm start
POOL_PARAMS = ("max_operand", "min_operand", "ops", "modulo")
PROMPT_PARAMS = (*POOL_PARAMS, "num_prompts", "seed")


def _apply(a: int, op: str, b: int, modulo: int | None) -> int:
    if op == "+":
        v = a + b
    elif op == "-":
        v = a - b
    elif op == "*":
        v = a * b
    else:
        raise ValueError(f"unsupported op {op!r}")
    return v % modulo if modulo else v


def make_digit_task(
    n: int,
    seed: int = 0,
    *,
    max_operand: int = 9,
    min_operand: int = 0,
    ops: Sequence[str] = ("+",),
    modulo: int | None = None,
) -> list[dict]:
    """Generate ``n`` arithmetic problems ``"a<op>b="`` deterministically from ``seed``.

    Difficulty knobs: operand range ``[min_operand, max_operand]``, operators
    ``ops`` (any of ``+ - *``) and an optional ``modulo`` applied to the result
    (``modulo=10`` makes every answer a single digit).  The default
    (single-digit ``a+b``) has answers ``0..18``.

    Returns a list of ``{"prompt", "answer", "a", "b", "op"}`` dicts;
    ``prompt``/``answer`` are strings, the rest is metadata.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if min_operand < 0 or max_operand < min_operand:
        raise ValueError("need 0 <= min_operand <= max_operand")
    if not ops:
        raise ValueError("ops must be non-empty")
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a = rng.randint(min_operand, max_operand)
        b = rng.randint(min_operand, max_operand)
        op = ops[rng.randrange(len(ops))]
        records.append(
            {"prompt": f"{a}{op}{b}=", "answer": str(_apply(a, op, b, modulo)), "a": a, "b": b, "op": op}
        )
    return records


def write_digit_task_jsonl(path: str | Path, n: int, seed: int = 0, **difficulty: Any) -> Path:
    """``make_digit_task`` + ``write_jsonl`` in one call."""
    return write_jsonl(make_digit_task(n, seed, **difficulty), path)


def digit_reward(
    response_texts: Sequence[str], answers: Sequence[str], format_bonus: float = 0.0
) -> list[float]:
    """Rule-based reward: ``1.0`` if the response equals the answer, else ``0.0``.

    ``response_texts`` must be decoded completions with special tokens removed
    and cut at the first ``<eos>``.  With ``format_bonus > 0`` a wrong but
    well-formed answer (a bare integer) gets ``format_bonus`` (reward shaping);
    the headline metric should still be :func:`digit_accuracy`. ``format_bonus`` must be in [0, 1), so only the
    exact answer reaches 1 (``reward/solved`` counts rewards >= 1).
    """
    if len(response_texts) != len(answers):
        raise ValueError(f"{len(response_texts)} responses but {len(answers)} answers")
    real_number({"format_bonus": format_bonus}, "format_bonus", 0.0, lo=0, hi=1, hi_open=True)  # < the exact 1.0
    rewards = []
    for text, ans in zip(response_texts, answers):
        if is_correct(text, ans):
            rewards.append(1.0)
        elif format_bonus and is_well_formed(text):
            rewards.append(float(format_bonus))
        else:
            rewards.append(0.0)
    return rewards


def digit_accuracy(response_texts: Sequence[str], answers: Sequence[str]) -> float:
    """Fraction of exactly-correct responses (the headline metric)."""
    if not answers:
        return 0.0
    return sum(map(is_correct, response_texts, answers)) / len(answers)


_OPS = ("+", "-", "*")


def check_digit_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``task.params`` of the digits task, checked strictly (``ValueError`` naming the key: a whole number stays
    whole, a bool is not a number, ranges hold) and with defaults filled in."""
    max_operand = whole_number(params, "max_operand", 9, lo=0)
    ops = params.get("ops", ["+"])  # a list of operators, or a string of them ('+-')
    if not isinstance(ops, list | tuple | str) or not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be a list of {', '.join(map(repr, _OPS))} (or a string of them), got {ops!r}")
    p = {"max_operand": max_operand,
         "min_operand": whole_number(params, "min_operand", 0, lo=0),
         "ops": tuple(ops),
         "modulo": None if params.get("modulo") is None else whole_number(params, "modulo", 0, lo=1),
         "num_prompts": whole_number(params, "num_prompts", 4096, lo=1),
         "seed": whole_number(params, "seed", 1234, lo=0),
         "format_bonus": real_number(params, "format_bonus", 0.1, lo=0, hi=1, hi_open=True),
         "warm_start_steps": whole_number(params, "warm_start_steps", 0, lo=0),
         "warm_start_answers": one_of(params, "warm_start_answers", "random", ("random", "correct")),
         "warm_start_lr": real_number(params, "warm_start_lr", None, lo=0, lo_open=True)}
    if p["min_operand"] > max_operand:
        raise ValueError(f"min_operand must be <= max_operand ({max_operand}), got {p['min_operand']}")
    return p


@register_task("digits", params=PARAMS, check=check_digit_params, prompt_params=PROMPT_PARAMS,
               answer_pool_params=POOL_PARAMS)
def build_digits(params: Mapping[str, Any]) -> TaskSpec:
    """The digits task from ``task.params``: operands/ops/modulo (see :func:`make_digit_task`), ``num_prompts``
    (4096) generated from ``seed`` (1234), ``format_bonus`` (0.1, in [0, 1)) and ``warm_start_steps`` (0)."""
    from ..taskspec import TaskSpec

    p = check_digit_params(params)
    gen = {k: p[k] for k in ("max_operand", "min_operand", "ops", "modulo")}
    records = make_digit_task(p["num_prompts"], seed=p["seed"], **gen)
    pool = tuple(sorted({str(r["answer"]) for r in make_digit_task(2000, seed=123, **gen)}, key=int))
    return TaskSpec(name="digits", records=records, reward_fn=digit_reward,
                    reward_kwargs={"format_bonus": p["format_bonus"]}, warm_start_steps=p["warm_start_steps"],
                    answer_pool=pool, warm_start_answers=p["warm_start_answers"], warm_start_lr=p["warm_start_lr"],
                    answer_is_response=True)
