"""Typed training-job configuration: nested frozen pydantic models, YAML, ``section.key=value`` overrides.

``load_config("job.yaml", ["actor.lr=1e-3", "rollout.n=4"])`` reads the file, applies the
overrides and validates everything; any unknown key or bad value raises :class:`ConfigError`
naming the key path, the value and what is allowed.  Constructing the models directly runs
the same checks (pydantic does the type and range checks; its errors are reworded here).
Defaults describe a tiny CPU run of the GRPO digit task (``examples/grpo_single_process.py``);
``orchestra train --help-config`` lists every key with its type, default and description.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, InstanceOf, ValidationError, model_validator
from pydantic.fields import FieldInfo

# Kept in sync with pipelines.algorithms (tested); not imported so that reading a config needs no torch.
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "abs"]
PolicyLossKind = Literal["ppo", "gspo", "gmpo", "cispo"]
# critic-free estimators run by algorithm.name=grpo (dapo: the group ones); "gae" is PPO's (with the critic)
AdvEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae"]
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # need >= 2 responses per prompt
CRITIC_FREE_STEPS = ("grpo", "dapo")  # the steps that take adv_estimator's critic-free estimators
# how each critic-free estimator scales its advantages (pipelines/grpo.py): none reads algorithm.whiten_advantages
_ESTIMATOR_SCALING = {
    "grpo": "GRPO normalizes each prompt's group by definition (minus the group mean, divided by the group std: "
            "algorithm.norm_adv_by_std=false drops the division)",
    "dr_grpo": "Dr. GRPO normalizes each prompt's group by definition (minus the group mean, no std) and never "
               "whitens",
    "rloo": "RLOO normalizes each prompt's group by definition (minus the mean of the group's other responses) and "
            "never whitens",
    "reinforce_pp": "REINFORCE++ whitens its advantages over the batch by definition",
    "reinforce_pp_baseline": "REINFORCE++-baseline subtracts the group mean and whitens over the batch by definition",
    "remax": "ReMax subtracts the greedy response's score and never whitens",
}
# what to write instead of no value (YAML's ~ / null) for the str keys that take no null
_NO_VALUE_FIX = {"runner.output_dir": "give a directory path (e.g. outputs/run; ~/runs/x is under your home)"}

log = logging.getLogger("orchestra")


def _override_text(value: Any) -> str:
    """``value`` as an override writes it (``null``, ``false``, ``0.95``, ``loss``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


class ConfigError(ValueError):
    """A bad configuration; ``path`` is the offending key path (e.g. ``"actor.lr"``), if any."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


def _yaml_number(value: Any) -> Any:
    """A numeric string as a float (YAML 1.1 reads ``1e-3``, without a dot, as a string); anything else as is."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


# A finite float (.inf / .nan would train to NaN and "finish"); ints are widened, bools refused (strict mode).
Float = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_yaml_number)]
Params = Annotated[dict[str, Any], BeforeValidator(lambda v: dict(v) if isinstance(v, Mapping) else v)]
_BOUNDS = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"))
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None`` (``Annotated`` stripped from X), else ``(tp, False)``."""
    if get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
        (base,) = [a for a in get_args(tp) if a is not type(None)]
        return (get_args(base)[0] if get_origin(base) is Annotated else base), True
    return tp, False


def _describe(tp: Any) -> str:
    """Human-readable name of an annotated type, for messages and ``--help-config``."""
    if get_origin(tp) is Annotated:
        return _describe(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is dict:
        return "mapping"
    return tp.__name__


def _describe_field(info: FieldInfo) -> str:
    """The field's type with its bounds, e.g. ``float > 0 and <= 1 (or null)``."""
    bounds = " and ".join(f"{op} {getattr(m, attr)}" for kind, attr, op in _BOUNDS
                          for m in info.metadata if isinstance(m, kind))
    if not bounds:
        return _describe(info.annotation)
    base, optional = _optional(info.annotation)
    return f"{_describe(base)} {bounds}" + (" (or null)" if optional else "")


def _suggest(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for a near miss among ``candidates``, else an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _config_error(error: ValidationError, cls: type[_Model], data: Mapping[str, Any]) -> ConfigError:
    """Pydantic's first error (an unknown key first) as a :class:`ConfigError`: key path, bad value, what is allowed."""
    errors = error.errors()
    e = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    if isinstance(e.get("ctx", {}).get("error"), ConfigError):  # raised by a check of ours (Config's cross-section)
        return e["ctx"]["error"]
    name = str(e["loc"][0])
    if e["type"] == "extra_forbidden":
        return _unknown_key(cls._section or None, name)
    path, info, value = f"{cls._section}.{name}".lstrip("."), cls.model_fields[name], data[name]
    base, _ = _optional(info.annotation)
    if e["type"] in _BOUND_ERRORS:
        shown = float(value) if base is float else value  # as validated: an int widened, a string parsed
        return ConfigError(f"{path}: bad value {shown!r}; expected {_describe_field(info)}", path)
    if e["type"] == "is_instance_of":  # a Config field given something other than its section
        return ConfigError(f"{path}: expected a {base.__name__}", path)
    if value is None and base is str:  # YAML's ~ / null (in a file or an override): no value
        fix = _NO_VALUE_FIX.get(path, "give its text (quoted, 'null' is the text null)")
        return ConfigError(f"{path}: bad value None; YAML reads ~ and null as no value (an empty value too), and "
                           f"{path} takes a string: {fix}", path)
    if e["type"] == "finite_number":
        expected = "a finite float"
    else:
        expected = {bool: "bool (true/false)", dict: "mapping with string keys"}.get(
            get_origin(base) or base, _describe(info.annotation))
    choices = [str(c) for c in get_args(base)] if get_origin(base) is Literal else []
    hint = _suggest(value, choices) if isinstance(value, str) and choices else ""
    plain = get_args(base)[0] if get_origin(base) is Annotated else base
    if isinstance(value, str) and plain in (int, float) and _YAML11_NUMBER.match(value.strip()):
        hint = (" (a number with a leading zero, like 0100, or with a colon, like 1:00, is not read as a number: "
                "YAML 1.1 would make it octal 64 or base-60 60; write it in decimal without leading zeros)")
    return ConfigError(f"{path}: bad value {value!r} ({type(value).__name__}); expected {expected}{hint}", path)


class _Model(BaseModel):
    """Base of the config models: frozen, strict, unknown keys refused; errors raise :class:`ConfigError`."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    _section: ClassVar[str] = ""  # the section's key in Config (a class attribute, not a field)
    __str__ = BaseModel.__repr__  # ModelConfig(path=None, ...), as the dataclasses printed

    def __init__(self, /, **data: Any) -> None:
        """Validates ``data``; pydantic's errors are raised as :class:`ConfigError`."""
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _config_error(e, type(self), data) from None


class ModelConfig(_Model):
    """The policy (and critic / reference) model."""

    _section = "model"
    path: str | None = Field(None, description="Local Hugging Face model directory (config.json + weights) that the "
                             "actor, reference, rollout and critic load; its vocabulary must cover the task's "
                             "tokenizer. null: a tiny random Qwen2 from the knobs below (which a path replaces)")
    vocab_size: int | None = Field(None, ge=1, description="Vocabulary of the tiny model; null: the task tokenizer's")
    hidden_size: int = Field(64, ge=1, description="Hidden width of the tiny model (a multiple of 2 x num_heads: "
                             "its rotary embedding needs an even head size)")
    num_layers: int = Field(2, ge=1, description="Decoder layers of the tiny model")
    num_heads: int = Field(4, ge=1, description="Attention heads of the tiny model (must divide hidden_size)")
    num_kv_heads: int | None = Field(None, ge=1, description="Key/value heads (grouped-query: must divide num_heads); "
                                     "null: num_heads // 2")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width of the tiny model; null: 2 x hidden_size")
    tie_embeddings: bool = Field(False, description="Share the input embedding and the output projection weights")
    max_seq_len: int = Field(64, ge=2, description="Positions of the tiny model: prompt + response tokens")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weight dtype; only float32: the "
                                                             "engines train float32 master weights (bf16 mixed "
                                                             "precision on CUDA comes with resources.device=cuda)")


class DataConfig(_Model):
    """Where prompts come from and how many each step takes."""

    _section = "data"
    train_path: str | None = Field(None, description=".jsonl / .parquet of prompts (with answers); null: the task "
                                   "generates them")
    prompt_key: str = Field("prompt", description="Column of train_path that holds the prompt (only with train_path)")
    prompts_per_step: int = Field(32, ge=1, description="Prompts per training step (each sampled rollout.n times)")
    shuffle: bool = Field(True, description="Shuffle the prompt order every epoch (each drops another remainder past "
                          "the last full batch); false: file order, wrapping around so every record is trained on")
    seed: int = Field(0, ge=0, description="Seed of the shuffled prompt order (read with shuffle=true only)")


class RolloutConfig(_Model):
    """Sampling of responses."""

    _section = "rollout"
    n: int = Field(8, ge=1, description="Responses per prompt (the GRPO group size; group estimators need >= 2)")
    temperature: Float = Field(1.0, gt=0, description="Sampling temperature (1: the model's own distribution)")
    top_p: Float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the top tokens with this much mass (1: off)")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0: no top-k filtering)")
    max_new_tokens: int = Field(3, ge=1, description="Response length budget, in tokens (below model.max_seq_len)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the sampling (32 bits, as runner.seed)")


_SCHEDULE = ("After warmup: constant, or cosine decay toward min_lr_ratio x lr, reached one step after the last "
             "optimizer step of the run (the last step runs slightly above it)")


class ActorConfig(_Model):
    """Policy optimization (the critic has its own section)."""

    _section = "actor"
    lr: Float = Field(2e-3, gt=0, description="Peak learning rate of the policy's AdamW optimizer")
    warmup_steps: int = Field(5, ge=0, description="Linear warmup of the learning rate, in optimizer steps")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description=_SCHEDULE)
    min_lr_ratio: Float = Field(0.0, ge=0, le=1, description="Where the cosine schedule ends, as a fraction of lr")
    beta2: Float = Field(0.999, gt=0, lt=1, description="AdamW second-moment decay (beta1 is 0.9)")
    weight_decay: Float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    grad_clip: Float | None = Field(1.0, gt=0, description="Max global gradient norm; null: no clipping")
    micro_batch_size: int = Field(64, ge=1, description="Rows per forward/backward (gradient accumulation)")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass")
    clip_ratio_low: Float = Field(0.2, ge=0, lt=1, description="The ratio may fall to 1 - this (gmpo: log-ratio bound)")
    clip_ratio_high: Float = Field(0.2, ge=0, description="The ratio may rise to 1 + this (> low: DAPO's clip-higher)")
    dual_clip_c: Float | None = Field(None, gt=1, description="PPO dual clip: loss <= -A x c for A < 0; null: off")
    loss_agg: AggMode = Field("token-mean", description="Loss aggregation over tokens and sequences (docs/algorithms)")
    entropy_coef: Float = Field(0.0, ge=0, description="Entropy bonus: entropy_coef x entropy is subtracted")
    policy_loss: PolicyLossKind = Field("ppo", description="ppo: clip; gspo: clip on the sequence ratio; gmpo: "
                                        "geometric mean of token ratios; cispo: clipped IS weight, no gradient cut")
    rollout_is_cap: Float | None = Field(None, gt=0, description="Truncated IS: weight min(pi_old/pi_rollout, cap); "
                                         "null: off")


class CriticConfig(_Model):
    """Value model optimization (PPO only). Every knob is the critic's own: nothing is taken from ``actor``."""

    _section = "critic"
    lr: Float = Field(1e-3, gt=0, description="Peak learning rate of the critic's AdamW optimizer")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup of the learning rate, in critic optimizer steps")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description=_SCHEDULE)
    min_lr_ratio: Float = Field(0.0, ge=0, le=1, description="Where the cosine schedule ends, as a fraction of lr")
    beta2: Float = Field(0.999, gt=0, lt=1, description="AdamW second-moment decay (beta1 is 0.9)")
    weight_decay: Float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    grad_clip: Float | None = Field(1.0, gt=0, description="Max global gradient norm; null: no clipping")
    micro_batch_size: int = Field(64, ge=1, description="Rows per forward/backward (gradient accumulation)")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch")
    mini_batches: int = Field(1, ge=1, description="Critic optimizer steps per pass")
    value_clip: Float | None = Field(0.2, gt=0, description="Values move at most this far from the old ones in the "
                                     "loss; null: unclipped")
    loss_agg: AggMode = Field("token-mean", description="Value loss aggregation (as actor.loss_agg)")


class AlgorithmConfig(_Model):
    """Advantage estimation and KL regularization."""

    _section = "algorithm"
    name: Literal["grpo", "ppo", "dapo"] = Field("grpo", description="The step: grpo (critic-free), ppo (critic + "
                                                 "GAE), dapo (grpo after DAPO's dynamic sampling)")
    adv_estimator: AdvEstimator | None = Field(None, description="Advantage estimator; null: the step's own (grpo/"
                                               "dapo: grpo, ppo: gae)")
    gamma: Float = Field(1.0, ge=0, le=1, description="Discount of GAE (PPO) and REINFORCE++ returns")
    lam: Float = Field(1.0, ge=0, le=1, description="GAE lambda (PPO)")
    whiten_advantages: bool = Field(True, description="PPO: whiten the GAE advantages over the batch (the "
                                    "critic-free estimators scale their own way: false is refused there)")
    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group std (false: Dr. GRPO style)")
    adv_eps: Float = Field(1e-6, gt=0, description="GRPO: added to the group std")
    kl_coef: Float = Field(0.0, ge=0, description="Weight of the KL to the reference; 0: no KL term, no reference")
    kl_reward_estimator: KLKind = Field("k1", description="KL in the reward (kl_in=reward): k1, its gradient the KL's")
    kl_loss_estimator: KLKind = Field("k3", description="KL as a loss term (kl_in=loss): k3, >= 0 and low variance")
    kl_in: Literal["loss", "reward"] = Field("loss", description="KL as a loss term (GRPO) or a reward penalty (PPO)")
    kl_target: Float | None = Field(None, gt=0, description="Adaptive KL: move kl_coef toward this k1 KL per token; "
                                    "null: fixed kl_coef")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL (with kl_target): how fast the coefficient "
                            "moves, in samples (> 0.2 x prompts_per_step x rollout.n)")
    overlong_buffer: int | None = Field(None, ge=1, description="DAPO overlong penalty on the last this-many tokens "
                                        "of rollout.max_new_tokens; null: off")
    overlong_penalty: Float = Field(1.0, ge=0, description="Score penalty at rollout.max_new_tokens (linear from 0); "
                                   "needs overlong_buffer")
    dynamic_sampling_max_rounds: int = Field(3, ge=0, description="DAPO: extra sampling rounds to replace dropped "
                                             "groups")


class RunnerConfig(_Model):
    """The training loop: steps, overlap, streaming, checkpoints and outputs."""

    _section = "runner"
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of model init and the global torch RNG (32 bits: "
                      "numpy's global seed takes 32)")
    total_steps: int = Field(200, ge=1, description="Training steps of the run")
    max_bad_steps: int = Field(3, ge=1, description="Stop after this many consecutive non-finite loss/grad-norm steps "
                               "(the count is checkpointed: a resume or restart continues it)")
    max_staleness: int = Field(0, ge=0, le=1, description="1: step k+1's rollout overlaps step k's update")
    micro_batches_per_step: int = Field(1, ge=1, description="Stream each step through the stages in parts")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint interval, in steps (the last step is "
                                  "always checkpointed too); 0: no checkpoints")
    keep_checkpoints: int = Field(3, ge=0, description="Newest checkpoints kept in output_dir/checkpoints; 0: all "
                                  "(with checkpoint_every > 0)")
    max_restarts: int = Field(2, ge=0, description="Restarts from the last good checkpoint on a lost worker; 0: stop")
    restart_timeout_s: Float = Field(300.0, gt=0, description="Seconds a restart waits for the pools to fit again "
                                     "(with max_restarts > 0)")
    output_dir: str = Field("outputs/run", description="Directory of metrics, checkpoints, config.json and traces")
    metrics: bool = Field(True, description="Write metrics.jsonl in output_dir")
    tensorboard: bool = Field(False, description="Also write TensorBoard events to output_dir/tensorboard "
                              "(needs the tensorboard package: pip install tensorboard)")
    plot: bool = Field(False, description="reward.png: curves of metrics.jsonl at the end (needs matplotlib and "
                       "runner.metrics=true)")
    trace: bool = Field(False, description="Perfetto / Chrome timeline trace of every stage")


class ResourcesConfig(_Model):
    """Worker pools and their placement."""

    _section = "resources"
    actor_workers: int = Field(1, ge=1, description="Actor processes (DP ranks); also the critic's and the reference's")
    rollout_workers: int = Field(1, ge=1, description="Rollout processes (= actor_workers when colocated)")
    reward_workers: int = Field(1, ge=1, description="Reward (and advantage) processes")
    placement: Literal["colocated", "split"] = Field("colocated", description="colocated: rollout shares actor "
                                                     "processes; split: a pool of its own")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu (gloo) or cuda (NCCL, one GPU per actor worker)")
    backend: Literal["ray", "local"] = Field("ray", description="ray: a process per worker; local: every worker in "
                                             "this process (tests, debugging; one worker per pool)")


class TaskConfig(_Model):
    """The task (prompts + reward), looked up by name; params go to its constructor."""

    _section = "task"
    name: str = Field("digits", description="Registered task (pipelines/tasks) that makes the prompts and the reward")
    params: Params = Field(default_factory=dict, description="Arguments of the task's builder (keys it takes only)")


def _holds(cls: type[_Model]) -> Any:
    """A Config field holding section ``cls`` (an instance of it: a dict is not converted)."""
    return Field(default_factory=cls, description=cls.__doc__)


class Config(_Model):
    """A whole training job; checks the constraints that span sections on construction."""

    model: InstanceOf[ModelConfig] = _holds(ModelConfig)
    data: InstanceOf[DataConfig] = _holds(DataConfig)
    rollout: InstanceOf[RolloutConfig] = _holds(RolloutConfig)
    actor: InstanceOf[ActorConfig] = _holds(ActorConfig)
    critic: InstanceOf[CriticConfig] = _holds(CriticConfig)
    algorithm: InstanceOf[AlgorithmConfig] = _holds(AlgorithmConfig)
    runner: InstanceOf[RunnerConfig] = _holds(RunnerConfig)
    resources: InstanceOf[ResourcesConfig] = _holds(ResourcesConfig)
    task: InstanceOf[TaskConfig] = _holds(TaskConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        """Runs the cross-section checks once every section is valid."""
        self._check_cross_section()
        return self

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
        res = self.resources
        if res.backend == "local":  # FSDP ranks need a process each (torch.distributed)
            for key in ("actor_workers", "rollout_workers"):
                if getattr(res, key) != 1:
                    raise ConfigError(f"resources.{key}: bad value {getattr(res, key)!r}; resources.backend=local runs "
                                      f"every worker in this process, where an FSDP engine cannot span ranks: use 1 "
                                      f"(or resources.backend=ray)", f"resources.{key}")
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
        samples = self.data.prompts_per_step * self.rollout.n
        if alg.kl_target is not None and 5 * alg.kl_horizon <= samples:
            # pipelines.algorithms.min_kl_horizon: the controller's factor 1 + clip(err, +-0.2) x samples / horizon
            raise ConfigError(
                f"algorithm.kl_horizon: bad value {alg.kl_horizon}; the adaptive KL controller scales kl_coef by "
                f"1 + clip(KL/target - 1, -0.2, 0.2) x samples/kl_horizon after each step, which can reach 0 or "
                f"below (a negative KL coefficient) with {samples} samples a step (data.prompts_per_step "
                f"{self.data.prompts_per_step} x rollout.n {self.rollout.n}): kl_horizon must be > 0.2 x {samples} "
                f"= {samples / 5:g}, i.e. at least {samples // 5 + 1}", "algorithm.kl_horizon")
        if "warm_start_steps" in self.task.params:  # early, torch-free; get_task checks the built task again
            from .tasks import whole_number

            try:
                warm = whole_number(self.task.params, "warm_start_steps", 0)
            except ValueError as e:
                raise ConfigError(f"task.params: {e}", "task.params.warm_start_steps") from None
            if warm > 0 and alg.kl_coef > 0:
                raise ConfigError(warm_start_with_kl(warm, alg.kl_coef), "task.params.warm_start_steps")
        default_penalty = AlgorithmConfig.model_fields["overlong_penalty"].default
        if alg.overlong_buffer is None and alg.overlong_penalty != default_penalty:  # (a saved config holds the default)
            raise ConfigError(
                f"algorithm.overlong_penalty: set to {alg.overlong_penalty:g}, but algorithm.overlong_buffer is null, "
                "so no overlong penalty is applied: set algorithm.overlong_buffer (the last this-many tokens of "
                "rollout.max_new_tokens are penalized) or remove algorithm.overlong_penalty",
                "algorithm.overlong_penalty")
        default_key = DataConfig.model_fields["prompt_key"].default
        if self.data.train_path is None and self.data.prompt_key != default_key:  # (a saved config holds the default)
            raise ConfigError(
                f"data.prompt_key: set to {self.data.prompt_key!r}, but data.train_path is null, so the task generates "
                f"its prompts and no column is read: set data.train_path to the .jsonl/.parquet file whose "
                f"{self.data.prompt_key!r} column holds the prompts, or remove data.prompt_key", "data.prompt_key")
        self._check_unread(estimator)
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
        for path, value in (("runner.output_dir", self.runner.output_dir), ("model.path", self.model.path),
                            ("data.train_path", self.data.train_path)):
            if value is not None and not value.strip():
                raise ConfigError(f"{path}: bad value {value!r}; an empty path would mean the working directory: "
                                  f"give a path" + (" (or null)" if path != "runner.output_dir" else ""), path)
        self._check_model()
        if self.runner.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("runner.tensorboard: true, but the tensorboard package is not installed "
                              "(torch.utils.tensorboard writes its events with it): pip install tensorboard, or set "
                              "runner.tensorboard=false", "runner.tensorboard")
        if self.runner.plot and importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("runner.plot: true, but the matplotlib package is not installed (reward.png is drawn "
                              "with it): pip install matplotlib, or set runner.plot=false", "runner.plot")
        if self.data.train_path is not None:
            train = Path(self.data.train_path).expanduser()
            if not train.exists():
                raise ConfigError(f"data.train_path: {train.absolute()} does not exist; set it to a .jsonl or .parquet "
                                  "file of prompts with answers, or null for the task's own prompts", "data.train_path")
            if not train.is_file():
                raise ConfigError(f"data.train_path: {train.absolute()} is not a file; set it to a .jsonl or .parquet "
                                  "file of prompts with answers", "data.train_path")
        if self.model.path is None:
            _check_heads(self.model)
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
        self._check_warmup()

    def _check_unread(self, estimator: str) -> None:
        """Refuse a non-default value of a setting this configuration never reads (the run would behave as if it
        were not given), naming why and what would make it count. Compared with the field's default, so a saved
        config (which holds every default) loads."""
        alg, critic_free = self.algorithm, self.algorithm.name in CRITIC_FREE_STEPS

        def unread(section: _Model, name: str) -> bool:
            return getattr(section, name) != type(section).model_fields[name].default

        def refuse(section: _Model, name: str, why: str) -> ConfigError:
            path = f"{section._section}.{name}"
            default = type(section).model_fields[name].default
            return ConfigError(f"{path}: set to {_shown(getattr(section, name))}, but {why} (to remove one the config "
                               f"file sets, give its default as an override: {path}={_override_text(default)})", path)

        step = f"algorithm.name={alg.name}"
        if critic_free:
            if unread(alg, "whiten_advantages"):
                raise refuse(alg, "whiten_advantages", "only PPO reads it (it whitens the GAE advantages over the "
                             f"batch); with {step} and adv_estimator {estimator!r} it is never read: "
                             f"{_ESTIMATOR_SCALING[estimator]}: remove algorithm.whiten_advantages (or use "
                             "algorithm.name=ppo)")
            for name in CriticConfig.model_fields:
                if unread(self.critic, name):
                    raise refuse(self.critic, name, f"{step} has no critic (only PPO trains one), so no critic "
                                 f"setting is read: remove critic.{name} (or use algorithm.name=ppo)")
            if unread(alg, "lam"):
                raise refuse(alg, "lam", f"only PPO's GAE reads it ({step} has no critic and no GAE): remove "
                             "algorithm.lam (or use algorithm.name=ppo)")
            if estimator != "reinforce_pp" and unread(alg, "gamma"):
                raise refuse(alg, "gamma", "it discounts only the token returns of GAE (algorithm.name=ppo) and of "
                             f"REINFORCE++ (adv_estimator=reinforce_pp); adv_estimator {estimator!r} takes each "
                             "response's whole score, with no discount: remove algorithm.gamma (or use "
                             "adv_estimator=reinforce_pp)")
        if (not critic_free or estimator != "grpo") and unread(alg, "norm_adv_by_std"):
            why = ("PPO whitens its GAE advantages over the batch instead (algorithm.whiten_advantages)"
                   if not critic_free else f"with adv_estimator {estimator!r} it is never read: "
                   f"{_ESTIMATOR_SCALING[estimator]}")
            raise refuse(alg, "norm_adv_by_std", "only the GRPO estimator (adv_estimator=grpo, algorithm.name=grpo "
                         f"or dapo) reads it; {why}: remove algorithm.norm_adv_by_std"
                         + (" (adv_estimator=grpo with norm_adv_by_std=false is Dr. GRPO's advantage)"
                            if estimator == "dr_grpo" else ""))
        if not (critic_free and estimator == "grpo" and alg.norm_adv_by_std) and unread(alg, "adv_eps"):
            why = ("PPO has no groups" if not critic_free else f"adv_estimator {estimator!r} divides by no group std"
                   if estimator != "grpo" else "algorithm.norm_adv_by_std=false divides by no std")
            raise refuse(alg, "adv_eps", "it is added only to the group std that adv_estimator=grpo divides by (with "
                         f"algorithm.norm_adv_by_std=true), and {why}: remove algorithm.adv_eps")
        if alg.name != "dapo" and unread(alg, "dynamic_sampling_max_rounds"):
            raise refuse(alg, "dynamic_sampling_max_rounds", f"only DAPO's dynamic sampling reads it ({step} samples "
                         "each step's prompts once): remove algorithm.dynamic_sampling_max_rounds (or use "
                         "algorithm.name=dapo)")
        # the KL: kl_in picks where it goes (when kl_coef > 0), each place its estimator; kl_horizon: kl_target's
        no_kl = "algorithm.kl_coef is 0 (no KL term)"
        if alg.kl_coef == 0 and unread(alg, "kl_in"):
            raise refuse(alg, "kl_in", f"{no_kl}, so no KL goes into the reward: set algorithm.kl_coef > 0, or "
                         "remove algorithm.kl_in")
        for name, place, other in (("kl_reward_estimator", "reward", "loss"), ("kl_loss_estimator", "loss", "reward")):
            if not (alg.kl_coef > 0 and alg.kl_in == place) and unread(alg, name):
                why = no_kl if alg.kl_coef == 0 else (
                    f"algorithm.kl_in={other}: the KL is a {'loss term' if other == 'loss' else 'reward penalty'}, "
                    f"estimated with algorithm.kl_{other}_estimator")
                raise refuse(alg, name, f"it estimates the KL {'in the reward' if place == 'reward' else 'loss term'} "
                             f"only (algorithm.kl_in={place}, kl_coef > 0), and {why}: remove algorithm.{name}")
        if alg.kl_target is None and unread(alg, "kl_horizon"):
            raise refuse(alg, "kl_horizon", "algorithm.kl_target is null, so the KL coefficient is fixed "
                         "(algorithm.kl_coef) and no adaptive controller moves it: set algorithm.kl_target (with "
                         "kl_coef > 0), or remove algorithm.kl_horizon")
        for section in (self.actor, self.critic):
            name = section._section
            if section.lr_schedule == "constant" and unread(section, "min_lr_ratio"):
                raise refuse(section, "min_lr_ratio", f"{name}.lr_schedule is constant, so the learning rate never "
                             f"decays toward it: set {name}.lr_schedule=cosine, or remove {name}.min_lr_ratio")
        if not self.data.shuffle and unread(self.data, "seed"):
            raise refuse(self.data, "seed", "data.shuffle=false takes the prompts in file order, so no seed is "
                         "read: set data.shuffle=true, or remove data.seed")
        r = self.runner
        if r.max_restarts == 0 and unread(r, "restart_timeout_s"):
            raise refuse(r, "restart_timeout_s", "runner.max_restarts is 0, so the run never restarts and never "
                         "waits for the pools to fit again: set runner.max_restarts > 0, or remove "
                         "runner.restart_timeout_s")
        if r.checkpoint_every == 0 and unread(r, "keep_checkpoints"):
            raise refuse(r, "keep_checkpoints", "runner.checkpoint_every is 0, so no checkpoint is written (not even "
                         "the last step's) and none is pruned: set runner.checkpoint_every > 0, or remove "
                         "runner.keep_checkpoints")
        if not r.metrics and r.plot:
            raise refuse(r, "plot", "runner.metrics=false writes no metrics.jsonl, so reward.png has nothing to be "
                         "drawn from: set runner.metrics=true, or remove runner.plot")

    def _check_warmup(self) -> None:
        """A linear warmup as long as the run (the actor's; the critic's with PPO) never lets the learning rate
        settle at ``lr`` and never starts a cosine decay: a WARNING naming the numbers and the fix. Not refused: the
        warmup acts as set (a smoke run of an example file for a few steps is a run one means), only cut short."""
        sections = (self.actor, self.critic) if self.algorithm.name == "ppo" else (self.actor,)
        for section in sections:
            name, w = section._section, section.warmup_steps
            total = optimizer_steps(self, section)
            if w == 0 or w < total:
                continue
            steps = (f"{total} optimizer steps (runner.total_steps {self.runner.total_steps} x {name}.ppo_epochs "
                     f"{section.ppo_epochs} x {name}.mini_batches {section.mini_batches})")
            reach = (f"reaches {name}.lr only on the last one" if w == total
                     else f"never reaches {name}.lr (the last step runs at {total / w:.0%} of it)")
            cosine = (f", and {name}.lr_schedule=cosine never starts its decay (nor reaches {name}.min_lr_ratio)"
                      if section.lr_schedule == "cosine" else "")
            log.warning("%s.warmup_steps: the warmup of %d optimizer steps is as long as the run's %s, so the learning "
                        "rate %s%s; set %s.warmup_steps below %d (0: no warmup) to train at %s.lr", name, w, steps,
                        reach, cosine, name, total, name)


    def _check_model(self) -> None:
        """``model.dtype`` is one the engines train in; with ``model.path``: a Hugging Face model directory, no
        tiny-model knob set next to it, and ``rollout.max_new_tokens`` below its positions."""
        m = self.model
        if m.dtype != "float32":
            raise ConfigError(
                f"model.dtype: bad value {m.dtype!r}; the engines train float32 master weights (bf16 mixed precision "
                "on CUDA comes with resources.device=cuda, and the rollout copy follows it): use float32 or remove "
                "model.dtype", "model.dtype")
        if m.path is None:
            return
        for name in _TINY_MODEL_KNOBS:
            info = ModelConfig.model_fields[name]
            if getattr(m, name) != info.get_default(call_default_factory=True):
                raise ConfigError(
                    f"model.{name}: bad value {getattr(m, name)!r}; it is a knob of the tiny random model, and "
                    f"model.path ({m.path}) loads a model whose config.json decides it: remove model.{name} (or set "
                    f"model.path to null)", f"model.{name}")
        positions = model_positions(read_model_config(m.path))
        if self.rollout.max_new_tokens >= positions:
            raise ConfigError(
                f"rollout.max_new_tokens: bad value {self.rollout.max_new_tokens}; must be below the "
                f"max_position_embeddings ({positions}) of model.path's config.json ({m.path}) to leave room for the "
                "prompt", "rollout.max_new_tokens")


# the ModelConfig fields that describe the tiny random model: a model.path's config.json decides them instead
_TINY_MODEL_KNOBS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "tie_embeddings", "max_seq_len")
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _shown(value: Any) -> str:
    """A setting's value as it is written in a config: ``null``, ``true``/``false``, ``0.05``, ``'cosine'``."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return f"{value:g}" if isinstance(value, float) else repr(value)


def optimizer_steps(cfg: Config, section: ActorConfig | CriticConfig) -> int:
    """Optimizer steps of the whole run for the actor or the critic (the end of its LR schedule): ``runner.total_steps
    x ppo_epochs x mini_batches``. Here, torch-free, for the config's checks; ``pipelines.cluster`` hands it to the
    engines."""
    return cfg.runner.total_steps * section.ppo_epochs * section.mini_batches


def kv_heads(m: ModelConfig) -> int:
    """The tiny model's key/value heads: ``model.num_kv_heads``, or ``num_heads // 2`` (at least 1) when null."""
    return m.num_kv_heads or max(1, m.num_heads // 2)


def _check_heads(m: ModelConfig) -> None:
    """The tiny Qwen2's attention shapes, which it needs to build and run: ``num_heads`` divides ``hidden_size``,
    the head size ``hidden_size / num_heads`` is even (its rotary embedding rotates halves of each head), and the
    key/value heads divide ``num_heads`` (grouped-query attention shares each among as many query heads)."""
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.num_heads: bad value {m.num_heads}; must divide model.hidden_size ({m.hidden_size})",
                          "model.num_heads")
    head = m.hidden_size // m.num_heads
    if head % 2:
        step = 2 * m.num_heads
        raise ConfigError(
            f"model.hidden_size: bad value {m.hidden_size}; its {m.num_heads} heads (model.num_heads) would have "
            f"{head} dimensions each, and the rotary position embedding needs an even head size: use a multiple of "
            f"2 x num_heads = {step}, e.g. {-(-m.hidden_size // step) * step}", "model.hidden_size")
    kv = kv_heads(m)
    if m.num_heads % kv:
        divisors = ", ".join(str(d) for d in range(1, m.num_heads + 1) if m.num_heads % d == 0)
        given = (f"bad value {kv}" if m.num_kv_heads is not None
                 else f"null (the default) takes model.num_heads // 2 = {kv} key/value heads")
        raise ConfigError(
            f"model.num_kv_heads: {given}; grouped-query attention shares each key/value head among "
            f"num_heads / num_kv_heads query heads, so it must divide model.num_heads ({m.num_heads}): set "
            f"model.num_kv_heads to one of {divisors}", "model.num_kv_heads")


def model_dir(path: str) -> Path:
    """``model.path`` as the absolute directory the workers load (``~`` expanded, relative to this working
    directory: workers on Ray run in a copy of it)."""
    return Path(path).expanduser().absolute()


def read_model_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model directory ``path`` (``model.path``), checked to be one: the
    directory exists and holds ``config.json`` (a JSON object) and weights; else :class:`ConfigError`."""
    d = model_dir(path)
    fix = ("set model.path to a local Hugging Face model directory (config.json plus model.safetensors, as "
           "save_pretrained writes it), or null for the tiny random model")
    if not d.exists():
        raise ConfigError(f"model.path: {d} does not exist; {fix}", "model.path")
    if not d.is_dir():
        raise ConfigError(f"model.path: {d} is not a directory; {fix}", "model.path")
    cfg_file = d / "config.json"
    try:
        data = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.path: {d} has no config.json, so it is not a Hugging Face model directory; {fix}",
                          "model.path") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"model.path: {cfg_file} cannot be read as JSON ({e}); {fix}", "model.path") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path: {cfg_file} holds a {type(data).__name__}, not a model config; {fix}",
                          "model.path")
    if not any((d / name).is_file() for name in _HF_WEIGHTS):
        raise ConfigError(f"model.path: {d} has a config.json but no weights (none of {', '.join(_HF_WEIGHTS)}); "
                          f"{fix}", "model.path")
    return data


def model_positions(model_config: Mapping[str, Any]) -> int:
    """The positions (prompt + response tokens) of a model from its ``config.json``: ``max_position_embeddings``
    (``n_positions`` for GPT-2-style configs); :class:`ConfigError` when it has neither."""
    for key in ("max_position_embeddings", "n_positions"):
        value = model_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ConfigError("model.path: its config.json has no max_position_embeddings (or n_positions), so the prompt "
                      "and response lengths cannot be checked against the model; use a model whose config.json "
                      "states its positions", "model.path")


def warm_start_with_kl(steps: int, kl_coef: float) -> str:
    """The error for a warm start combined with a KL term (config check and built-task check say the same)."""
    return (f"task.params.warm_start_steps: {steps} warm-start steps with algorithm.kl_coef={kl_coef}; the reference "
            "model holds the initial weights, not the warm-started ones, so the KL term would pull the policy back "
            "toward the untrained model: set algorithm.kl_coef=0, or warm-start outside the job and load it with "
            "model.path")


def _sections() -> dict[str, type[_Model]]:
    """Section name -> section class, in declaration order."""
    return {name: info.annotation for name, info in Config.model_fields.items()}


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
    names = list(sections[section].model_fields)
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f" (did you mean {section + '.' + close[0]!r}?)" if close else ""
    if not hint:
        elsewhere = [s for s, cls in sections.items() if key in cls.model_fields]
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
        built[name] = cls(**{str(key): value for key, value in values.items()})  # unknown keys: did-you-mean
    return Config(**built)


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader for config files and override values (see :func:`_load_yaml`), without YAML 1.1's octal
    (``0100`` is 64) and base-60 (``1:00`` is 60) number forms: those stay strings, which a number field refuses."""


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ConfigLoader.add_implicit_resolver(  # SafeLoader's, less the octal and the base-60 forms
    _INT_TAG, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
                           r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
_YAML_NULLS = ("~", "null", "Null", "NULL")  # YAML's plain null scalars (the empty one is refused as a path)
# what YAML 1.1 reads as octal or base 60: such a string given for an int field gets a hint
_YAML11_NUMBER = re.compile(r"^[-+]?(?:0[0-9_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$")


def _check_duplicate_keys(node: yaml.Node, path: str, where: str, unit: str) -> None:
    """Refuse a mapping under ``node`` that gives a key twice (YAML keeps the last and drops the first's values),
    naming the key path and both places (``unit``: ``line`` or ``column``); keys merged in with ``<<`` may be
    overridden, as YAML intends."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                _check_duplicate_keys(value_node, path, where, unit)
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{path}.{key}" if path else str(key)
            at = (key_node.start_mark.line if unit == "line" else key_node.start_mark.column) + 1
            if key is not None and key in seen:
                raise ConfigError(f"{where}: duplicate key {dotted!r} at {unit} {at} (first at {unit} {seen[key]}); "
                                  f"YAML would keep only the last one and drop the values of the first: give it once",
                                  dotted)
            if key is not None:
                seen[key] = at
            _check_duplicate_keys(value_node, dotted, where, unit)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, f"{path}[{i}]", where, unit)


def _load_yaml(text: str, where: str) -> Any:
    """``text`` parsed as one YAML document (None when it has none) with :class:`_ConfigLoader`; a key given twice in
    a mapping is a :class:`ConfigError` naming ``where`` (a file, or an override's key), the key and both places."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, "", where, "line" if "\n" in text.strip() else "column")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _string_value(text: str, where: str) -> str | None:
    """The value of a ``str`` key's override: the text as typed (surrounding blanks dropped), so ``runs/exp #3``
    keeps its `` #3`` (YAML would read a comment) and ``007`` its zeros; a quoted text is unquoted as YAML does.
    ``~`` and ``null`` are None, as in a file: a key that takes null is cleared, one that does not refuses it (so
    ``runner.output_dir=~`` is not the home directory, nor ``=null`` a directory ``./null``; quote them for the
    text)."""
    value = text.strip()
    if value in _YAML_NULLS:
        return None
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        parsed = _load_yaml(value, where)
        if isinstance(parsed, str):
            return parsed
    return value


def _parse_override(text: str, raw: dict[str, Any]) -> str:
    """Apply one ``section.key=value`` (or ``section.mapping.key=value``) to ``raw``; returns the key.

    The value is parsed with YAML scalar rules, except that a ``str`` field keeps the text as typed (see
    :func:`_string_value`).
    """
    key, sep, value_text = text.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError("bad override: expected section.key=value")
    section, name = parts[0], parts[1]
    sections = _sections()
    if section not in sections:
        raise _unknown_key(None, section)
    if name not in sections[section].model_fields:
        raise _unknown_key(section, name)
    annotation = sections[section].model_fields[name].annotation
    tp = _optional(annotation)[0]
    if len(parts) > 2 and get_origin(tp) is not dict:
        path = f"{section}.{name}"
        raise ConfigError(f"{path}: has type {_describe(annotation)}, not a mapping", path)
    try:
        if tp is str and len(parts) == 2:
            value = _string_value(value_text, key.strip())
        else:
            value = _load_yaml(value_text, key.strip())
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{key}: cannot parse {value_text!r} as YAML ({problem})", key) from None
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
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: the config file does not exist; pass the path of a YAML file") from None
        except IsADirectoryError:
            raise ConfigError(f"{path}: is a directory, not a config file; pass the path of a YAML file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the config file ({e}); pass a readable UTF-8 YAML file") from None
        try:
            raw = _load_yaml(text, str(path))
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        if raw is None:  # a truncated or wrong file must not run the default job
            raise ConfigError(f"{path}: the config file holds no settings (it is empty or only comments); write the "
                              "job's sections in it (an empty mapping, {}, for all defaults), or omit the file")
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
    return config.model_dump()


_M = TypeVar("_M", bound=_Model)


def replace(config: _M, /, **changes: Any) -> _M:
    """A copy of a section (or a whole :class:`Config`) with ``changes``, validated like a new one."""
    return type(config)(**{**{name: getattr(config, name) for name in type(config).model_fields}, **changes})


def config_help() -> str:
    """Every section and key with its type, default and description (``orchestra train --help-config``)."""
    lines = ["Job config keys (YAML sections, or section.key=value overrides):"]
    for section, cls in _sections().items():
        lines.append(f"\n{section}: {cls.__doc__}")
        for name, info in cls.model_fields.items():
            default = json.dumps(info.get_default(call_default_factory=True))
            lines.append(f"  {section}.{name}: {_describe_field(info)}, default {default}\n      {info.description}")
    return "\n".join(lines)
