"""Policy losses (PPO clip with clip-higher and dual clip, GSPO, GMPO, CISPO), the truncated importance-sampling
weight, the clipped value loss and the entropy bonus.

Every policy loss builds a per-token loss ``[B, R]`` and reduces it with :func:`~.masked.aggregate`, so each works
with every aggregation mode (and the engine's micro-batch / data-parallel weighting, which only needs the mode).
An optional detached ``token_weights`` ``[B, R]`` multiplies the per-token loss first (the truncated IS correction).

Metrics come back as detached 0-d tensors so a micro-batch loop never forces a device sync;
call ``.item()`` when logging.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kl import k3_of
from .masked import AggMode, aggregate, masked_mean

# exp(20) ~ 5e8: keeps the ratio and its gradient finite for tokens whose log-prob moved wildly.
_MAX_LOG_RATIO = 20.0

POLICY_LOSSES: tuple[str, ...] = ("ppo", "gspo", "gmpo", "cispo")


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """``log_probs - old_log_probs`` (old detached), 0 at masked positions and clamped to +-20.

    Masking *before* any exp keeps -inf / NaN log-probs at padded positions out of the forward value and the
    gradient (the gradient of ``where`` to the unselected branch is 0, and nothing multiplies it by inf).
    """
    d = log_probs - old_log_probs.detach()
    d = torch.where(response_mask.bool(), d, torch.zeros((), dtype=d.dtype, device=d.device))
    return d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _zero_masked(x: Tensor, response_mask: Tensor) -> Tensor:
    """``x`` with masked positions set to 0 by ``where`` *before* any arithmetic, so a NaN / inf there reaches
    neither the value nor the gradient (``0 * nan`` in a product's backward would)."""
    return torch.where(response_mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _weighted(loss_mat: Tensor, token_weights: Tensor | None) -> Tensor:
    """``loss_mat * token_weights`` (weights detached), or ``loss_mat`` when there are none."""
    if token_weights is None:
        return loss_mat
    if token_weights.shape != loss_mat.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} vs per-token loss {tuple(loss_mat.shape)}")
    return loss_mat * token_weights.detach().to(loss_mat.dtype)


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, clipped: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``clipfrac``, ``approx_kl`` (k3 of KL(old || new)) and ``ratio_mean`` over the valid tokens."""
    with torch.no_grad():
        return {"clipfrac": masked_mean(clipped.to(ratio.dtype), mask),
                "approx_kl": masked_mean(k3_of(log_ratio), mask),
                "ratio_mean": masked_mean(ratio, mask)}


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
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate: per token ``max(-A * r, -A * clip(r, 1 - low, 1 + high))``, aggregated.

    ``r = exp(log_probs - old_log_probs)``.  With ``dual_clip_c`` (> 1) the loss of tokens with
    ``A < 0`` is further capped at ``-A * c``, so one huge ratio on a bad token cannot dominate.
    Metrics: ``clipfrac`` (tokens where the clip is active), ``clipfrac_dual`` (where the dual cap
    is active), ``approx_kl`` (k3 estimate of KL(old || new): mean of ``r - 1 - log r``), ``ratio_mean``.
    ``clip_ratio_high > clip_ratio_low`` is DAPO's clip-higher (Yu et al. 2025): more room to raise rare tokens.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    log_ratio = _log_ratio(log_probs, old_log_probs, response_mask)
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
    loss = aggregate(_weighted(loss_mat, token_weights), response_mask, agg, normalizer)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(loss_mat.dtype), response_mask),
            "clipfrac_dual": masked_mean(dual_active.to(loss_mat.dtype), response_mask),
            "approx_kl": masked_mean(k3_of(log_ratio), response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
        }
    return loss, metrics


def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    agg: AggMode = "seq-mean-token-mean",
    normalizer: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): the PPO clip applied to the *sequence* ratio
    ``s_i = exp(mean_t (log_probs - old_log_probs))`` (the geometric mean of the token ratios).

    Written in the paper's GSPO-token form, ``s_i,t = sg(s_i) * pi_t / sg(pi_t)``: every token's ratio has the
    value ``s_i`` (so a clipped sequence is clipped on all its tokens) and the gradient ``s_i * grad log pi_t``.
    With sequence-level advantages and ``seq-mean-token-mean`` this is exactly GSPO; other modes weight the
    sequences differently. The clip range is on ``s_i``, which moves far less than a token ratio: the paper uses
    3e-4 / 4e-4. Metrics as :func:`policy_loss`, plus ``seq_ratio_mean``.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, response_mask)
    seq_log_ratio = masked_mean(log_ratio.detach(), response_mask, dim=-1)  # [B]
    token_log_ratio = seq_log_ratio[:, None] + log_ratio - log_ratio.detach()  # value: the sequence's
    ratio = torch.exp(token_log_ratio)
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    loss = aggregate(_weighted(loss_mat, token_weights), response_mask, agg, normalizer)
    metrics = _ratio_metrics(torch.exp(log_ratio.detach()), log_ratio.detach(), clipped > unclipped, response_mask)
    with torch.no_grad():
        has_tokens = response_mask.bool().any(-1)
        metrics["seq_ratio_mean"] = masked_mean(torch.exp(seq_log_ratio), has_tokens)
    return loss, metrics


def gmpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    agg: AggMode = "seq-mean-token-mean",
    normalizer: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025): maximize ``A * exp(mean_t l_t)``, the geometric mean of the clipped token ratios.

    The clip is per token and in log space: ``l_t = min(d_t, clip(d_t, -low, high))`` for ``A >= 0`` and
    ``max(...)`` for ``A < 0`` (PPO's pessimistic side), with ``d_t = log_probs - old_log_probs``; so
    ``clip_ratio_low`` / ``clip_ratio_high`` are bounds on the *log* ratio here (the paper uses 0.4, i.e. ratios in
    [e^-0.4, e^0.4]). The per-token loss is ``-A_t * g_i`` with ``g_i = exp(mean_t l_t)`` of its sequence; with
    sequence-level advantages and ``seq-mean-token-mean`` that is exactly GMPO. ``clipfrac``: tokens whose
    ``l_t`` is clipped.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, response_mask)
    # the advantage multiplies the sequence's geometric mean, which every token's gradient flows through: zero it
    # at masked positions first (a masked NaN would make the whole row's gradient NaN)
    adv = _zero_masked(advantages.detach().expand_as(log_ratio), response_mask)
    bounded = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    pessimistic = torch.where(adv >= 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    geo = torch.exp(masked_mean(pessimistic, response_mask, dim=-1))  # [B], gradient through the kept tokens
    loss_mat = -adv * geo[:, None]
    loss = aggregate(_weighted(loss_mat, token_weights), response_mask, agg, normalizer)
    metrics = _ratio_metrics(torch.exp(log_ratio.detach()), log_ratio.detach(),
                             pessimistic.detach() != log_ratio.detach(), response_mask)
    with torch.no_grad():
        metrics["seq_ratio_mean"] = masked_mean(geo.detach(), response_mask.bool().any(-1))
    return loss, metrics


def cispo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    agg: AggMode = "token-mean",
    normalizer: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight on every token.

    Per token ``-sg(clip(r, 1 - low, 1 + high)) * A * r / sg(r)``: the value is ``-w A`` and the gradient
    ``-w A grad log pi`` for *every* token, including those whose ratio is clipped (PPO's clip drops their
    gradient; CISPO only bounds its size). ``clipfrac``: tokens whose weight was clipped.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, response_mask)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    adv = advantages.detach()
    loss_mat = -(weight * adv) * torch.exp(log_ratio - log_ratio.detach())
    loss = aggregate(_weighted(loss_mat, token_weights), response_mask, agg, normalizer)
    return loss, _ratio_metrics(ratio, log_ratio.detach(), weight != ratio, response_mask)


@torch.no_grad()
def truncated_is_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, cap: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights ``min(pi_old / pi_rollout, cap)`` per token ``[B, R]`` (0 at masked positions).

    The responses were sampled by the rollout engine, whose log-probs differ from the trainer's (other kernels,
    or older weights with ``runner.max_staleness=1``); weighting each token's loss by this ratio corrects the
    gradient toward the trainer's policy, and the cap bounds its variance. Metrics ``tis/weight_mean`` and
    ``tis/capped_frac`` (tokens at the cap).
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_w = _log_ratio(old_log_probs, rollout_log_probs, response_mask)
    raw = torch.exp(log_w)
    w = torch.where(response_mask.bool(), raw.clamp(max=cap), torch.zeros_like(raw))
    metrics = {"tis/weight_mean": masked_mean(w, response_mask),
               "tis/capped_frac": masked_mean((raw > cap).to(w.dtype), response_mask)}
    return w, metrics


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
    # masked positions zeroed before the arithmetic: a NaN / inf return or value there reaches no gradient
    values = _zero_masked(values, response_mask)
    target = _zero_masked(returns.detach(), response_mask)
    loss_mat = (values - target).square()
    clip_active = torch.zeros_like(loss_mat, dtype=torch.bool)
    if clip_range is not None:
        old = _zero_masked(old_values.detach(), response_mask)
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
