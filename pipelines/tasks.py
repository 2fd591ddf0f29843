"""Toy digit-arithmetic task for the GRPO demo, plus its rule-based reward.

A record is ``{"prompt": "3+5=", "answer": "8"}``.  The policy sees
``<bos>`` + prompt and must emit the answer followed by ``<eos>``.

Everything here is deterministic for a given seed and free of heavy deps,
so trainer / rollout / reward workers can all import it.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

_INT_RE = re.compile(r"-?(0|[1-9][0-9]*)")


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


def write_jsonl(records: Sequence[dict], path: str | Path) -> Path:
    """Write records one JSON object per line; creates parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_digit_task_jsonl(path: str | Path, n: int, seed: int = 0, **difficulty) -> Path:
    """``make_digit_task`` + ``write_jsonl`` in one call."""
    return write_jsonl(make_digit_task(n, seed, **difficulty), path)


def is_correct(response_text: str, answer: str) -> bool:
    """Exact match of the (whitespace-stripped) response with the answer."""
    return response_text.strip() == str(answer).strip()


def is_well_formed(response_text: str) -> bool:
    """True if the response is exactly a canonical integer: optional '-', no
    leading zeros, no spaces (so padding the output with junk earns nothing)."""
    return _INT_RE.fullmatch(response_text) is not None


def digit_reward(
    response_texts: Sequence[str], answers: Sequence[str], format_bonus: float = 0.0
) -> list[float]:
    """Rule-based reward: ``1.0`` if the response equals the answer, else ``0.0``.

    ``response_texts`` must be decoded completions with special tokens removed
    and cut at the first ``<eos>``.  With ``format_bonus > 0`` a wrong but
    well-formed answer (a bare integer) gets ``format_bonus`` (reward shaping);
    the headline metric should still be :func:`digit_accuracy`.
    """
    if len(response_texts) != len(answers):
        raise ValueError(f"{len(response_texts)} responses but {len(answers)} answers")
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
