"""Multi-digit addition with carries (``task.name=addition``): a harder task than ``digits`` with longer answers.

A record is ``{"prompt": "47+38=", "answer": "85"}``: two ``num_digits``-digit operands (two by default, so the
answer has 2-3 digits and the response needs up to 4 tokens with ``<eos>``: ``rollout.max_new_tokens >= 4``).
``min_carries`` keeps only problems with at least that many carries (``47+38`` has one: 7+8). The prompt uses the
same characters as ``digits``, so the code-defined character tokenizer fits.

The rule reward is exact match (1.0); a wrong but well-formed integer earns ``format_bonus`` plus, optionally,
``digit_credit`` times the fraction of digits that are right (aligned from the units digit). Everything here is
deterministic for a seed and needs neither torch nor Ray.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._common import is_correct, is_well_formed, one_of, real_number, whole_number
from .registry import register_task

if TYPE_CHECKING:
    from ..taskspec import TaskSpec

__all__ = ["addition_reward", "build_addition", "count_carries", "make_addition_task"]

PARAMS = (
    "num_digits", "min_carries", "num_prompts", "seed", "format_bonus", "digit_credit", "warm_start_steps",
    "warm_start_answers", "warm_start_lr",
)
# the params that generate the prompt records (data.train_path replaces them); the operand ones also shape the answer
# pool of a format warm start
POOL_PARAMS = ("num_digits", "min_carries")
PROMPT_PARAMS = (*POOL_PARAMS, "num_prompts", "seed")
_MAX_TRIES = 1000  # rejection sampling per record (min_carries <= num_digits always succeeds much sooner)


def count_carries(a: int, b: int) -> int:
    """How many column carries the schoolbook addition ``a + b`` of two non-negative integers makes."""
    if a < 0 or b < 0:
        raise ValueError(f"count_carries takes non-negative integers, got {a}, {b}")
    carries = carry = 0
    while a or b:
        carry = 1 if a % 10 + b % 10 + carry >= 10 else 0
        carries += carry
        a, b = a // 10, b // 10
    return carries


def make_addition_task(n: int, seed: int = 0, *, num_digits: int = 2, min_carries: int = 0) -> list[dict]:
    """Generate ``n`` problems ``"a+b="`` with ``num_digits``-digit operands (a single digit may be 0),
    deterministically from ``seed``; only problems with at least ``min_carries`` carries are kept.

    Returns ``{"prompt", "answer", "a", "b", "carries"}`` dicts (``prompt``/``answer`` strings)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= num_digits <= 9:
        raise ValueError(f"num_digits must be in [1, 9], got {num_digits}")
    if not 0 <= min_carries <= num_digits:
        raise ValueError(f"min_carries must be in [0, num_digits={num_digits}], got {min_carries}")
    lo, hi = (0 if num_digits == 1 else 10 ** (num_digits - 1)), 10 ** num_digits - 1
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        for _ in range(_MAX_TRIES):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            k = count_carries(a, b)
            if k >= min_carries:
                break
        else:  # pragma: no cover - every allowed min_carries is reachable with probability > 1e-3
            raise RuntimeError(f"no problem with {min_carries} carries in {_MAX_TRIES} draws")
        records.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "a": a, "b": b, "carries": k})
    return records


def _digit_fraction(text: str, answer: str) -> float:
    """Fraction of positions that agree, aligned from the last character, over the longer of the two strings."""
    width = max(len(text), len(answer))
    if width == 0:
        return 0.0
    return sum(x == y for x, y in zip(reversed(text), reversed(answer))) / width


def addition_reward(response_texts: Sequence[str], answers: Sequence[str], format_bonus: float = 0.1,
                    digit_credit: float = 0.0) -> list[float]:
    """Rule reward: 1.0 for the exact answer; a wrong but well-formed integer gets ``format_bonus`` plus
    ``digit_credit`` x the fraction of right digits (aligned from the units digit, over the longer string);
    anything else 0. ``format_bonus + digit_credit`` must be < 1, so only the exact answer reaches 1
    (``reward/solved`` stays exact-match accuracy)."""
    if len(response_texts) != len(answers):
        raise ValueError(f"{len(response_texts)} responses but {len(answers)} answers")
    if format_bonus < 0 or digit_credit < 0 or format_bonus + digit_credit >= 1:
        raise ValueError(f"need format_bonus >= 0, digit_credit >= 0 and format_bonus + digit_credit < 1, got "
                         f"{format_bonus} and {digit_credit}")
    rewards = []
    for text, ans in zip(response_texts, answers):
        ans = str(ans).strip()
        if is_correct(text, ans):
            rewards.append(1.0)
        elif is_well_formed(text):
            rewards.append(float(format_bonus) + float(digit_credit) * _digit_fraction(text, ans))
        else:
            rewards.append(0.0)
    return rewards


def check_addition_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``task.params`` of the addition task, checked strictly (``ValueError`` naming the key: a whole number stays
    whole, a bool is not a number, ranges hold, ``format_bonus + digit_credit < 1``) and with defaults filled in."""
    num_digits = whole_number(params, "num_digits", 2, lo=1, hi=9)
    min_carries = whole_number(params, "min_carries", 0)
    if not 0 <= min_carries <= num_digits:
        raise ValueError(f"min_carries must be in [0, num_digits={num_digits}], got {min_carries}")
    p = {"num_digits": num_digits, "min_carries": min_carries,
         "num_prompts": whole_number(params, "num_prompts", 4096, lo=1),
         "seed": whole_number(params, "seed", 1234, lo=0),
         "format_bonus": real_number(params, "format_bonus", 0.1, lo=0, hi=1, hi_open=True),
         "digit_credit": real_number(params, "digit_credit", 0.0, lo=0, hi=1, hi_open=True),
         "warm_start_steps": whole_number(params, "warm_start_steps", 0, lo=0),
         "warm_start_answers": one_of(params, "warm_start_answers", "random", ("random", "correct")),
         "warm_start_lr": real_number(params, "warm_start_lr", None, lo=0, lo_open=True)}
    addition_reward([], [], format_bonus=p["format_bonus"], digit_credit=p["digit_credit"])  # their sum < 1
    return p


@register_task("addition", params=PARAMS, check=check_addition_params, prompt_params=PROMPT_PARAMS,
               answer_pool_params=POOL_PARAMS)
def build_addition(params: Mapping[str, Any]) -> TaskSpec:
    """The addition task from ``task.params``: ``num_digits`` (2), ``min_carries`` (0), ``num_prompts`` (4096)
    generated from ``seed`` (1234), reward ``format_bonus`` (0.1) and ``digit_credit`` (0), ``warm_start_steps``
    (0)."""
    from ..taskspec import TaskSpec

    p = check_addition_params(params)
    gen = {"num_digits": p["num_digits"], "min_carries": p["min_carries"]}
    records = make_addition_task(p["num_prompts"], seed=p["seed"], **gen)
    kwargs = {"format_bonus": p["format_bonus"], "digit_credit": p["digit_credit"]}
    pool = tuple(sorted({r["answer"] for r in make_addition_task(2000, seed=123, **gen)}, key=int))
    return TaskSpec(name="addition", records=records, reward_fn=addition_reward, reward_kwargs=kwargs,
                    warm_start_steps=p["warm_start_steps"], answer_pool=pool,
                    warm_start_answers=p["warm_start_answers"], warm_start_lr=p["warm_start_lr"],
                    answer_is_response=True)
