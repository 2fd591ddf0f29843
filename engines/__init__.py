"""Model engines: FSDP2 training, KV-cache rollout, rewards. Plain Python, no Ray.

Data convention shared by every engine. A batch is any ``Mapping[str, torch.Tensor]`` (a
``tensordict.TensorDict`` or a dict) with batch dimension B:

- ``prompts`` [B, P] int64, LEFT-padded
- ``responses`` [B, R] int64, RIGHT-padded
- ``input_ids`` = cat(prompts, responses) [B, P+R]
- ``attention_mask`` [B, P+R] (1 = real token)
- ``response_mask`` [B, R] (1 = real response token, the eos token included; 0/1 or bool only: the FSDP engine
  refuses other values, e.g. a 0.5 "weight", with a ValueError)

Position ids are derived inside the engines from ``attention_mask`` (cumsum - 1, clipped at 0).
Engines return TensorDicts with batch size [B] on CPU.

Public names are imported lazily (``import engines`` does not import transformers).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "engines.fsdp",
    "FSDPEngine": "engines.fsdp",
    "lr_factor": "engines.fsdp",
    "CheckpointError": "engines.checkpoint",
    "RolloutEngine": "engines.rollout",
    "SamplingParams": "engines.rollout",
    "RewardModelEngine": "engines.reward",
    "RuleRewardEngine": "engines.reward",
    "register_reward": "engines.reward",
    "get_reward": "engines.reward",
    "list_rewards": "engines.reward",
    "build_causal_lm": "engines.models",
    "build_value_model": "engines.models",
    "build_reward_model": "engines.models",
    "tiny_qwen2_config": "engines.models",
    "init_distributed": "engines._dist",
    "rendezvous_store": "engines._dist",
    "spawn": "engines._dist",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
