"""RL algorithm math on per-token ``[B, R]`` tensors: advantages, KL, policy losses, DAPO's sampling pieces.

Pure torch; nothing here imports the runtime (``orchestra``) or the engines. Entropy from logits is computed by
the engine that holds the logits (``engines._data.entropy_from_logits``, the project's one implementation); the
losses here take the per-token entropy it returns. ``docs/algorithms.md`` has the table of what is here and the
paper each comes from.
"""

from .advantages import (
    discounted_returns,
    gae_advantages,
    group_baseline_scores,
    grpo_advantages,
    outcome_to_token_scores,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from .kl import KL_KINDS, AdaptiveKLController, KLKind, apply_kl_penalty, kl_loss, kl_penalty, min_kl_horizon
from .losses import (
    POLICY_LOSSES,
    cispo_loss,
    entropy_bonus,
    gmpo_loss,
    gspo_loss,
    policy_loss,
    truncated_is_weights,
    value_loss,
)
from .masked import AGG_MODES, AggMode, agg_units, aggregate, masked_mean, masked_sum, masked_var, masked_whiten
from .sampling import GroupFilter, dynamic_sampling_filter, overlong_penalty

__all__ = [
    "AGG_MODES",
    "AdaptiveKLController",
    "AggMode",
    "GroupFilter",
    "KL_KINDS",
    "KLKind",
    "POLICY_LOSSES",
    "agg_units",
    "aggregate",
    "apply_kl_penalty",
    "cispo_loss",
    "discounted_returns",
    "dynamic_sampling_filter",
    "entropy_bonus",
    "gae_advantages",
    "gmpo_loss",
    "group_baseline_scores",
    "grpo_advantages",
    "gspo_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "min_kl_horizon",
    "outcome_to_token_scores",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "truncated_is_weights",
    "value_loss",
]
