"""GRPO: sample a group of responses per prompt, score them, normalize scores within each group, update.

No critic. Every stage streams: reward and log-prob workers start on the first micro-batch of rollouts while the
rest are still being generated; only the per-sequence scores (a few bytes a row) reach the controller, to
normalize within groups.
"""

from __future__ import annotations

import torch

from orchestra import Batch, DataFuture

from .algorithms import grpo_advantages
from .objectives import PolicyLoss
from .stage import StepContext, union

__all__ = ["grpo_step"]


async def grpo_step(ctx: StepContext, rollouts: DataFuture) -> dict[str, float]:
    """One GRPO update on ``rollouts`` (a streamed DataFuture of ``n`` samples per prompt, prompt-major)."""
    cfg, alg = ctx.cfg, ctx.cfg.algorithm
    stream = {"stream": True}

    scores = ctx.stage("reward", ctx.cluster.reward.score.options(**stream)(rollouts))
    old = ctx.stage("old_log_prob", ctx.cluster.actor.compute_log_prob.options(**stream)(rollouts))
    ref = None
    if alg.kl_coef > 0:
        ref = ctx.stage("ref_log_prob", ctx.cluster.actor.compute_ref_log_prob.options(**stream)(rollouts))

    s = (await scores)["scores"]  # [B] floats: the one payload the controller reads
    adv = grpo_advantages(s, torch.ones(len(s), 1), group_size=cfg.rollout.n, norm_by_std=alg.norm_adv_by_std,
                          eps=alg.adv_eps)[:, 0]

    loss = PolicyLoss(clip_ratio_low=cfg.actor.clip_ratio_low, clip_ratio_high=cfg.actor.clip_ratio_high,
                      dual_clip_c=cfg.actor.dual_clip_c, agg=cfg.actor.loss_agg, entropy_coef=cfg.actor.entropy_coef,
                      kl_coef=alg.kl_coef, kl_estimator=alg.kl_loss_estimator)
    batch = union(rollouts, old, ref, Batch.from_dict({"advantages": adv}))
    metrics = await ctx.stage("update_actor", ctx.cluster.actor.update_actor(
        batch, loss_fn=loss, ppo_epochs=cfg.actor.ppo_epochs, mini_batches=cfg.actor.mini_batches))
    return {**ctx.score_metrics(s), **metrics}
