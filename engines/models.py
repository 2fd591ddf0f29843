"""Model builders for the engines: tiny random models from a seed, or local checkpoints.

Every builder works offline: random init needs no files, and loading from ``path`` uses
``local_files_only=True`` so nothing ever touches the network. Random init is reproducible:
the same ``(config, seed)`` gives bit-identical weights in every process, which is how the
ranks of an FSDP engine (and a rollout worker) agree on their starting point without sending
weights around.
"""

from __future__ import annotations

import copy

import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

__all__ = [
    "tiny_qwen2_config",
    "build_causal_lm",
    "build_value_model",
    "build_reward_model",
    "resolve_config",
]

ConfigLike = Mapping[str, Any] | PretrainedConfig | None


def tiny_qwen2_config(vocab_size: int = 256, **overrides: Any) -> Qwen2Config:
    """A ~0.1-0.4 M parameter Qwen2 config for tests and benchmarks.

    Defaults: hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, 512 positions,
    untied embeddings. Any Qwen2Config field can be overridden.
    """
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_cache=True,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def resolve_config(config: ConfigLike, path: str | os.PathLike | None = None) -> PretrainedConfig:
    """Turn ``config`` (dict, PretrainedConfig or None) into a PretrainedConfig.

    A dict with a ``model_type`` key goes through ``AutoConfig.for_model``; a dict without one is
    read as overrides of :func:`tiny_qwen2_config`. ``None`` reads ``path``'s config.json
    (local only) or, without a path, gives the default tiny Qwen2.
    """
    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)  # models keep (and engines mutate) their config: never share the caller's
    if config is None:
        if path is not None:
            return AutoConfig.from_pretrained(os.fspath(path), local_files_only=True)
        return tiny_qwen2_config()
    if isinstance(config, Mapping):
        cfg = dict(config)
        model_type = cfg.pop("model_type", None)
        if model_type is None:
            return tiny_qwen2_config(**cfg)
        return AutoConfig.for_model(model_type, **cfg)
    raise TypeError(
        f"config must be a dict, a transformers.PretrainedConfig or None, got {type(config).__name__}"
    )


def _check_path(path: str | os.PathLike) -> str:
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise FileNotFoundError(
            f"model path {p!r} is not a local directory; engines load only local checkpoints "
            "(download it first, e.g. with huggingface-cli, and pass the directory)"
        )
    return p


# One seeded model build at a time in this process (see _build); reentrant, so a build may build another.
_SEEDED_BUILD_LOCK = threading.RLock()


def _build(
    auto_cls: Any,
    config: ConfigLike,
    *,
    seed: int,
    dtype: torch.dtype,
    path: str | os.PathLike | None,
    attn_implementation: str | None,
    config_updates: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    kw: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    # fork_rng: seed the init (and any freshly initialised head of a loaded model) without
    # disturbing the caller's global RNG stream. The init draws from torch's *global* RNG (transformers'
    # _init_weights takes no generator), so two builds on two threads (the in-process backend builds each worker
    # on its own thread) would interleave their draws and one's fork_rng restore would clobber the other's seed:
    # _SEEDED_BUILD_LOCK makes each seeded build whole, so (config, seed) gives the same weights on any thread.
    with _SEEDED_BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if path is not None:
            p = _check_path(path)
            cfg = resolve_config(config, p)
            for k, v in (config_updates or {}).items():
                setattr(cfg, k, v)
            model = auto_cls.from_pretrained(p, config=cfg, local_files_only=True, **kw)
        else:
            cfg = resolve_config(config)
            for k, v in (config_updates or {}).items():
                setattr(cfg, k, v)
            model = auto_cls.from_config(cfg, **kw)
    return model


def build_causal_lm(
    config: ConfigLike = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    path: str | os.PathLike | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A causal LM: random init from ``seed`` or loaded from a local directory ``path``.

    Keep ``dtype=float32`` for trainers (FSDP keeps fp32 master weights and casts to bf16 for
    compute on CUDA); use bf16 for inference-only copies.
    """
    return _build(
        AutoModelForCausalLM,
        config,
        seed=seed,
        dtype=dtype,
        path=path,
        attn_implementation=attn_implementation,
    )


def build_value_model(
    config: ConfigLike = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    path: str | os.PathLike | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A critic: decoder backbone + a per-token scalar head (token classification, 1 label).

    The head's dropout is set to 0 so values are deterministic in train mode. Loading a causal
    LM checkpoint from ``path`` keeps its backbone and initialises the head from ``seed``.
    Output ``logits[..., 0]`` at position t is the value of the prefix ending at t.
    """
    return _build(
        AutoModelForTokenClassification,
        config,
        seed=seed,
        dtype=dtype,
        path=path,
        attn_implementation=attn_implementation,
        config_updates={"num_labels": 1, "classifier_dropout": 0.0},
    )


def build_reward_model(
    config: ConfigLike = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    path: str | os.PathLike | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A reward model: decoder backbone + sequence-classification head with one label.

    Score it with :class:`engines.reward.RewardModelEngine`, which pools at the last real
    token from ``attention_mask`` (not from ``pad_token_id`` as transformers does).
    """
    return _build(
        AutoModelForSequenceClassification,
        config,
        seed=seed,
        dtype=dtype,
        path=path,
        attn_implementation=attn_implementation,
        config_updates={"num_labels": 1},
    )


def transformers_version() -> str:
    """The installed transformers version (recorded in bench output)."""
    return transformers.__version__
