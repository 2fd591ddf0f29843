"""Typed training-job configuration: nested frozen dataclasses, YAML, ``section.key=value`` overrides.

``load_config("job.yaml", ["actor.lr=1e-3", "rollout.n=4"])`` reads the file, applies the
overrides and validates everything; any unknown key or bad value raises :class:`ConfigError`
naming the key path, the value and what is allowed.  Constructing the dataclasses directly runs
the same checks.  Defaults describe a tiny CPU run of the GRPO digit task
(``examples/grpo_single_process.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

# Kept in sync with pipelines.algorithms (tested); not imported so that reading a config needs no torch.
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "abs"]
PolicyLossKind = Literal["ppo", "gspo", "gmpo", "cispo"]
# critic-free estimators run by algorithm.name=grpo (dapo: the group ones); "gae" is PPO's (with the critic)
AdvEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae"]
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # need >= 2 responses per prompt
CRITIC_FREE_STEPS = ("grpo", "dapo")  # the steps that take adv_estimator's critic-free estimators


class ConfigError(ValueError):
    """A bad configuration; ``path`` is the offending key path (e.g. ``"actor.lr"``), if any."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


def _knob(default: Any, *, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field with numeric bounds checked on construction (None values skip them)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return field(default=default, metadata={"bounds": bounds})


_BOUND_OPS = {
    "ge": (">=", lambda v, b: v >= b),
    "gt": (">", lambda v, b: v > b),
    "le": ("<=", lambda v, b: v <= b),
    "lt": ("<", lambda v, b: v < b),
}


def _is_union(tp: Any) -> bool:
    """True for ``X | Y`` and ``Optional[X]`` annotations."""
    return get_origin(tp) in (Union, types.UnionType)


def _describe(tp: Any) -> str:
    """Human-readable name of an annotated type, for error messages."""
    if _is_union(tp):
        return " or ".join("null" if a is type(None) else _describe(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is dict:
        return "mapping"
    return tp.__name__


def _describe_bounded(tp: Any, bounds: Mapping[str, float]) -> str:
    """E.g. ``float > 0 and <= 1 (or null)`` for an optional bounded float."""
    optional = _is_union(tp) and type(None) in get_args(tp)
    base = next(a for a in get_args(tp) if a is not type(None)) if optional else tp
    ranges = " and ".join(f"{_BOUND_OPS[op][0]} {b}" for op, b in bounds.items())
    return f"{_describe(base)} {ranges}" + (" (or null)" if optional else "")


def _suggest(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for a near miss among ``candidates``, else an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; returns it, with ints widened to float where needed.

    Floats also accept numeric strings, because YAML 1.1 reads ``1e-3`` (no dot) as a string.
    """
    def bad(expected: str, hint: str = "") -> ConfigError:
        return ConfigError(
            f"{path}: bad value {value!r} ({type(value).__name__}); expected {expected}{hint}", path
        )

    if _is_union(tp):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(e)
        not_finite = [e for e in errors if "finite" in str(e)]
        if not_finite:
            raise not_finite[0]
        choices = [str(c) for a in args if get_origin(a) is Literal for c in get_args(a)]
        raise bad(_describe(tp), _suggest(value, choices) if isinstance(value, str) and choices else "")
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        hint = _suggest(value, [str(c) for c in choices]) if isinstance(value, str) else ""
        raise bad(_describe(tp), hint)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad("bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad("int")
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise bad("float")
        if not math.isfinite(number):  # .inf / .nan would train to NaN and "finish"
            raise bad("a finite float")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad("str")
    if get_origin(tp) is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise bad("mapping with string keys")
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the config schema")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a config dataclass."""
    return get_type_hints(cls)


@dataclass(frozen=True)
class _Section:
    """Base of the config sections: type- and range-checks every field on construction."""

    _section = ""  # the section's key in Config; a class attribute, not a field

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            path = f"{self._section}.{f.name}"
            value = _coerce(getattr(self, f.name), hints[f.name], path)
            bounds = f.metadata.get("bounds", {})
            if value is not None and not all(_BOUND_OPS[op][1](value, b) for op, b in bounds.items()):
                expected = _describe_bounded(hints[f.name], bounds)
                raise ConfigError(f"{path}: bad value {value!r}; expected {expected}", path)
            object.__setattr__(self, f.name, value)


@dataclass(frozen=True)
class ModelConfig(_Section):
    """The policy (and critic / reference) model."""

    _section = "model"
    path: str | None = None  # HF checkpoint dir or name; null: a tiny random model built from the knobs
    vocab_size: int | None = _knob(None, ge=1)  # null: the tokenizer's vocabulary size
    hidden_size: int = _knob(64, ge=1)
    num_layers: int = _knob(2, ge=1)
    num_heads: int = _knob(4, ge=1)
    num_kv_heads: int | None = _knob(None, ge=1)  # null: num_heads // 2 (grouped-query attention)
    intermediate_size: int | None = _knob(None, ge=1)  # MLP width; null: 2 x hidden_size
    tie_embeddings: bool = False  # share input and output embeddings
    max_seq_len: int = _knob(64, ge=2)  # prompt + response positions of the tiny model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass(frozen=True)
class DataConfig(_Section):
    """Where prompts come from and how many each step takes."""

    _section = "data"
    train_path: str | None = None  # .jsonl / .parquet of prompts; null: the task generates them
    prompt_key: str = "prompt"  # column holding the prompt in train_path
    prompts_per_step: int = _knob(32, ge=1)
    shuffle: bool = True
    seed: int = _knob(0, ge=0)  # prompt order


@dataclass(frozen=True)
class RolloutConfig(_Section):
    """Sampling of responses."""

    _section = "rollout"
    n: int = _knob(8, ge=1)  # responses per prompt (the GRPO group size)
    temperature: float = _knob(1.0, gt=0)
    top_p: float = _knob(1.0, gt=0, le=1)
    top_k: int = _knob(0, ge=0)  # 0: no top-k filtering
    max_new_tokens: int = _knob(3, ge=1)
    seed: int = _knob(0, ge=0)  # sampling


@dataclass(frozen=True)
class ActorConfig(_Section):
    """Policy optimization (the critic has its own section)."""

    _section = "actor"
    lr: float = _knob(2e-3, gt=0)
    warmup_steps: int = _knob(5, ge=0)  # linear warmup of the learning rate, in optimizer steps
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after warmup; cosine decays to min_lr_ratio x lr
    min_lr_ratio: float = _knob(0.0, ge=0, le=1)
    beta2: float = _knob(0.999, gt=0, lt=1)  # AdamW second-moment decay
    weight_decay: float = _knob(0.0, ge=0)
    grad_clip: float | None = _knob(1.0, gt=0)  # max global grad norm; null: no clipping
    micro_batch_size: int = _knob(64, ge=1)  # rows per forward/backward (gradient accumulation)
    ppo_epochs: int = _knob(1, ge=1)  # passes over each step's batch
    mini_batches: int = _knob(1, ge=1)  # optimizer steps per pass
    clip_ratio_low: float = _knob(0.2, ge=0, lt=1)
    clip_ratio_high: float = _knob(0.2, ge=0)
    dual_clip_c: float | None = _knob(None, gt=1)  # null: no dual clip
    loss_agg: AggMode = "token-mean"
    entropy_coef: float = _knob(0.0, ge=0)
    # ppo: clip (asymmetric with clip_ratio_high > low: DAPO's clip-higher); gspo: clip on the sequence ratio;
    # gmpo: geometric mean of token ratios, clip_ratio_* are log-ratio bounds; cispo: clipped IS weight, no grad cut
    policy_loss: PolicyLossKind = "ppo"
    rollout_is_cap: float | None = _knob(None, gt=0)  # truncated IS: weight min(pi_old/pi_rollout, cap); null: off


@dataclass(frozen=True)
class CriticConfig(_Section):
    """Value model optimization (PPO only). Every knob is the critic's own: nothing is taken from ``actor``."""

    _section = "critic"
    lr: float = _knob(1e-3, gt=0)
    warmup_steps: int = _knob(0, ge=0)  # linear warmup of the learning rate, in critic optimizer steps
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after warmup; cosine decays to min_lr_ratio x lr
    min_lr_ratio: float = _knob(0.0, ge=0, le=1)
    beta2: float = _knob(0.999, gt=0, lt=1)  # AdamW second-moment decay
    weight_decay: float = _knob(0.0, ge=0)
    grad_clip: float | None = _knob(1.0, gt=0)
    micro_batch_size: int = _knob(64, ge=1)
    ppo_epochs: int = _knob(1, ge=1)  # passes over each step's batch
    mini_batches: int = _knob(1, ge=1)  # critic optimizer steps per pass
    value_clip: float | None = _knob(0.2, gt=0)  # null: unclipped value loss
    loss_agg: AggMode = "token-mean"


@dataclass(frozen=True)
class AlgorithmConfig(_Section):
    """Advantage estimation and KL regularization."""

    _section = "algorithm"
    # the step: grpo = critic-free (adv_estimator picks), ppo = critic + GAE, dapo = the critic-free step after
    # DAPO's dynamic sampling (groups with all-equal rewards dropped, more prompts sampled until the batch is full)
    name: Literal["grpo", "ppo", "dapo"] = "grpo"
    # null: the step's own (grpo/dapo: grpo, ppo: gae); dr_grpo: no std division (pair with seq-mean-token-sum-norm);
    # rloo; reinforce_pp: discounted token return, batch-whitened; reinforce_pp_baseline: minus group mean, whitened;
    # remax: score minus the score of a greedy rollout of the same prompt (one more generate call per step)
    adv_estimator: AdvEstimator | None = None
    gamma: float = _knob(1.0, ge=0, le=1)  # PPO / GAE discount
    lam: float = _knob(1.0, ge=0, le=1)  # PPO / GAE lambda
    whiten_advantages: bool = True  # PPO: whiten GAE advantages over the batch
    norm_adv_by_std: bool = True  # GRPO: divide by the group std (false: Dr. GRPO style)
    adv_eps: float = _knob(1e-6, gt=0)  # GRPO: added to the group std
    kl_coef: float = _knob(0.0, ge=0)  # 0: no KL term and no reference model
    kl_reward_estimator: KLKind = "k1"  # KL in the reward (kl_in=reward): k1, whose policy gradient is the KL's
    kl_loss_estimator: KLKind = "k3"  # KL as a loss term (kl_in=loss): k3, >= 0 and low variance
    kl_in: Literal["loss", "reward"] = "loss"  # KL as a loss term (GRPO) or a reward penalty (PPO)
    # adaptive KL (Ziegler et al. 2019): move kl_coef toward this k1 KL per token each step; null: fixed kl_coef
    kl_target: float | None = _knob(None, gt=0)
    kl_horizon: int = _knob(10000, ge=1)  # in samples: how fast the adaptive coefficient moves
    # DAPO soft overlong penalty on the score: 0 up to max_new_tokens - buffer tokens, then down to -overlong_penalty
    overlong_buffer: int | None = _knob(None, ge=1)  # null: off; critic-free steps with a per-sequence estimator
    overlong_penalty: float = _knob(1.0, ge=0)
    # DAPO dynamic sampling (algorithm.name=dapo): extra sampling rounds a step may launch to replace dropped groups;
    # when they are used up the step trains on the groups it kept (metrics dynamic_sampling/*)
    dynamic_sampling_max_rounds: int = _knob(3, ge=0)


@dataclass(frozen=True)
class RunnerConfig(_Section):
    """The training loop: steps, overlap, streaming, checkpoints and outputs."""

    _section = "runner"
    seed: int = _knob(0, ge=0)  # model init and global torch RNG
    total_steps: int = _knob(200, ge=1)
    max_bad_steps: int = _knob(3, ge=1)  # stop after this many consecutive steps with a non-finite loss/grad norm
    max_staleness: int = _knob(0, ge=0, le=1)  # 1: step k+1's rollout overlaps step k's update
    micro_batches_per_step: int = _knob(1, ge=1)  # stream each step through the stages in parts
    checkpoint_every: int = _knob(0, ge=0)  # in steps; 0: no checkpoints
    keep_checkpoints: int = _knob(3, ge=0)  # newest checkpoints kept in output_dir/checkpoints; 0: all
    max_restarts: int = _knob(2, ge=0)  # a dead worker/node: restart from the last good checkpoint; 0: stop
    restart_timeout_s: float = _knob(300.0, gt=0)  # how long a restart waits for the cluster to fit the pools again
    output_dir: str = "outputs/run"
    metrics: bool = True  # metrics.jsonl in output_dir
    tensorboard: bool = False
    plot: bool = False  # PNG curves of the metrics at the end (needs matplotlib)
    trace: bool = False  # Perfetto / Chrome timeline trace of every stage


@dataclass(frozen=True)
class ResourcesConfig(_Section):
    """Worker pools and their placement."""

    _section = "resources"
    actor_workers: int = _knob(1, ge=1)  # the critic and reference model use the same count
    rollout_workers: int = _knob(1, ge=1)
    reward_workers: int = _knob(1, ge=1)
    placement: Literal["colocated", "split"] = "colocated"  # colocated: rollout shares actor processes
    device: Literal["cpu", "cuda"] = "cpu"


@dataclass(frozen=True)
class TaskConfig(_Section):
    """The task (prompts + reward), looked up by name; params go to its constructor."""

    _section = "task"
    name: str = "digits"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    """A whole training job; checks the constraints that span sections on construction."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    task: TaskConfig = field(default_factory=TaskConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            cls = _hints(Config)[f.name]
            if not isinstance(getattr(self, f.name), cls):
                raise ConfigError(f"{f.name}: expected a {cls.__name__}", f.name)
        self._check_cross_section()

    def _check_task(self) -> None:
        """``task.name`` is registered (``pipelines.tasks``) and ``task.params`` has only keys that task takes."""
        from .tasks import UnknownTaskError, check_task_params

        try:
            check_task_params(self.task.name, self.task.params)
        except UnknownTaskError as e:
            raise ConfigError(f"task.name: {e}", "task.name") from None
        except ValueError as e:
            raise ConfigError(f"task.params: {e}", "task.params") from None

    def _check_cross_section(self) -> None:
        """Constraints between fields; each error names the field to change."""
        alg = self.algorithm
        estimator = alg.adv_estimator or ("gae" if alg.name == "ppo" else "grpo")
        critic_free = alg.name in CRITIC_FREE_STEPS
        self._check_task()
        if alg.name == "ppo" and estimator != "gae":
            raise ConfigError(
                f"algorithm.adv_estimator: bad value {estimator!r}; PPO computes GAE advantages with its critic "
                "(adv_estimator=gae or null); the critic-free estimators run with algorithm.name=grpo",
                "algorithm.adv_estimator")
        if critic_free and estimator == "gae":
            raise ConfigError(
                "algorithm.adv_estimator: bad value 'gae'; GAE needs a critic: use algorithm.name=ppo",
                "algorithm.adv_estimator")
        if alg.name == "dapo" and estimator not in GROUP_ESTIMATORS:
            raise ConfigError(
                f"algorithm.adv_estimator: bad value {estimator!r}; DAPO's dynamic sampling keeps the prompt groups "
                f"whose rewards differ, so it takes a group estimator: one of {', '.join(GROUP_ESTIMATORS)} (or "
                "null: grpo)", "algorithm.adv_estimator")
        if critic_free and estimator in GROUP_ESTIMATORS and self.rollout.n < 2:
            raise ConfigError(
                f"rollout.n: bad value {self.rollout.n}; {alg.name.upper()} needs at least 2 responses per prompt "
                f"with algorithm.adv_estimator={estimator!r} (a group of one has no baseline)", "rollout.n")
        if critic_free and alg.kl_in == "reward" and estimator != "reinforce_pp":
            raise ConfigError(
                f"algorithm.kl_in: bad value 'reward'; GRPO with adv_estimator {estimator!r} takes the KL to the "
                "reference as a loss term (kl_in=loss); the KL-in-reward form needs algorithm.name=ppo or "
                "algorithm.adv_estimator=reinforce_pp", "algorithm.kl_in")
        if alg.kl_target is not None and alg.kl_coef <= 0:
            raise ConfigError(
                f"algorithm.kl_target: bad value {alg.kl_target}; the adaptive KL controller starts from "
                "algorithm.kl_coef, which is 0 (no KL term): set algorithm.kl_coef > 0", "algorithm.kl_target")
        if alg.overlong_buffer is not None:
            if not critic_free or estimator == "reinforce_pp":
                raise ConfigError(
                    "algorithm.overlong_buffer: the overlong penalty is applied to the per-sequence scores of the "
                    f"critic-free step; it is not wired for algorithm.name={alg.name!r} with adv_estimator "
                    f"{estimator!r} (set it to null)", "algorithm.overlong_buffer")
            if alg.overlong_buffer > self.rollout.max_new_tokens:
                raise ConfigError(
                    f"algorithm.overlong_buffer: bad value {alg.overlong_buffer}; must be <= rollout.max_new_tokens "
                    f"({self.rollout.max_new_tokens})", "algorithm.overlong_buffer")
        if self.actor.dual_clip_c is not None and self.actor.policy_loss != "ppo":
            raise ConfigError(
                f"actor.dual_clip_c: bad value {self.actor.dual_clip_c}; the dual clip is part of the PPO clip, "
                f"not of actor.policy_loss={self.actor.policy_loss!r} (set it to null)", "actor.dual_clip_c")
        if self.data.prompts_per_step % self.runner.micro_batches_per_step:
            raise ConfigError(
                f"runner.micro_batches_per_step: bad value {self.runner.micro_batches_per_step}; must "
                f"divide data.prompts_per_step ({self.data.prompts_per_step}) so that every micro-batch "
                "holds whole prompt groups", "runner.micro_batches_per_step")
        rows = self.data.prompts_per_step * self.rollout.n
        for name, section in (("actor", self.actor), ("critic", self.critic)):
            if section.mini_batches > rows and (name == "actor" or self.algorithm.name == "ppo"):
                raise ConfigError(
                    f"{name}.mini_batches: bad value {section.mini_batches}; a step has only {rows} rows "
                    "(data.prompts_per_step * rollout.n)", f"{name}.mini_batches")
        if self.model.path is None:
            if self.model.hidden_size % self.model.num_heads:
                raise ConfigError(
                    f"model.num_heads: bad value {self.model.num_heads}; must divide model.hidden_size "
                    f"({self.model.hidden_size})", "model.num_heads")
            if self.rollout.max_new_tokens >= self.model.max_seq_len:
                raise ConfigError(
                    f"rollout.max_new_tokens: bad value {self.rollout.max_new_tokens}; must be below "
                    f"model.max_seq_len ({self.model.max_seq_len}) to leave room for the prompt",
                    "rollout.max_new_tokens")
        if self.resources.placement == "colocated" and (
            self.resources.rollout_workers != self.resources.actor_workers
        ):
            raise ConfigError(
                f"resources.rollout_workers: bad value {self.resources.rollout_workers}; with placement "
                f"'colocated' rollout runs in the actor processes, so it must equal "
                f"resources.actor_workers ({self.resources.actor_workers})", "resources.rollout_workers")


def _sections() -> dict[str, type[_Section]]:
    """Section name -> section class, in declaration order."""
    return {f.name: _hints(Config)[f.name] for f in dataclasses.fields(Config)}


# Keys that were renamed or split: the error says what to write instead.
_RENAMED = {
    "algorithm.kl_estimator": "it was split in two: algorithm.kl_reward_estimator (the KL penalty in the reward, "
                              "default k1) and algorithm.kl_loss_estimator (the KL loss term, default k3); "
                              "see docs/algorithms.md",
}


def _unknown_key(section: str | None, key: str) -> ConfigError:
    """Error for an unknown key, suggesting a near miss in the section or the same key elsewhere."""
    sections = _sections()
    if f"{section}.{key}" in _RENAMED:
        path = f"{section}.{key}"
        return ConfigError(f"unknown key {path!r}: {_RENAMED[path]}", path)
    if section is None:
        hint = _suggest(key, list(sections))
        return ConfigError(f"unknown section {key!r}{hint}; sections: {', '.join(sections)}", key)
    names = [f.name for f in dataclasses.fields(sections[section])]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f" (did you mean {section + '.' + close[0]!r}?)" if close else ""
    if not hint:
        elsewhere = [s for s, cls in sections.items() if key in _hints(cls)]
        hint = f" (did you mean {elsewhere[0] + '.' + key!r}?)" if elsewhere else ""
    path = f"{section}.{key}"
    return ConfigError(f"unknown key {path!r}{hint}; keys in {section!r}: {', '.join(names)}", path)


def config_from_dict(data: Mapping[str, Any] | None) -> Config:
    """Build and validate a :class:`Config` from nested plain data (missing keys take defaults)."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {type(data).__name__}")
    sections = _sections()
    for key in data:
        if key not in sections:
            raise _unknown_key(None, str(key))
    built = {}
    for name, cls in sections.items():
        values = data.get(name)
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise ConfigError(f"{name}: expected a mapping of keys, got {values!r}", name)
        names = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in names:
                raise _unknown_key(name, str(key))
        built[name] = cls(**values)
    return Config(**built)


def _parse_override(text: str, raw: dict[str, Any]) -> str:
    """Apply one ``section.key=value`` (or ``section.mapping.key=value``) to ``raw``; returns the key.

    The value is parsed with YAML scalar rules, except that a ``str`` field keeps the text as is.
    """
    key, sep, value_text = text.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError("bad override: expected section.key=value")
    section, name = parts[0], parts[1]
    sections = _sections()
    if section not in sections:
        raise _unknown_key(None, section)
    if name not in _hints(sections[section]):
        raise _unknown_key(section, name)
    tp = _hints(sections[section])[name]
    if len(parts) > 2 and get_origin(tp) is not dict:
        path = f"{section}.{name}"
        raise ConfigError(f"{path}: has type {_describe(tp)}, not a mapping", path)
    try:
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{key}: cannot parse {value_text!r} as YAML ({problem})", key) from None
    takes_str = tp is str or (_is_union(tp) and str in get_args(tp))
    if takes_str and value is not None and not isinstance(value, str):
        value = value_text.strip()
    target = raw
    for i, part in enumerate(parts[:-1]):
        if target.get(part) is None:
            target[part] = {}
        target = target[part]
        if not isinstance(target, dict):
            sub = ".".join(parts[: i + 1])
            raise ConfigError(f"{sub}: is {target!r}, not a mapping, so {key} cannot be set", sub)
    target[parts[-1]] = value
    return key.strip()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config (or start from defaults when ``path`` is None), apply overrides, validate.

    Errors raise :class:`ConfigError` naming the key path, the bad value, the allowed type or
    choices, and where the value came from (the file or the override).
    """
    raw: Any = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    origins: dict[str, str] = {}
    for text in overrides:
        try:
            origins[_parse_override(text, raw)] = f"from override {text!r}"
        except ConfigError as e:
            raise ConfigError(f"{e} [from override {text!r}]", e.path) from None
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        origin = next((o for p, o in reversed(origins.items())
                       if e.path and (p == e.path or p.startswith(e.path + "."))), None)
        if origin is None and path is not None:
            origin = f"in {path}"
        if origin is None:
            raise
        raise ConfigError(f"{e} [{origin}]", e.path) from None


def config_to_dict(config: Config) -> dict[str, Any]:
    """Nested plain dict of ``config`` (YAML/JSON-safe), for saving alongside checkpoints."""
    return dataclasses.asdict(config)
