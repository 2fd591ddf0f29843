"""The adaptive KL coefficient (``algorithm.kl_target``) as the steps use it: one controller per run, held by the
runner (and saved in its checkpoints), measured and updated once per step."""

from __future__ import annotations

from orchestra import DataFuture

from .algorithms import AdaptiveKLController
from .config import Config
from .stage import StepContext, union

__all__ = ["adapt_kl", "kl_coef", "make_kl_controller"]


def make_kl_controller(cfg: Config) -> AdaptiveKLController | None:
    """A fresh controller starting at ``algorithm.kl_coef`` when ``algorithm.kl_target`` is set, else None."""
    alg = cfg.algorithm
    if alg.kl_target is None:
        return None
    return AdaptiveKLController(alg.kl_coef, target=alg.kl_target, horizon=alg.kl_horizon)


def kl_coef(ctx: StepContext) -> float:
    """The KL coefficient of this step: the controller's when there is one, else ``algorithm.kl_coef``."""
    return ctx.kl_ctl.coef if ctx.kl_ctl is not None else ctx.cfg.algorithm.kl_coef


async def adapt_kl(ctx: StepContext, rollouts: DataFuture, old: DataFuture, ref: DataFuture | None,
                   rows: int) -> dict[str, float]:
    """After the update: measure this step's KL(policy || ref) (k1, mean over valid response tokens, from the
    rollout-time log-probs) and move the controller; returns ``kl/mean`` and ``kl/coef`` (the coefficient used)."""
    if ctx.kl_ctl is None or ref is None:
        return {}
    used = ctx.kl_ctl.coef
    m = await ctx.cluster.advantage.kl_moments(union(rollouts, old, ref))
    kl = m["sum"] / max(m["count"], 1.0)
    ctx.kl_ctl.update(kl, n_steps=rows)
    return {"kl/mean": kl, "kl/coef": used}
