"""Critic-free steps: sample a group of responses per prompt, score them, turn scores into advantages, update.

``algorithm.adv_estimator`` picks the advantage: GRPO (score minus group mean, / group std), Dr. GRPO (no std),
RLOO (leave-one-out mean), REINFORCE++-baseline (minus group mean, whitened over the batch's tokens), REINFORCE++
(token-level discounted return with the KL in the reward, whitened over the batch) or ReMax (score minus the score
of the greedy response to the same prompt, from the greedy rollout the runner launches next to the sampled one).
Every stage streams: reward and log-prob workers start on the first micro-batch of rollouts while the rest are
still being generated; only the per-sequence scores (a few bytes a row) and the batch moments reach the controller.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from orchestra import Batch, DataFuture

from .algorithms import grpo_advantages, group_baseline_scores, overlong_penalty, remax_advantages, rloo_advantages
from .kl_control import adapt_kl, kl_coef
from .objectives import PolicyLoss
from .stage import StepContext, union

__all__ = ["critic_free_update", "grpo_step", "whitening"]


def whitening(moments: dict[str, float]) -> tuple[float, float]:
    """``(mean, std + 1e-8)`` from the advantage workers' ``moments`` (sum, sum of squares, count of valid tokens)."""
    n = max(moments["count"], 1.0)
    mean = moments["sum"] / n
    return mean, math.sqrt(max(moments["sumsq"] / n - mean * mean, 0.0)) + 1e-8


async def grpo_step(ctx: StepContext, rollouts: DataFuture) -> dict[str, float]:
    """One critic-free update on ``rollouts`` (a streamed DataFuture of ``n`` samples per prompt, prompt-major)."""
    scores = ctx.stage("reward", ctx.cluster.reward.score.options(stream=True)(rollouts))
    return await critic_free_update(ctx, rollouts, scores)


async def _get(x: DataFuture | Batch) -> Batch:
    """The value of a future, or the batch itself."""
    return x if isinstance(x, Batch) else await x


async def critic_free_update(ctx: StepContext, rollouts: DataFuture, scores: DataFuture | Batch,
                             streamed: bool = True, filler: torch.Tensor | None = None) -> dict[str, float]:
    """Advantages from ``scores`` (the reward stage's output for ``rollouts``) and one actor update. ``rollouts``
    is the runner's streamed future (GRPO; its stages map over parts as they arrive) or a finished set of rows
    (DAPO's kept groups, gathered on a worker: ``streamed=False``, each stage reads its shard of them).

    ``filler`` (bool [B], per-sequence estimators only): rows that only fill the update (DAPO's dropped groups).
    Their advantage is exactly 0 whatever the score shaping (the overlong penalty differs with the length inside
    an all-equal group): it is zeroed here, and the ``advantage_mask`` column the update and the advantage moments
    read keeps it 0 after whitening and out of the whitening statistics."""
    cfg, alg, c = ctx.cfg, ctx.cfg.algorithm, ctx.cluster
    estimator = alg.adv_estimator or "grpo"
    beta = kl_coef(ctx)  # fixed, or the adaptive controller's (algorithm.kl_target)
    kl_in_reward = alg.kl_coef > 0 and alg.kl_in == "reward"  # the config allows it for reinforce_pp only
    opts: dict[str, Any] = {"stream": True} if streamed else {}

    old = ctx.stage("old_log_prob", c.actor.compute_log_prob.options(**opts)(rollouts))
    ref = None
    if alg.kl_coef > 0:
        ref = ctx.stage("ref_log_prob", c.actor.compute_ref_log_prob.options(**opts)(rollouts))
    lengths, extra = None, {}
    if alg.overlong_buffer is not None:  # DAPO: shape the scores by response length (config: per-sequence only)
        lengths = ctx.stage("lengths", c.advantage.response_lengths.options(**opts)(rollouts))
    greedy = greedy_lengths = None
    if estimator == "remax":  # the baseline: the reward of the greedy response to each prompt
        if ctx.greedy is None:
            raise RuntimeError("adv_estimator=remax needs the greedy rollout the runner launches with the step's "
                               "prompts (StepContext.greedy); run it through pipelines.runner.Runner")
        greedy = ctx.stage("greedy_reward", c.reward.score.options(stream=True)(ctx.greedy))
        if alg.overlong_buffer is not None:
            greedy_lengths = c.advantage.response_lengths.options(stream=True)(ctx.greedy)

    if filler is not None and estimator == "reinforce_pp":
        raise ValueError("critic_free_update: filler rows need a per-sequence estimator; adv_estimator "
                         "'reinforce_pp' computes token-level advantages on the workers (the DAPO config refuses it)")
    if estimator == "reinforce_pp":  # token-level: computed next to the rows, then whitened over the batch
        adv = ctx.stage("returns", c.advantage.reinforce_pp.options(**opts)(
            union(rollouts, scores, old, ref), gamma=alg.gamma, kl_coef=beta if kl_in_reward else 0.0,
            kl_estimator=alg.kl_reward_estimator))
        s = (await _get(scores))["scores"]
    else:  # one number per sequence, from the scores the controller reads
        s = (await _get(scores))["scores"]  # [B] floats: the one payload the controller reads
        r = s
        if lengths is not None:
            penalty = overlong_penalty((await _get(lengths))["response_length"], cfg.rollout.max_new_tokens,
                                       alg.overlong_buffer, alg.overlong_penalty)
            r = s + penalty.to(s.dtype)
            extra["reward/overlong_penalty"] = float(penalty.mean())
        ones, n = torch.ones(len(r), 1), cfg.rollout.n
        if estimator == "rloo":
            a = rloo_advantages(r, ones, group_size=n)[:, 0]
        elif estimator == "reinforce_pp_baseline":
            a = group_baseline_scores(r, group_size=n)
        elif estimator == "remax":
            g = (await greedy)["scores"]  # [P]: one greedy response per prompt
            extra["reward/greedy_mean"] = float(g.double().mean())
            if greedy_lengths is not None:
                g = g + overlong_penalty((await greedy_lengths)["response_length"], cfg.rollout.max_new_tokens,
                                         alg.overlong_buffer, alg.overlong_penalty).to(g.dtype)
            a = remax_advantages(r, g.repeat_interleave(n), ones)[:, 0]
        else:  # grpo, dr_grpo (no std)
            a = grpo_advantages(r, ones, group_size=n, norm_by_std=estimator == "grpo" and alg.norm_adv_by_std,
                                eps=alg.adv_eps)[:, 0]
        cols = {"advantages": a}
        if filler is not None:
            if filler.shape != a.shape:
                raise ValueError(f"critic_free_update: filler has shape {tuple(filler.shape)}, the advantages "
                                 f"{tuple(a.shape)}; it must mark each trained row")
            cols = {"advantages": a.masked_fill(filler, 0.0), "advantage_mask": (~filler).to(a.dtype)}
        adv = Batch.from_dict(cols)
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        mean, std = whitening(await c.advantage.moments(union(rollouts, adv)))
        extra.update({"adv/mean": mean, "adv/std": std})
    else:
        mean, std = 0.0, 1.0

    loss = PolicyLoss(clip_ratio_low=cfg.actor.clip_ratio_low, clip_ratio_high=cfg.actor.clip_ratio_high,
                      dual_clip_c=cfg.actor.dual_clip_c, agg=cfg.actor.loss_agg, entropy_coef=cfg.actor.entropy_coef,
                      kl_coef=0.0 if kl_in_reward else beta, kl_estimator=alg.kl_loss_estimator,
                      adv_mean=mean, adv_std=std, loss_type=cfg.actor.policy_loss,
                      rollout_is_cap=cfg.actor.rollout_is_cap)
    batch = union(rollouts, old, ref, adv)
    metrics = await ctx.stage("update_actor", c.actor.update_actor(
        batch, loss_fn=loss, ppo_epochs=cfg.actor.ppo_epochs, mini_batches=cfg.actor.mini_batches))
    kl_metrics = await adapt_kl(ctx, rollouts, old, ref, rows=len(s))
    return {**ctx.score_metrics(s), **extra, **metrics, **kl_metrics}
