"""RL algorithm math on per-token ``[B, R]`` tensors: advantages, KL, PPO/GRPO losses.

Pure torch; nothing here imports the runtime (``orchestra``) or the engines.
"""

from .advantages import gae_advantages, grpo_advantages, outcome_to_token_scores, rloo_advantages
from .kl import KL_KINDS, KLKind, apply_kl_penalty, kl_loss, kl_penalty
from .losses import entropy_bonus, entropy_from_logits, policy_loss, value_loss
from .masked import AGG_MODES, AggMode, aggregate, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AGG_MODES",
    "AggMode",
    "KL_KINDS",
    "KLKind",
    "aggregate",
    "apply_kl_penalty",
    "entropy_bonus",
    "entropy_from_logits",
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
