"""Per-token KL estimators between the policy and a reference policy, as reward penalty or loss.

With samples drawn from the policy and ``d = logp - ref_logp`` (so ``exp(-d)`` = ref / policy):

- ``k1``:  ``d``                     unbiased for KL(policy || ref), high variance, can be negative;
- ``abs``: ``|d|``;
- ``k2``:  ``d**2 / 2``              biased, low variance, always >= 0;
- ``k3``:  ``exp(-d) - 1 + d``       unbiased and always >= 0 (Schulman's estimator).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

from .masked import AggMode, aggregate

KLKind = Literal["k1", "k2", "k3", "abs"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)

# exp(20) ~ 5e8: keeps k3 and its gradient finite when the two policies disagree wildly.
_MAX_LOG_RATIO = 20.0


def k3_of(log_r: Tensor) -> Tensor:
    """``exp(x) - 1 - x`` of a log ratio ``x``, >= 0 and accurate to its last digits: as written, float32 loses them
    all for small ``x`` (the policy near the reference) and goes negative; ``expm1(x) - x`` keeps them down to
    ``|x|`` ~ 1e-2, below which its series ``x²/2 + x³/6 + x⁴/24`` does (exact to ~1e-8 relative there)."""
    series = log_r.square() * (0.5 + log_r * (1.0 / 6.0 + log_r / 24.0))
    return torch.where(log_r.abs() < 1e-2, series, torch.expm1(log_r) - log_r)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k1") -> Tensor:
    """Per-token KL estimate ``[B, R]`` of the given ``kind`` (see the module docstring)."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return k3_of((-d).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_KINDS)}")


def apply_kl_penalty(
    token_level_scores: Tensor, kl: Tensor, beta: float, response_mask: Tensor
) -> Tensor:
    """Token rewards ``scores - beta * kl``, 0 at masked positions (the KL-in-reward form of PPO)."""
    rewards = token_level_scores - beta * kl.detach()
    return torch.where(response_mask.bool(), rewards, torch.zeros_like(rewards))


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    response_mask: Tensor,
    kind: KLKind = "k3",
    agg: AggMode = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """Scalar KL(policy || ref) loss term (the KL-in-loss form of GRPO); gradients reach ``logp``.

    Multiply by the KL coefficient and add to the policy loss. Masked positions are zeroed *before* the estimator:
    a NaN / inf log-prob there reaches neither the loss nor the gradient (k2's backward is ``d * grad``, NaN for a
    non-finite ``d`` even where the aggregation's ``where`` passes back 0).
    """
    keep = response_mask.bool()
    logp = torch.where(keep, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    ref_logp = torch.where(keep, ref_logp.detach(), torch.zeros((), dtype=ref_logp.dtype, device=ref_logp.device))
    return aggregate(kl_penalty(logp, ref_logp, kind), response_mask, agg, normalizer)


def min_kl_horizon(samples_per_step: int) -> int:
    """The smallest ``algorithm.kl_horizon`` that keeps :class:`AdaptiveKLController`'s update factor positive for
    steps of ``samples_per_step`` samples: the least integer above ``0.2 x samples_per_step``."""
    return samples_per_step // 5 + 1  # 5 = 1 / AdaptiveKLController.MAX_ERROR


class AdaptiveKLController:
    """The proportional KL controller of Ziegler et al. 2019 (""Fine-tuning language models from human
    preferences""): after each step, ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``.

    The coefficient rises while the measured KL is above ``target`` and falls while below, by at most 20 % of
    ``n_steps / horizon`` per update. Its whole state is :meth:`state_dict` (plain JSON), so a checkpoint can carry it.

    The factor is > 0 for every measured KL only while ``n_steps < horizon / MAX_ERROR`` (5 x horizon); at or past
    that a KL below target would make the coefficient 0 or negative (the "KL term" would then push the policy away
    from the reference), so :meth:`update` refuses such a step. The job's config refuses the horizon up front
    (``algorithm.kl_horizon`` against ``data.prompts_per_step x rollout.n``, see :func:`min_kl_horizon`).
    """

    MAX_ERROR = 0.2  # the clip of the proportional error; pipelines.config keeps its own copy (no torch there)

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if not (init_coef >= 0 and target > 0 and horizon > 0):
            raise ValueError(f"need init_coef >= 0, target > 0, horizon > 0; got {init_coef}, {target}, {horizon}")
        self.coef = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, kl: float, n_steps: int = 1) -> float:
        """Move the coefficient after a step whose mean KL per token was ``kl`` (``n_steps`` samples or steps since
        the last update); returns the new coefficient. A non-finite ``kl`` is an error, not a silent NaN."""
        if not math.isfinite(kl):
            raise ValueError(f"AdaptiveKLController.update: kl must be finite, got {kl}")
        if self.horizon < min_kl_horizon(n_steps):  # integers: exact at the bound
            raise ValueError(
                f"AdaptiveKLController.update: a step of {n_steps} samples with horizon {self.horizon} could scale the "
                f"KL coefficient by 1 - {self.MAX_ERROR} x {n_steps}/{self.horizon} <= 0; set algorithm.kl_horizon > "
                f"{n_steps / 5:g} (at least {min_kl_horizon(n_steps)}) or sample fewer rows a step")
        error = min(max(kl / self.target - 1.0, -self.MAX_ERROR), self.MAX_ERROR)
        self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef

    def state_dict(self) -> dict[str, float | int]:
        """The controller's state as JSON-safe numbers."""
        return {"coef": self.coef, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore the coefficient :meth:`state_dict` saved. Target and horizon stay this run's settings: a resume
        may change them, as it may change the optimizer's (the checkpoint's overwrote them silently)."""
        self.coef = float(state["coef"])
