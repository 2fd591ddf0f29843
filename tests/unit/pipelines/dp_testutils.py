"""Spawned-rank workers for the data-parallel invariance tests of the update (``engines.workers._train``).

Kept in its own module (not a test file) so that ranks spawned by ``engines.spawn`` can import them.
"""

from __future__ import annotations

from typing import Any

import torch
from pipelines_testutils import policy_model

from engines.fsdp import EngineConfig

UPDATE_CFG = EngineConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, micro_batch_size=3)


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``orchestra.dispatch.shard`` gives DP rank ``rank``: contiguous, balanced, larger shares first."""
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def update(rank: int, world: int, batch: dict[str, torch.Tensor], loss_fn: Any, ppo_epochs: int,
           mini_batches: int) -> dict[str, Any]:
    """One ``_train`` call (``ppo_epochs`` x ``mini_batches`` optimizer steps) on this rank's shard of ``batch``, as
    ``update_actor`` runs it; the averaged metrics and the full weights afterwards (rank 0's; ``{}`` elsewhere)."""
    from engines.fsdp import FSDPEngine
    from engines.workers import _train
    from orchestra import Batch

    start, stop = shard_rows(batch["responses"].shape[0], world, rank)
    local = Batch.from_dict({k: v[start:stop] for k, v in batch.items()})
    eng = FSDPEngine(policy_model, UPDATE_CFG, model_kind="causal_lm")
    metrics = _train(eng, local, loss_fn, ppo_epochs, mini_batches, "actor", "update_actor")
    return {"metrics": metrics, "state": eng.full_state_dict()}
