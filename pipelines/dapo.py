"""DAPO (Yu et al. 2025, *DAPO: An Open-Source LLM Reinforcement Learning System at Scale*) as a step:
``algorithm.name=dapo``.

1. Dynamic sampling (``pipelines.dynamic_sampling``): groups whose rewards are all equal carry no group-relative
   signal, so they are dropped and fresh prompts are sampled (at most ``algorithm.dynamic_sampling_max_rounds``
   extra rounds) until the step has ``data.prompts_per_step`` groups.
2. The critic-free update of ``pipelines.grpo`` on the kept groups, with DAPO's choices set in the config:
   clip-higher (``actor.clip_ratio_high`` > ``clip_ratio_low``, e.g. 0.28 / 0.2), token-level loss
   (``actor.loss_agg=token-mean``), the soft overlong penalty (``algorithm.overlong_buffer``) and no KL term
   (``algorithm.kl_coef=0``). See ``examples/dapo_digits.yaml``.

``reward/*`` are over every sampled response (an unbiased view of the policy);
``dynamic_sampling/trained_reward_mean`` is over the groups trained on.
"""

from __future__ import annotations

from orchestra import DataFuture

from .dynamic_sampling import dynamic_sampling
from .grpo import critic_free_update
from .stage import StepContext

__all__ = ["dapo_step"]


async def dapo_step(ctx: StepContext, rollouts: DataFuture) -> dict[str, float]:
    """One DAPO step: dynamic sampling starting from ``rollouts``, then the update on the groups kept."""
    groups = await dynamic_sampling(ctx, rollouts)
    metrics = await critic_free_update(ctx, groups.rollouts, groups.scores, streamed=False, filler=groups.filler)
    return {**metrics, **ctx.score_metrics(groups.sampled_scores), **groups.metrics}
