"""Advantage estimators: GAE (PPO with a critic), group baselines (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline),
REINFORCE++ (batch-whitened return) and ReMax (greedy baseline).

All estimators run without autograd: advantages and returns are targets, never differentiated.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from .masked import masked_whiten

GroupIds = Sequence[Hashable] | Tensor


def _float(x: Tensor) -> Tensor:
    """``x`` in at least float32, so long recursions and sums do not lose precision in bf16."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _wide(x: Tensor) -> Tensor:
    """``x`` in float64 for per-group statistics: a float32 group mean is off by ~1e-7 of the scores' size, and
    dividing by the std of near-equal scores (say 1e-3) turns that into a group whose advantages do not sum to 0.
    Scores are one scalar per row, so the wide copy costs nothing measurable."""
    return x.to(torch.float64)


@torch.no_grad()
def outcome_to_token_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Put each sequence's scalar score ``[B]`` on its last valid response token -> ``[B, R]``.

    This is the usual token-level reward for PPO with an outcome reward; rows without valid
    tokens get all zeros.
    """
    keep = response_mask.bool()
    R = keep.shape[-1]
    last = R - 1 - keep.flip(-1).to(torch.int8).argmax(-1)
    out = torch.zeros(keep.shape, dtype=_float(scores).dtype, device=scores.device)
    out.scatter_(-1, last[:, None], _float(scores)[:, None])
    return torch.where(keep, out, torch.zeros_like(out))


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the valid tokens of each response.

    Runs ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next`` backwards,
    where "next" is the next *valid* token (masked tokens are skipped, so holes in the mask are
    fine) and the value after the last valid token is 0.  Returns ``(advantages, returns)`` with
    ``returns = A + V`` (computed before the optional whitening of the advantages); both are 0 at
    masked positions.  Rewards and values at masked positions are ignored.
    """
    if token_rewards.shape != values.shape or values.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)}, "
            f"response_mask {tuple(response_mask.shape)}"
        )
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=_float(values).dtype, device=values.device)
    rewards = torch.where(keep, _float(token_rewards), zero)
    vals = torch.where(keep, _float(values), zero)
    next_value = torch.zeros_like(vals[:, 0])
    next_adv = torch.zeros_like(vals[:, 0])
    columns = []
    for t in reversed(range(vals.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        k = keep[:, t]
        columns.append(torch.where(k, adv_t, zero))
        next_value = torch.where(k, vals[:, t], next_value)
        next_adv = torch.where(k, adv_t, next_adv)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = advantages + vals
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def _group_index(
    n_rows: int, group_ids: GroupIds | None, group_size: int | None, device: torch.device
) -> tuple[Tensor, int]:
    """Map rows to dense group numbers ``[B]``; returns ``(index, num_groups)``."""
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids or group_size")
    if group_size is not None:
        if group_size < 1 or n_rows % group_size:
            raise ValueError(
                f"group_size={group_size} does not divide the batch of {n_rows} rows "
                "(rows must be prompt-major: sample j of prompt i at row i*n+j)"
            )
        return torch.arange(n_rows, device=device) // group_size, n_rows // group_size
    if len(group_ids) != n_rows:
        raise ValueError(f"{len(group_ids)} group ids for {n_rows} rows")
    if isinstance(group_ids, Tensor):
        uniq, index = torch.unique(group_ids, return_inverse=True)
        return index.to(device), len(uniq)
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(dense)


def _group_stats(scores: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row ``(group count, group mean, group sample std)``; std uses n-1 (0 for n=1). Pass scores in float64
    (``_wide``): near-equal scores have a tiny std, which multiplies any rounding of the mean."""
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / count.clamp(min=1.0)
    sq = zeros.index_add(0, index, (scores - mean[index]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    return count[index], mean[index], std[index]


def _check_scores(scores: Tensor, response_mask: Tensor) -> None:
    """Scores must be one scalar per row of the response mask."""
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must have shape [B] with B={response_mask.shape[0]}, got {tuple(scores.shape)}"
        )


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    response_mask: Tensor,
    *,
    group_ids: GroupIds | None = None,
    group_size: int | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantages ``[B, R]``: score minus its group's mean, optionally / (std + eps).

    Groups come from ``group_ids`` (one hashable per row, any order) or ``group_size`` n with rows
    prompt-major.  The std is the sample std (n-1); groups of one sample get advantage 0.  The
    sequence's advantage is copied onto each of its valid tokens.
    """
    _check_scores(scores, response_mask)
    dtype = _float(scores).dtype
    s = _wide(scores)
    index, num_groups = _group_index(s.shape[0], group_ids, group_size, s.device)
    count, mean, std = _group_stats(s, index, num_groups)
    adv = s - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv)).to(dtype)
    return adv[:, None] * response_mask.to(dtype)


@torch.no_grad()
def rloo_advantages(
    scores: Tensor,
    response_mask: Tensor,
    *,
    group_ids: GroupIds | None = None,
    group_size: int | None = None,
) -> Tensor:
    """REINFORCE leave-one-out advantages ``[B, R]``: score minus the mean of the *other* samples.

    Equals ``n / (n - 1) * (score - group mean)``; groups of one sample get 0.  Grouping as in
    :func:`grpo_advantages`.
    """
    _check_scores(scores, response_mask)
    dtype = _float(scores).dtype
    s = _wide(scores)
    index, num_groups = _group_index(s.shape[0], group_ids, group_size, s.device)
    count, mean, _ = _group_stats(s, index, num_groups)
    adv = torch.where(count > 1, (s - mean) * count / (count - 1).clamp(min=1.0), torch.zeros_like(s)).to(dtype)
    return adv[:, None] * response_mask.to(dtype)


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_next`` over the valid tokens of each response ``[B, R]``.

    "next" is the next *valid* token (holes in the mask are skipped, as in :func:`gae_advantages`); masked
    positions come back as 0. This is GAE with a zero critic and ``lam = 1``, written out for clarity.
    """
    if token_rewards.shape != response_mask.shape:
        raise ValueError(f"shape mismatch: token_rewards {tuple(token_rewards.shape)}, "
                         f"response_mask {tuple(response_mask.shape)}")
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=_float(token_rewards).dtype, device=token_rewards.device)
    rewards = torch.where(keep, _float(token_rewards), zero)
    running = torch.zeros_like(rewards[:, 0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        g = rewards[:, t] + gamma * running
        columns.append(torch.where(keep[:, t], g, zero))
        running = torch.where(keep[:, t], g, running)
    return torch.stack(columns[::-1], dim=1)


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ (Hu 2025): the token-level discounted return, whitened over all valid tokens of the batch.

    ``token_rewards`` already hold the outcome score on the last token and the KL penalty on every token
    (:func:`~pipelines.algorithms.kl.apply_kl_penalty`); no critic, no group: the baseline is the batch mean.
    """
    return masked_whiten(discounted_returns(token_rewards, response_mask, gamma), response_mask)


@torch.no_grad()
def group_baseline_scores(
    scores: Tensor, *, group_ids: GroupIds | None = None, group_size: int | None = None
) -> Tensor:
    """Each score minus its group's mean ``[B]``; groups of one sample get 0 (no baseline to compare with).

    The first half of REINFORCE++-baseline; the step whitens the result over the batch's tokens afterwards.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape [B], got {tuple(scores.shape)}")
    dtype = _float(scores).dtype
    s = _wide(scores)
    index, num_groups = _group_index(s.shape[0], group_ids, group_size, s.device)
    count, mean, _ = _group_stats(s, index, num_groups)
    return torch.where(count > 1, s - mean, torch.zeros_like(s)).to(dtype)


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    scores: Tensor,
    response_mask: Tensor,
    *,
    group_ids: GroupIds | None = None,
    group_size: int | None = None,
) -> Tensor:
    """REINFORCE++-baseline: score minus its group's mean, put on every valid token, whitened over the batch.

    Unlike GRPO the scale comes from the whole batch (all valid tokens), not from each group's std, so a group
    whose answers differ little is not blown up to unit variance.
    """
    _check_scores(scores, response_mask)
    centered = group_baseline_scores(scores, group_ids=group_ids, group_size=group_size)
    return masked_whiten(centered[:, None].expand(response_mask.shape).clone(), response_mask)


@torch.no_grad()
def remax_advantages(scores: Tensor, greedy_scores: Tensor, response_mask: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): each sampled response's score minus the score of the greedy response to the same
    prompt, on every valid token ``[B, R]``. ``greedy_scores`` is one value per row (repeat a prompt's greedy
    score for each of its samples)."""
    _check_scores(scores, response_mask)
    _check_scores(greedy_scores, response_mask)
    adv = _float(scores) - _float(greedy_scores)
    return adv[:, None] * response_mask.to(adv.dtype)
