"""How a task plugs into a training job: its prompts, tokenizer, reward, and optional format warm start.

``task.name`` looks the task up in the registry of ``pipelines.tasks`` (``digits``, the default, and ``addition``
generate their prompts in code, so no download); any task can instead read prompts from ``data.train_path``
(jsonl/parquet with ``prompt`` and ``answer``: a string or an integer the task's tokenizer can write, else the row is
refused, since no response could ever match it).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from orchestra import Batch

from .config import Config, ConfigError, warm_start_with_kl
from .data import load_prompts

if TYPE_CHECKING:
    from .tasks.registry import TaskEntry

__all__ = ["WARM_START_ANSWERS", "TaskSpec", "get_task", "prompt_batch"]

WARM_START_ANSWERS = ("random", "correct")  # format-only warm start, or supervised on the right answers


@dataclass(frozen=True)
class TaskSpec:
    """A task: prompt records (``prompt``/``answer``), the reward function and its kwargs, and the warm start:
    ``warm_start_steps`` supervised steps before RL on ``warm_start_answers`` (``random`` or ``correct``), at a
    constant ``warm_start_lr`` (None: ``actor.lr``); the actor's LR schedule (warmup, cosine) starts after them."""

    name: str
    records: list[dict]
    reward_fn: Callable[..., Sequence[float]]
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    warm_start_steps: int = 0
    answer_pool: tuple[str, ...] = ()
    warm_start_answers: str = "random"
    warm_start_lr: float | None = None
    answer_is_response: bool = False  # the reward reads the response as the answer: it needs those tokens + <eos>

    def __post_init__(self) -> None:
        if self.warm_start_answers not in WARM_START_ANSWERS:
            raise ValueError(f"warm_start_answers must be one of {WARM_START_ANSWERS}, got "
                             f"{self.warm_start_answers!r}")
        if self.warm_start_lr is not None and not (math.isfinite(self.warm_start_lr) and self.warm_start_lr > 0):
            raise ValueError(f"warm_start_lr must be a finite number > 0 (or null: actor.lr), got {self.warm_start_lr}")
        if self.warm_start_steps < 0:
            raise ValueError(f"warm_start_steps must be >= 0, got {self.warm_start_steps}")
        if self.warm_start_steps and self.warm_start_answers == "random" and not self.answer_pool:
            raise ValueError("a format warm start (warm_start_answers=random) needs the task's answer_pool")

    @staticmethod
    def tokenizer() -> Any:
        """The task's tokenizer (the code-defined character tokenizer)."""
        from engines.tokenizer import CharTokenizer

        return CharTokenizer()

    def warm_start_batch(self, step: int, rows: int, seed: int, max_new_tokens: int) -> Batch:
        """Supervised rows for the warm start before RL. ``warm_start_answers="random"``: each prompt followed by a
        random (mostly wrong) answer from the task's answer pool, then eos, which teaches the answer FORMAT only
        ("emit a number and stop"), not arithmetic. ``"correct"``: each prompt followed by its right answer, a
        short supervised fine-tuning that leaves a partly competent policy for RL to improve, as RL post-training
        starts from an SFT model."""
        rng = random.Random(seed * 1_000_003 + 7919 + step)
        recs = [self.records[rng.randrange(len(self.records))] for _ in range(rows)]
        if self.warm_start_answers == "correct":
            answers = [str(r["answer"]) for r in recs]
        else:
            answers = [rng.choice(self.answer_pool) for _ in recs]
        return prompt_batch(recs, self.tokenizer(), responses=answers, max_new_tokens=max_new_tokens)


def prompt_batch(records: Sequence[dict], tok: Any, *, responses: Sequence[str] | None = None,
                 max_new_tokens: int = 0, uid_offset: int = 0) -> Batch:
    """Prompts as a Batch: ``prompts`` (left-padded, bos first) + ``attention_mask``, with ``answer`` and ``uid``
    columns; with ``responses`` also the response tokens (+ eos, right-padded) and the full-sequence masks."""
    ids, mask = tok.batch_encode([r["prompt"] for r in records], padding_side="left", add_bos=True)
    cols: dict[str, Any] = {"prompts": ids, "attention_mask": mask,
                            "answer": [str(r.get("answer", "")) for r in records],
                            "uid": [uid_offset + i for i in range(len(records))]}
    if responses is not None:
        width = max(max_new_tokens, max(len(r) + 1 for r in responses))
        resp = torch.full((len(records), width), tok.pad_token_id, dtype=torch.long)
        rmask = torch.zeros((len(records), width), dtype=torch.long)
        for i, text in enumerate(responses):
            toks = tok.encode(text, add_eos=True)
            resp[i, : len(toks)] = torch.tensor(toks)
            rmask[i, : len(toks)] = 1
        cols.update(responses=resp, response_mask=rmask, input_ids=torch.cat([ids, resp], 1),
                    attention_mask=torch.cat([mask, rmask], 1))
    return Batch.from_dict(cols)


def get_task(cfg: Config) -> TaskSpec:
    """The TaskSpec registered as ``task.name`` (``pipelines.tasks``), built from ``task.params``; prompts from
    ``data.train_path`` when set (the task keeps its reward; a ``task.params`` key that only generates prompts is
    then a ConfigError)."""
    from .tasks import UnknownTaskError, check_task_params, get_task_entry

    name, params = cfg.task.name, dict(cfg.task.params)
    try:
        entry = get_task_entry(name)
    except UnknownTaskError as e:
        raise ConfigError(f"task.name: {e}", "task.name") from None
    try:
        check_task_params(name, params)
        spec = entry.build(params)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"task.params: {e}", "task.params") from None
    if spec.warm_start_steps > 0 and cfg.algorithm.kl_coef > 0:  # checked on the built task: any task's builder
        raise ConfigError(warm_start_with_kl(spec.warm_start_steps, cfg.algorithm.kl_coef),
                          "task.params.warm_start_steps")
    check = _answer_check(spec)
    if cfg.data.train_path:
        _refuse_prompt_params(cfg, entry, spec)
        records = load_prompts(cfg.data.train_path, prompt_key=cfg.data.prompt_key, required_keys=("answer",),
                               check=lambda r, where: check(r, where, "data.train_path"))
        spec = replace(spec, records=records)
    else:  # the task's own records: a generator that writes such an answer is refused as well
        for i, r in enumerate(spec.records):
            if "answer" in r:  # (a task whose reward reads no answer may generate none: prompt_batch gives "")
                check(r, f"task {name!r} record {i}", "task.name")
    if spec.answer_is_response:
        _check_answer_room(cfg, spec)
    if cfg.model.path is None:
        _check_positions(cfg, spec)
    return spec


_ANSWER_TYPES = {bool: "a boolean", float: "a float", list: "a list", dict: "an object"}


def _answer_check(spec: TaskSpec) -> Callable[[dict, str, str], None]:
    """A check of one record's ``answer``, ``check(record, where, key)``: a ConfigError naming ``key`` (the setting
    to change), ``where`` (file and row) and the value unless the answer is a string or an integer (not a bool) the
    task's tokenizer can write. Anything else can never be matched: ``prompt_batch`` hands the reward
    ``str(answer)`` ("None" for null, "8.0" for 8.0), and no response can hold a character the tokenizer lacks, so
    the record would be rewarded 0 forever and the run would still end well (the warm start on the right answers
    could not even encode it)."""
    tok = spec.tokenizer()
    chars = getattr(tok, "chars", None)
    accepted = ("accepted: a string or an integer (not a boolean, a float or null)"
                + (f" of the characters the tokenizer writes ({chars!r})" if chars is not None else
                   " that the task's tokenizer can write"))

    def check(record: dict, where: str, key: str) -> None:
        answer = record["answer"]
        try:
            shown = json.dumps(answer, ensure_ascii=False)
        except (TypeError, ValueError):  # a parquet value JSON cannot hold (bytes, a date)
            shown = repr(answer)
        shown = shown if len(shown) <= 80 else f"{shown[:80]}... ({len(shown)} characters)"
        fix = "fix or remove the row" if key == "data.train_path" else f"fix task {spec.name!r}'s prompt generator"
        if not isinstance(record["prompt"], str):  # a chat (data.load_prompts takes one): this task's tokenizer cannot
            raise ConfigError(
                f"{key}: {where}: the prompt is a {type(record['prompt']).__name__} (a chat of role/content messages"
                f"), but task {spec.name!r} tokenizes plain text: write the prompt as one string (a chat template "
                f"applied already), or {fix}", key)
        if isinstance(answer, str) and not answer.strip():  # a lost answer, as null is: an empty response matches it
            raise ConfigError(
                f"{key}: {where}: answer {shown} is blank: the task's reward would pay a response that ends at once "
                f"(or holds only spaces) as solved; {accepted}, not blank: {fix}", key)
        if isinstance(answer, bool) or not isinstance(answer, str | int):
            kind = "" if answer is None else f" ({_ANSWER_TYPES.get(type(answer), f'a {type(answer).__name__}')})"
            raise ConfigError(
                f"{key}: {where}: answer {shown} is not a string or an integer{kind}: no response of task "
                f"{spec.name!r} can match it (its reward would compare each response with {str(answer)!r:.80}); "
                f"{accepted}: {fix}", key)
        try:
            tok.encode(str(answer))
        except ValueError as e:
            raise ConfigError(
                f"{key}: {where}: answer {shown} cannot be written by the task's tokenizer ({e}): no response of "
                f"task {spec.name!r} can match it; {accepted}: {fix}", key) from None

    return check


def _check_answer_room(cfg: Config, spec: TaskSpec) -> None:
    """A task whose reward reads the response as the answer needs ``rollout.max_new_tokens`` to hold the longest
    answer plus ``<eos>``: with fewer, no response can be right and stop, and only truncated ones are rewarded."""
    tok = spec.tokenizer()
    longest, answer = 0, ""
    for r in spec.records:
        n = len(tok.encode(str(r["answer"])))  # every answer encodes: get_task checked them (_answer_check)
        if n > longest:
            longest, answer = n, str(r["answer"])
    if longest + 1 > cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"rollout.max_new_tokens: bad value {cfg.rollout.max_new_tokens}; the task's longest answer "
            f"({answer!r}) is {longest} tokens, and a response needs one more for <eos>: set "
            f"rollout.max_new_tokens to {longest + 1} or more", "rollout.max_new_tokens")


def _refuse_prompt_params(cfg: Config, entry: TaskEntry, spec: TaskSpec) -> None:
    """``data.train_path`` replaces the task's generated records: a ``task.params`` key that only generates them
    (the registry's ``prompt_params``) would be ignored, so it is a ConfigError naming it; the keys that shape the
    answer pool (``answer_pool_params``) are kept while a format warm start (random answers) uses that pool."""
    uses_pool = spec.warm_start_steps > 0 and spec.warm_start_answers == "random"
    ignored = [k for k in cfg.task.params
               if k in entry.prompt_params and not (uses_pool and k in entry.answer_pool_params)]
    if not ignored:
        return
    key = ignored[0]
    pool = (" (it would also shape the answer pool of a format warm start, warm_start_answers=random, which this "
            "config does not run)" if key in entry.answer_pool_params else "")
    more = "".join(f" and task.params.{k}" for k in ignored[1:])
    raise ConfigError(
        f"task.params.{key}: {cfg.task.params[key]!r} is ignored: it generates the prompts of task "
        f"{cfg.task.name!r}, and data.train_path ({cfg.data.train_path}) replaces them with the file's{pool}; remove "
        f"task.params.{key}{more}, or set data.train_path to null to train on the generated prompts",
        f"task.params.{key}")


def longest_prompt(cfg: Config, spec: TaskSpec) -> int:
    """Tokens of the task's longest prompt, bos included; a prompt the task's tokenizer cannot encode is a
    ConfigError naming it (the rollout would fail on it)."""
    tok = spec.tokenizer()
    longest = 0
    for i, r in enumerate(spec.records):
        try:
            longest = max(longest, len(tok.encode(r["prompt"], add_bos=True)))
        except ValueError as e:
            where = f"data.train_path ({cfg.data.train_path})" if cfg.data.train_path else f"task {cfg.task.name!r}"
            raise ConfigError(f"{where}: prompt {i} cannot be tokenized by the task's tokenizer ({e})",
                              "data.train_path" if cfg.data.train_path else "task.name") from None
    return longest


def _check_positions(cfg: Config, spec: TaskSpec) -> None:
    """The tiny model's ``model.max_seq_len`` positions must hold the longest prompt (bos included) plus
    ``rollout.max_new_tokens``: a rotary model runs past its positions without an error, so a setting too small
    would be accepted and mean nothing."""
    longest = longest_prompt(cfg, spec)
    need = longest + cfg.rollout.max_new_tokens
    if need > cfg.model.max_seq_len:
        raise ConfigError(
            f"model.max_seq_len: bad value {cfg.model.max_seq_len}; the task's longest prompt is {longest} tokens "
            f"(bos included) and rollout.max_new_tokens is {cfg.rollout.max_new_tokens}, so the model needs at "
            f"least {need} positions: raise model.max_seq_len to {need} or more (or shorten the prompts)",
            "model.max_seq_len")
