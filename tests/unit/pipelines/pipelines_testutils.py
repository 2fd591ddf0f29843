"""Helpers for the pipelines tests that train a real engine: a fixed batch and a spawned-rank train step.

Kept in its own module (not a test file) so that ranks spawned by ``engines.spawn`` can import the worker.
"""

from __future__ import annotations

from typing import Any

import torch

from engines.models import build_causal_lm, tiny_qwen2_config

VOCAB = 64


def policy_model():
    """The tiny causal LM every rank and every engine starts from."""
    return build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)


def policy_batch(B: int = 64, P: int = 5, R: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses of lengths 0..R (row 3 has none), GRPO-style per-row
    advantages, and old / reference log-probs near the initial policy's so that clipping and KL both act."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (B, P), generator=g)
    responses = torch.randint(3, VOCAB, (B, R), generator=g)
    p_len = torch.randint(1, P + 1, (B,), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    r_len[3] = 0
    pm = (torch.arange(P)[None] >= (P - p_len)[:, None]).long()
    rm = (torch.arange(R)[None] < r_len[:, None]).long()
    prompts, responses = prompts * pm, responses * rm
    batch = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
             "attention_mask": torch.cat([pm, rm], 1), "response_mask": rm,
             "advantages": torch.randn(B, generator=g)}
    with torch.no_grad():
        am = batch["attention_mask"]
        logits = policy_model()(input_ids=batch["input_ids"], attention_mask=am,
                                position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits[:, -R - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, responses[..., None])[..., 0]
    batch["old_log_probs"] = (lp + 0.3 * torch.randn(B, R, generator=g)) * rm
    batch["ref_log_probs"] = (lp + 0.3 * torch.randn(B, R, generator=g)) * rm
    return batch


def train_step_worker(rank: int, world: int, batch: dict[str, torch.Tensor], micro_batch_size: int,
                      loss_fns: list[Any]) -> list[dict[str, float]]:
    """Spawned rank: for each loss, a fresh engine takes one train_step on this rank's contiguous rows."""
    from engines.fsdp import EngineConfig, FSDPEngine

    rows = batch["responses"].shape[0]
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    local = {k: v[start:stop] for k, v in batch.items()}
    out = []
    for loss_fn in loss_fns:
        eng = FSDPEngine(policy_model, EngineConfig(lr=1e-3, grad_clip=None, micro_batch_size=micro_batch_size))
        out.append(eng.train_step(local, loss_fn))
    return out
