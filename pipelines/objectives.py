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
from typing import Any, ClassVar

from torch import Tensor

from .algorithms import (
    POLICY_LOSSES,
    agg_units,
    aggregate,
    cispo_loss,
    entropy_bonus,
    gmpo_loss,
    gspo_loss,
    kl_loss,
    masked_mean,
    policy_loss,
    truncated_is_weights,
    value_loss,
)

__all__ = ["PolicyLoss", "ValueLoss", "SFTLoss"]


def _per_token(x: Tensor, like: Tensor) -> Tensor:
    return x.unsqueeze(-1).expand_as(like) if x.dim() == 1 else x


# loss_type -> the per-token policy loss; each takes the same arguments (dual clip only for "ppo")
_POLICY_FNS = {"ppo": policy_loss, "gspo": gspo_loss, "gmpo": gmpo_loss, "cispo": cispo_loss}
assert tuple(_POLICY_FNS) == POLICY_LOSSES


@dataclass(frozen=True)
class PolicyLoss:
    """Policy surrogate (``loss_type``: PPO clip with optional dual clip, GSPO, GMPO or CISPO)
    - entropy_coef x entropy + kl_coef x KL-to-reference.

    Reads ``old_log_probs``, ``advantages`` ([B] per sequence or [B, R] per token), ``response_mask`` and, when
    ``kl_coef > 0``, ``ref_log_probs``. ``adv_mean``/``adv_std`` whiten advantages with batch-wide statistics; an
    optional ``advantage_mask`` [B] (0: a filler row of DAPO) then multiplies them, so a masked row's advantage is 0.
    ``kl_estimator`` is the KL estimator *of the loss term* (k3 by default; see docs/algorithms.md). With
    ``entropy_coef > 0`` descending the loss raises the policy's entropy. With ``rollout_is_cap`` set, each token's
    surrogate is weighted by ``min(pi_old / pi_rollout, cap)`` from ``old_log_probs`` and ``rollout_log_probs``
    (truncated importance sampling). Every term is aggregated with ``agg``, row by row, so ``loss_scale`` holds for
    every ``loss_type``.
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
    loss_type: str = "ppo"
    rollout_is_cap: float | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in _POLICY_FNS:
            raise ValueError(f"unknown policy loss {self.loss_type!r}; expected one of {', '.join(POLICY_LOSSES)}")
        if self.dual_clip_c is not None and self.loss_type != "ppo":
            raise ValueError(f"dual_clip_c is a PPO-clip option; loss_type {self.loss_type!r} does not take it")

    def __call__(self, outputs: Mapping[str, Tensor], mb: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        logp, mask = outputs["log_probs"], mb["response_mask"]
        old = mb["old_log_probs"].to(logp.dtype)
        adv = (_per_token(mb["advantages"].to(logp.dtype), logp) - self.adv_mean) / self.adv_std
        if "advantage_mask" in mb:  # rows that only fill the update (DAPO): advantage exactly 0 after whitening
            adv = adv * _per_token(mb["advantage_mask"].to(logp.dtype), logp)
        weights, tis_metrics = None, {}
        if self.rollout_is_cap is not None:
            weights, tis_metrics = truncated_is_weights(old, mb["rollout_log_probs"].to(logp.dtype), mask,
                                                        self.rollout_is_cap)
        extra = {"dual_clip_c": self.dual_clip_c} if self.loss_type == "ppo" else {}
        loss, metrics = _POLICY_FNS[self.loss_type](logp, old, adv, mask, clip_ratio_low=self.clip_ratio_low,
                                                    clip_ratio_high=self.clip_ratio_high, agg=self.agg,
                                                    token_weights=weights, **extra)
        metrics = {"pg_loss": loss.detach(), **metrics, **tis_metrics}
        if self.entropy_coef:
            if "entropy" not in outputs:
                raise ValueError(f"PolicyLoss: entropy_coef={self.entropy_coef} needs outputs['entropy'] (the policy's "
                                 f"per-token entropy), which the engine did not compute: call train_step(..., "
                                 f"with_entropy=True), or set entropy_coef=0")
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

    @property
    def required_outputs(self) -> tuple[str, ...]:
        """The engine outputs this loss reads (the engine checks them before it computes anything)."""
        return ("log_probs", "entropy") if self.entropy_coef else ("log_probs",)

    @property
    def required_columns(self) -> dict[str, tuple[str, str]]:
        """The batch columns this loss reads: ``{name: (shape, what to pass)}``, shape ``"tokens"`` ([rows,
        response_len]) or ``"rows|tokens"``; the engine checks them before it computes anything."""
        cols = {"old_log_probs": ("tokens", "the policy's log-probs of the responses before this update: "
                                            "ActorRolloutRefWorker.compute_log_prob"),
                "advantages": ("rows|tokens", "per-sequence or per-token advantages")}
        if self.kl_coef:
            cols["ref_log_probs"] = ("tokens", f"kl_coef={self.kl_coef} needs the reference model's log-probs: "
                                               f"compute_ref_log_prob, or set kl_coef=0")
        if self.rollout_is_cap is not None:
            cols["rollout_log_probs"] = ("tokens", f"rollout_is_cap={self.rollout_is_cap} needs the rollout engine's "
                                                   f"log-probs (generate returns them), or set rollout_is_cap=None")
        return cols

    # the metrics that are means over other units than the loss (engines.fsdp weights each by its own units)
    metric_scales: ClassVar[dict[str, str]] = {
        "entropy": "tokens", "clipfrac": "tokens", "clipfrac_dual": "tokens", "approx_kl": "tokens",
        "ratio_mean": "tokens", "tis/weight_mean": "tokens", "tis/capped_frac": "tokens",
        "seq_ratio_mean": "sequences"}


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

    metric_scales: ClassVar[dict[str, str]] = {"vf_clipfrac": "tokens"}  # a mean over tokens in every mode
    required_outputs: ClassVar[tuple[str, ...]] = ("values",)  # the engine outputs this loss reads
    # the batch columns it reads (see PolicyLoss.required_columns)
    required_columns: ClassVar[dict[str, tuple[str, str]]] = {
        "values": ("tokens", "the critic's values when the advantages were computed: CriticWorker.compute_values"),
        "returns": ("tokens", "the value targets, e.g. GAE returns")}


@dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response tokens (used for the format warm start)."""

    agg: str = "token-mean"
    required_outputs: ClassVar[tuple[str, ...]] = ("log_probs",)  # the engine outputs this loss reads

    def __call__(self, outputs: Mapping[str, Tensor], mb: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        loss = aggregate(-outputs["log_probs"], mb["response_mask"], self.agg)
        return loss, {"nll": loss.detach()}

    @property
    def loss_scale(self) -> str:
        """The units the loss is a mean over, for the engine's micro-batch weighting."""
        return agg_units(self.agg)
