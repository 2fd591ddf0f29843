"""How a task plugs into a training job: its prompts, tokenizer, reward, and optional format warm start.

``task.name`` looks the task up in the registry of ``pipelines.tasks`` (``digits``, the default, and ``addition``
generate their prompts in code, so no download); any task can instead read prompts from ``data.train_path``
(jsonl/parquet with ``prompt`` and ``answer``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from orchestra import Batch

from .config import Config, ConfigError
from .data import load_prompts

__all__ = ["TaskSpec", "get_task", "prompt_batch"]


@dataclass(frozen=True)
class TaskSpec:
    """A task: prompt records (``prompt``/``answer``), the reward function and its kwargs, and the warm start."""

    name: str
    records: list[dict]
    reward_fn: Callable[..., Sequence[float]]
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    warm_start_steps: int = 0
    answer_pool: tuple[str, ...] = ()

    @staticmethod
    def tokenizer() -> Any:
        """The task's tokenizer (the code-defined character tokenizer)."""
        from engines.tokenizer import CharTokenizer

        return CharTokenizer()

    def warm_start_batch(self, step: int, rows: int, seed: int, max_new_tokens: int) -> Batch:
        """Supervised rows teaching the answer FORMAT only: each prompt followed by a random (mostly wrong) answer
        from the task's answer pool, then eos. Teaches "emit a number and stop", not arithmetic."""
        rng = random.Random(seed * 1_000_003 + 7919 + step)
        recs = [self.records[rng.randrange(len(self.records))] for _ in range(rows)]
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
    ``data.train_path`` when set (the task keeps its reward)."""
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
    if cfg.data.train_path:
        records = load_prompts(cfg.data.train_path, prompt_key=cfg.data.prompt_key, required_keys=("answer",))
        spec = replace(spec, records=records)
    return spec
