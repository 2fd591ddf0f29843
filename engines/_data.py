"""Batch plumbing shared by the engines (see the data convention in engines/__init__.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

TensorMap = Mapping[str, torch.Tensor]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a (left/right padded) batch: ``cumsum(mask) - 1`` clipped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def batch_rows(batch: Mapping[str, Any]) -> int:
    """Number of rows of a batch (TensorDict batch size or the first tensor's dim 0)."""
    if isinstance(batch, TensorDict) and len(batch.batch_size) > 0:
        return int(batch.batch_size[0])
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            return int(v.shape[0])
    raise ValueError("batch holds no tensors: expected at least 'prompts'/'responses'/'attention_mask'")


def tensor_dict(
    batch: Mapping[str, Any],
    device: torch.device,
    keys: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Plain dict of the batch's tensors (all of them, or ``keys``) moved to ``device``.

    Non-tensor entries (strings, ids) are dropped. Nested TensorDicts are flattened with '.'.
    """
    rows = batch_rows(batch)
    out: dict[str, torch.Tensor] = {}
    items: Iterable[tuple[str, Any]]
    if isinstance(batch, TensorDict):
        items = ((k if isinstance(k, str) else ".".join(k), v)
                 for k, v in batch.items(include_nested=True, leaves_only=True))
    else:
        items = batch.items()
    wanted = set(keys) if keys is not None else None
    for k, v in items:
        if wanted is not None and k not in wanted:
            continue
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
            # non_blocking only host->GPU; a non_blocking copy to the host could be read early
            out[k] = v.to(device, non_blocking=device.type == "cuda")
    return out


def model_inputs(data: Mapping[str, torch.Tensor], where: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, R) from a batch, with checks that name what is missing."""
    if "responses" not in data:
        raise KeyError(f"{where}: batch needs 'responses' [B, R] (got keys {sorted(data)})")
    responses = data["responses"]
    if "input_ids" in data:
        input_ids = data["input_ids"]
    elif "prompts" in data:
        input_ids = torch.cat([data["prompts"], responses], dim=1)
    else:
        raise KeyError(f"{where}: batch needs 'input_ids' or 'prompts' (got keys {sorted(data)})")
    if "attention_mask" not in data:
        raise KeyError(f"{where}: batch needs 'attention_mask' [B, P+R] (got keys {sorted(data)})")
    attention_mask = data["attention_mask"]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"{where}: attention_mask {tuple(attention_mask.shape)} must match input_ids "
            f"{tuple(input_ids.shape)} (prompts and responses concatenated)"
        )
    R = responses.shape[1]
    if R < 1 or R >= input_ids.shape[1]:
        raise ValueError(
            f"{where}: responses length {R} must be >= 1 and shorter than input_ids "
            f"{input_ids.shape[1]} (prompts must have at least one column)"
        )
    if not torch.equal(input_ids[:, -R:], responses):
        raise ValueError(f"{where}: input_ids[:, -R:] differ from responses; input_ids must be cat(prompts, responses)")
    return input_ids, attention_mask, R


def slice_rows(data: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Rows [start, stop) of every tensor."""
    return {k: v[start:stop] for k, v in data.items()}


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[tokens], computed in float32. logits [..., V], tokens [...]."""
    logits = logits.float()
    return torch.gather(F.log_softmax(logits, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, in float32: ``logsumexp(z) - sum(p z)`` -> ``[...]``.

    Logits of -inf (tokens filtered by top-k / top-p) count as probability 0: their ``p z`` term is 0, not
    ``0 * -inf = nan``, so value and gradient stay finite. The project's one implementation: the engine that holds
    the logits computes entropy, and the pipelines' losses take the per-token result.
    """
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    finite = torch.where(torch.isfinite(logits), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - (p * finite).sum(-1)


def to_tensordict(data: Mapping[str, torch.Tensor], rows: int) -> TensorDict:
    """A TensorDict with batch size [rows] on CPU."""
    return TensorDict({k: v.detach().cpu() for k, v in data.items()}, batch_size=[rows])
