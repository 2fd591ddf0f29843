"""Spawned-rank workers for the engine's multi-rank reduction tests.

Kept in its own module (not a test file) so that ranks spawned by ``engines.spawn`` can import them.
"""

from __future__ import annotations

from typing import Any

import torch
from engines_testutils import model_factory

from engines.fsdp import EngineConfig


def data_dependent_metric_loss(outputs, mb):
    """Token-mean NLL with a metric whose *name* depends on the data: ``long_frac`` (value 100) when the
    micro-batch has a response of 6 tokens or more, else ``short_frac`` (value 1)."""
    m = mb["response_mask"].float()
    loss = -(outputs["log_probs"] * m).sum() / m.sum()
    name = "long_frac" if bool((m.sum(-1) >= 6).any()) else "short_frac"
    return loss, {name: torch.tensor(100.0 if name == "long_frac" else 1.0)}


data_dependent_metric_loss.loss_scale = "tokens"


def rows_with_response_length(n: int, length: int, R: int = 8, P: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` rows whose responses all have ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    rm = (torch.arange(R)[None] < length).long().repeat(n, 1)
    prompts = torch.randint(3, 64, (n, P), generator=g)
    resp = torch.randint(3, 64, (n, R), generator=g) * rm
    return {"prompts": prompts, "responses": resp, "input_ids": torch.cat([prompts, resp], 1),
            "attention_mask": torch.cat([torch.ones_like(prompts), rm], 1), "response_mask": rm}


def metric_keys_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 holds two rows of 8-token responses, rank 1 two rows of 2-token ones: the loss reports
    ``long_frac`` on rank 0 only and ``short_frac`` on rank 1 only. One train_step; its metrics."""
    from engines.fsdp import FSDPEngine

    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4), model_kind="causal_lm")
    batch = rows_with_response_length(2, 8 if rank == 0 else 2, seed=rank)
    return eng.train_step(batch, data_dependent_metric_loss)
