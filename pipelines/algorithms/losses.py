"""PPO losses: clipped policy surrogate (with optional dual clip), clipped value loss, entropy bonus.

Metrics come back as detached 0-d tensors so a micro-batch loop never forces a device sync;
call ``.item()`` when logging.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masked import AggMode, aggregate, masked_mean

# exp(20) ~ 5e8: keeps the ratio and its gradient finite for tokens whose log-prob moved wildly.
_MAX_LOG_RATIO = 20.0


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg: AggMode = "token-mean",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate: per token ``max(-A * r, -A * clip(r, 1 - low, 1 + high))``, aggregated.

    ``r = exp(log_probs - old_log_probs)``.  With ``dual_clip_c`` (> 1) the loss of tokens with
    ``A < 0`` is further capped at ``-A * c``, so one huge ratio on a bad token cannot dominate.
    Metrics: ``clipfrac`` (tokens where the clip is active), ``clipfrac_dual`` (where the dual cap
    is active), ``approx_kl`` (k3 estimate of KL(old || new): mean of ``r - 1 - log r``), ``ratio_mean``.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    log_ratio = (log_probs - old_log_probs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(loss_mat, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        dual_active = (adv < 0) & (loss_mat > cap)
        loss_mat = torch.where(dual_active, cap, loss_mat)
    loss = aggregate(loss_mat, response_mask, agg, normalizer)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(loss_mat.dtype), response_mask),
            "clipfrac_dual": masked_mean(dual_active.to(loss_mat.dtype), response_mask),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float | None = 0.2,
    agg: AggMode = "token-mean",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: per token ``0.5 * max((V - G)^2, (V_clip - G)^2)``, aggregated.

    ``V_clip = V_old + clip(V - V_old, -clip_range, +clip_range)`` keeps the critic near the values
    the advantages were computed with; ``clip_range=None`` gives plain ``0.5 * (V - G)^2``.  The 0.5
    makes the gradient ``V - G``.  Metric ``vf_clipfrac``: tokens where the clipped term is larger,
    i.e. the clip is active.
    """
    target = returns.detach()
    loss_mat = (values - target).square()
    clip_active = torch.zeros_like(loss_mat, dtype=torch.bool)
    if clip_range is not None:
        old = old_values.detach()
        v_clipped = old + (values - old).clamp(-clip_range, clip_range)
        clipped = (v_clipped - target).square()
        clip_active = clipped > loss_mat
        loss_mat = torch.maximum(loss_mat, clipped)
    loss = 0.5 * aggregate(loss_mat, response_mask, agg, normalizer)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean(clip_active.to(loss_mat.dtype), response_mask)}
    return loss, metrics


def entropy_bonus(
    entropy: Tensor,
    response_mask: Tensor,
    coef: float,
    agg: AggMode = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """Loss term ``-coef * aggregate(entropy)``: *add* it to the loss, so that descending the loss raises entropy."""
    return -coef * aggregate(entropy, response_mask, agg, normalizer)
