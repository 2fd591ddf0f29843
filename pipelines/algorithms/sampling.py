"""DAPO's data-side pieces (Yu et al. 2025): the dynamic-sampling group filter and the soft overlong penalty.

Pure functions on per-sequence tensors; the step decides what to do with what they return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .advantages import GroupIds, _group_index


@dataclass(frozen=True)
class GroupFilter:
    """Which rows survive :func:`dynamic_sampling_filter` and how many groups were seen, kept and dropped."""

    keep: Tensor  # [B] bool: rows of the kept groups
    groups: int
    kept_groups: int
    dropped_groups: int

    def metrics(self) -> dict[str, float]:
        """Counts for metrics.jsonl (``dynamic_sampling/*``)."""
        return {"dynamic_sampling/groups": float(self.groups),
                "dynamic_sampling/kept_groups": float(self.kept_groups),
                "dynamic_sampling/dropped_groups": float(self.dropped_groups)}


@torch.no_grad()
def dynamic_sampling_filter(
    scores: Tensor,
    *,
    group_ids: GroupIds | None = None,
    group_size: int | None = None,
    atol: float = 0.0,
) -> GroupFilter:
    """Drop the groups whose rewards are all equal (max - min <= ``atol``): their group-relative advantages are 0,
    so they only dilute the batch. A group of one sample is "all equal" and is dropped too.

    Grouping as in :func:`~pipelines.algorithms.advantages.grpo_advantages`. Non-finite scores are an error (they
    would make a group look diverse).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape [B], got {tuple(scores.shape)}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("dynamic_sampling_filter: scores must be finite")
    s = scores.double()
    index, num_groups = _group_index(s.shape[0], group_ids, group_size, s.device)
    hi = torch.full((num_groups,), -torch.inf, dtype=s.dtype, device=s.device).scatter_reduce(0, index, s, "amax")
    lo = torch.full((num_groups,), torch.inf, dtype=s.dtype, device=s.device).scatter_reduce(0, index, s, "amin")
    diverse = (hi - lo) > atol
    kept = int(diverse.sum())
    return GroupFilter(keep=diverse[index], groups=num_groups, kept_groups=kept, dropped_groups=num_groups - kept)


@torch.no_grad()
def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment ``[B]``, to *add* to each response's score.

    With ``L = lengths``, ``M = max_length`` and ``C = buffer``: 0 for ``L <= M - C``; ``factor * (M - C - L) / C``
    (falling linearly from 0 to ``-factor``) for ``M - C < L <= M``; ``-factor`` for ``L > M``.
    """
    if buffer < 1 or buffer > max_length:
        raise ValueError(f"buffer must be in [1, max_length={max_length}], got {buffer}")
    L = lengths.double()
    soft = (max_length - buffer - L) / buffer
    out = torch.where(L <= max_length - buffer, torch.zeros_like(L), soft)
    out = torch.where(L > max_length, torch.full_like(L, -1.0), out)
    return factor * out
