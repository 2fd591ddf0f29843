"""Loss objects handed to the training engines (picklable, so they travel to the workers with the call).

An engine calls ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` per micro-batch; ``outputs`` holds the
current policy's ``log_probs`` (and ``entropy``) or the critic's ``values`` for the micro-batch's response tokens.
Each object returns its loss *averaged* over the micro-batch's units and names those units in ``loss_scale``
("tokens" for token-mean, "sequences" for the seq-mean modes); the engine weights each micro-batch by its share of
the units of the whole mini-batch on all data-parallel ranks, so the objective does not depend on
``micro_batch_size`` or on the number of ranks, for every aggregation mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .algorithms import agg_units, aggregate, entropy_bonus, kl_loss, masked_mean, policy_loss, value_loss

__all__ = ["PolicyLoss", "ValueLoss", "SFTLoss"]


def _per_token(x: Tensor, like: Tensor) -> Tensor:
    return x.unsqueeze(-1).expand_as(like) if x.dim() == 1 else x


@dataclass(frozen=True)
class PolicyLoss:
    """PPO clipped surrogate (dual clip optional) - entropy_coef x entropy + kl_coef x KL-to-reference.

    Reads ``old_log_probs``, ``advantages`` ([B] per sequence or [B, R] per token), ``response_mask`` and, when
    ``kl_coef > 0``, ``ref_log_probs``. ``adv_mean``/``adv_std`` whiten advantages with batch-wide statistics.
    ``kl_estimator`` is the KL estimator *of the loss term* (k3 by default; see docs/algorithms.md). With
    ``entropy_coef > 0`` descending the loss raises the policy's entropy.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip_c: float | None = None
    agg: str = "token-mean"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    adv_mean: float = 0.0
    adv_std: float = 1.0

    def __call__(self, outputs: Mapping[str, Tensor], mb: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        logp, mask = outputs["log_probs"], mb["response_mask"]
        adv = (_per_token(mb["advantages"].to(logp.dtype), logp) - self.adv_mean) / self.adv_std
        loss, metrics = policy_loss(logp, mb["old_log_probs"].to(logp.dtype), adv, mask,
                                    clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                                    dual_clip_c=self.dual_clip_c, agg=self.agg)
        metrics = {"pg_loss": loss.detach(), **metrics}
        if self.entropy_coef and "entropy" in outputs:
            loss = loss + entropy_bonus(outputs["entropy"], mask, self.entropy_coef, agg=self.agg)
        if "entropy" in outputs:
            metrics["entropy"] = masked_mean(outputs["entropy"].detach(), mask)
        if self.kl_coef:
            kl = kl_loss(logp, mb["ref_log_probs"].to(logp.dtype), mask, kind=self.kl_estimator, agg=self.agg)
            loss = loss + self.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics

    @property
    def loss_scale(self) -> str:
        """The units the loss is a mean over, for the engine's micro-batch weighting."""
        return agg_units(self.agg)


@dataclass(frozen=True)
class ValueLoss:
    """Clipped value loss against ``returns``, around the rollout-time ``values``."""

    clip_range: float | None = 0.2
    agg: str = "token-mean"

    def __call__(self, outputs: Mapping[str, Tensor], mb: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        values = outputs["values"]
        loss, metrics = value_loss(values, mb["values"].to(values.dtype), mb["returns"].to(values.dtype),
                                   mb["response_mask"], clip_range=self.clip_range, agg=self.agg)
        return loss, {"vf_loss": loss.detach(), **metrics}

    @property
    def loss_scale(self) -> str:
        """The units the loss is a mean over, for the engine's micro-batch weighting."""
        return agg_units(self.agg)


@dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response tokens (used for the format warm start)."""

    agg: str = "token-mean"

    def __call__(self, outputs: Mapping[str, Tensor], mb: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        loss = aggregate(-outputs["log_probs"], mb["response_mask"], self.agg)
        return loss, {"nll": loss.detach()}

    @property
    def loss_scale(self) -> str:
        """The units the loss is a mean over, for the engine's micro-batch weighting."""
        return agg_units(self.agg)
