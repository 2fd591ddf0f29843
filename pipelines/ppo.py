"""PPO: rollouts scored by a reward, values from a critic, GAE advantages, clipped policy and value updates.

The KL to the reference enters either the reward (``algorithm.kl_in=reward``, the classic RLHF penalty) or the
policy loss. Advantages are computed on the reward pool next to the rows; the controller reads only the batch
moments it needs to whiten them and the per-sequence scores for logging.
"""

from __future__ import annotations

from orchestra import DataFuture

from .grpo import whitening
from .kl_control import adapt_kl, kl_coef
from .objectives import PolicyLoss, ValueLoss
from .stage import StepContext, join, union

__all__ = ["ppo_step"]


async def ppo_step(ctx: StepContext, rollouts: DataFuture) -> dict[str, float]:
    """One PPO update (actor and critic) on ``rollouts``."""
    cfg, alg, c = ctx.cfg, ctx.cfg.algorithm, ctx.cluster
    stream = {"stream": True}
    beta = kl_coef(ctx)  # fixed, or the adaptive controller's (algorithm.kl_target)
    kl_in_reward = alg.kl_coef > 0 and alg.kl_in == "reward"

    scores = ctx.stage("reward", c.reward.score.options(**stream)(rollouts))
    old = ctx.stage("old_log_prob", c.actor.compute_log_prob.options(**stream)(rollouts))
    ref = (ctx.stage("ref_log_prob", c.actor.compute_ref_log_prob.options(**stream)(rollouts))
           if alg.kl_coef > 0 else None)
    values = ctx.stage("values", c.critic.compute_values.options(**stream)(rollouts))

    adv = ctx.stage("gae", c.advantage.gae.options(**stream)(
        union(rollouts, scores, old, ref, values), gamma=alg.gamma, lam=alg.lam,
        kl_coef=beta if kl_in_reward else 0.0, kl_estimator=alg.kl_reward_estimator))
    # the advantages' moments: logged as adv/mean, adv/std whether or not the loss whitens with them (without
    # whitening, awaited only after the updates: nothing waits for them)
    moments_fut = c.advantage.moments(union(rollouts, adv))
    mean, std = whitening(await moments_fut) if alg.whiten_advantages else (0.0, 1.0)

    policy = PolicyLoss(clip_ratio_low=cfg.actor.clip_ratio_low, clip_ratio_high=cfg.actor.clip_ratio_high,
                        dual_clip_c=cfg.actor.dual_clip_c, agg=cfg.actor.loss_agg,
                        entropy_coef=cfg.actor.entropy_coef, kl_coef=0.0 if kl_in_reward else beta,
                        kl_estimator=alg.kl_loss_estimator, adv_mean=mean, adv_std=std,
                        loss_type=cfg.actor.policy_loss, rollout_is_cap=cfg.actor.rollout_is_cap)
    batch = union(rollouts, old, ref, values, adv)
    actor_m, critic_m = await join(
        ctx.stage("update_actor", c.actor.update_actor(batch, loss_fn=policy, ppo_epochs=cfg.actor.ppo_epochs,
                                                        mini_batches=cfg.actor.mini_batches)),
        ctx.stage("update_critic", c.critic.update_critic(batch, loss_fn=ValueLoss(cfg.critic.value_clip,
                                                                                   cfg.critic.loss_agg),
                                                          ppo_epochs=cfg.critic.ppo_epochs,
                                                          mini_batches=cfg.critic.mini_batches)))
    s = (await scores)["scores"]
    kl_metrics = await adapt_kl(ctx, rollouts, old, ref, rows=len(s))
    moments = whitening(await moments_fut)
    return {**ctx.score_metrics(s), "adv/mean": moments[0], "adv/std": moments[1],
            **actor_m, **critic_m, **kl_metrics}
