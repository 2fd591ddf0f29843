"""Masked reductions over per-token tensors and the loss aggregation modes.

Per-token tensors are ``[B, R]`` over response tokens; ``mask`` is ``[B, R]`` with 1 (or True) for
real tokens.  Masked positions never influence a result, even when they hold NaN or inf.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


def _valid(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` with masked positions zeroed, and the mask as a float tensor of ``x``'s dtype."""
    if x.shape != mask.shape:
        raise ValueError(f"shape mismatch: values {tuple(x.shape)} vs mask {tuple(mask.shape)}")
    keep = mask.bool()
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)), keep.to(x.dtype)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (all of them, or along ``dim``)."""
    xz, _ = _valid(x, mask)
    return xz.sum() if dim is None else xz.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 where nothing is set (never NaN)."""
    xz, m = _valid(x, mask)
    if dim is None:
        return xz.sum() / m.sum().clamp(min=1.0)
    return xz.sum(dim) / m.sum(dim).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries of ``x`` (all dims); ``unbiased`` applies Bessel's n/(n-1)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.bool().sum().to(var.dtype)
        var = var * torch.where(n > 1, n / (n - 1).clamp(min=1.0), torch.ones_like(n))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize the valid entries of ``x`` to unit variance (and zero mean if ``shift_mean``).

    Statistics are taken over all valid tokens of this tensor (one data-parallel shard when the
    batch is sharded); masked positions come back as 0.
    """
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return _valid(out, mask)[0]


def aggregate(
    loss_mat: Tensor, mask: Tensor, mode: AggMode = "token-mean", normalizer: float | None = None
) -> Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar.

    - ``token-mean``: sum over all valid tokens / number of valid tokens (long answers weigh more).
    - ``seq-mean-token-sum``: per sequence sum over its tokens, then mean over sequences.
    - ``seq-mean-token-mean``: per sequence mean over its tokens, then mean over sequences.
    - ``seq-mean-token-sum-norm``: per sequence sum over its tokens divided by the constant response width
      ``R`` (the generation budget, not the sequence's own length), then mean over sequences (Dr. GRPO).
    Sequences without valid tokens are left out of the sequence means. :func:`agg_units` names what the mean
    is over. With gradient accumulation pass ``normalizer`` = that unit count of the whole mini-batch, so that
    summing the micro-batch losses gives exactly the mini-batch loss (the training engine instead weights
    micro-batch means by their unit share, which is the same thing).
    """
    if mode == "token-mean":
        total, count = masked_sum(loss_mat, mask), mask.bool().sum().to(loss_mat.dtype)
    elif mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        reduce = masked_mean if mode == "seq-mean-token-mean" else masked_sum
        per_seq = reduce(loss_mat, mask, dim=-1)
        if mode == "seq-mean-token-sum-norm":
            per_seq = per_seq / loss_mat.shape[-1]
        total, count = per_seq.sum(), mask.bool().any(-1).sum().to(loss_mat.dtype)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    if normalizer is not None:
        if normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        return total / normalizer
    return total / count.clamp(min=1.0)


def agg_units(mode: AggMode) -> Literal["tokens", "sequences"]:
    """What ``mode`` averages over: valid ``"tokens"`` (token-mean) or ``"sequences"`` with a valid token.

    A training engine that splits a mini-batch into micro-batches (and data-parallel ranks) weights each
    micro-batch's loss by its share of these units, so the objective is the whole mini-batch's loss.
    """
    if mode == "token-mean":
        return "tokens"
    if mode in AGG_MODES:
        return "sequences"
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
