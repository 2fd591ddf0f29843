"""Model builders for the engines: tiny random models from a seed, or local checkpoints.

Every builder works offline: random init needs no files, and loading from ``path`` uses
``local_files_only=True`` so nothing ever touches the network. Random init is reproducible:
the same ``(config, seed)`` gives bit-identical weights in every process, which is how the
ranks of an FSDP engine (and a rollout worker) agree on their starting point without sending
weights around.
"""

from __future__ import annotations

import copy
import logging
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

log = logging.getLogger("orchestra")


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


def _few(keys: list[str], n: int = 5) -> str:
    """The first ``n`` of ``keys``, comma-separated, with ``...`` when there are more."""
    return ", ".join(keys[:n]) + (", ..." if len(keys) > n else "")


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """A hint when most unused checkpoint keys are missing model keys under one extra prefix (``module.`` from a
    DDP/FSDP wrapper, ...); "" otherwise."""
    want = set(missing)
    for u in unexpected:
        for m in missing:
            if u.endswith("." + m):
                prefix = u[: -len(m)]
                hits = sum(k.startswith(prefix) and k[len(prefix):] in want for k in unexpected)
                if hits * 2 >= len(unexpected):
                    return (f" The checkpoint's keys look like the model's under a {prefix!r} prefix (a wrapped "
                            f"model's state_dict): strip the prefix from the keys, or save the unwrapped model.")
                break
    return ""


def _check_loading_info(model: PreTrainedModel, info: Mapping[str, Any], path: str, *, head_model: bool = False,
                        new_head_level: int = logging.INFO) -> None:
    """Refuse a checkpoint that does not fill the model: transformers initialises missing weights at random and
    drops unexpected ones, with only a load report (hidden at TRANSFORMERS_VERBOSITY=error) to say so.

    Tied weights never show up here (transformers resolves them). A ``head_model`` (critic / reward model:
    ``model.base_model_prefix`` is the backbone) may load a causal-LM checkpoint: the weights outside the backbone
    that the checkpoint lacks are the head the class adds (initialised from the seed, logged at
    ``new_head_level``), and the checkpoint's weights outside the backbone (the LM head) are unused (logged at INFO).
    Everything else missing or unused is refused with a ValueError listing a few keys and the counts.
    """
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or ()))
    errors = list(info.get("error_msgs") or ())
    name = type(model).__name__
    new_head: list[str] = []
    unused_head: list[str] = []
    base = getattr(model, "base_model_prefix", "") or ""
    if head_model and base:
        # the weights outside the backbone that the checkpoint lacks are the head this class adds; the checkpoint's
        # weights outside the backbone are another task's head (the LM head) -- unused, but only if all else fits
        new_head = [k for k in missing if not k.startswith(base + ".")]
        missing = [k for k in missing if k not in new_head]
        if not missing:
            unused_head = [k for k in unexpected if not k.startswith(base + ".")]
            unexpected = [k for k in unexpected if k not in unused_head]
    if missing or unexpected or mismatched or errors:
        parts = []
        if missing:
            parts.append(f"weights the model needs are missing from the checkpoint ({len(missing)}): {_few(missing)}")
        if unexpected:
            parts.append(f"weights in the checkpoint are unused by the model ({len(unexpected)}): {_few(unexpected)}")
        if mismatched:
            parts.append(f"weights with another shape ({len(mismatched)}): {_few(mismatched)}")
        if errors:
            parts.append(f"load errors: {_few([str(e) for e in errors], 3)}")
        raise ValueError(
            f"loading {name} from {path!r}: " + "; ".join(parts) + ". They would be initialised at random / dropped "
            "silently." + _prefix_hint(missing, unexpected) + " Check that the path is a checkpoint of this model "
            "(a causal LM for the actor, reference and rollout; a causal LM or a value-model checkpoint for the "
            "critic) saved with save_pretrained from the unwrapped model."
        )
    if new_head:
        log.log(new_head_level, "loading %s from %r: newly initialised from the seed (not in the checkpoint): %s",
                name, path, ", ".join(new_head))
    if unused_head:
        log.info("loading %s from %r: checkpoint weights unused by this model (another head): %s",
                 name, path, ", ".join(unused_head))


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
    new_head_level: int = logging.INFO,
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
            model, info = auto_cls.from_pretrained(p, config=cfg, local_files_only=True, output_loading_info=True, **kw)
            _check_loading_info(model, info, p, head_model=auto_cls is not AutoModelForCausalLM,
                                new_head_level=new_head_level)
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
        new_head_level=logging.WARNING,  # a reward head at random gives random rewards: say so louder
    )


def transformers_version() -> str:
    """The installed transformers version (recorded in bench output)."""
    return transformers.__version__
