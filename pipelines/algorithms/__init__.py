"""RL algorithm math on per-token ``[B, R]`` tensors: advantages, KL, PPO/GRPO losses.

Pure torch; nothing here imports the runtime (``orchestra``) or the engines. Entropy from logits is computed by
the engine that holds the logits (``engines._data.entropy_from_logits``, the project's one implementation); the
losses here take the per-token entropy it returns.
"""

from .advantages import gae_advantages, grpo_advantages, outcome_to_token_scores, rloo_advantages
from .kl import KL_KINDS, KLKind, apply_kl_penalty, kl_loss, kl_penalty
from .losses import entropy_bonus, policy_loss, value_loss
from .masked import AGG_MODES, AggMode, agg_units, aggregate, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AGG_MODES",
    "AggMode",
    "KL_KINDS",
    "KLKind",
    "agg_units",
    "aggregate",
    "apply_kl_penalty",
    "entropy_bonus",
    "gae_advantages",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_to_token_scores",
    "policy_loss",
    "rloo_advantages",
    "value_loss",
]
