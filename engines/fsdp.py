"""FSDP2 training engine: sharded forward/backward, AdamW, LR schedule, checkpoints.

One :class:`FSDPEngine` lives in each rank's process. It shards a Hugging Face model with
``torch.distributed.fsdp.fully_shard`` (one FSDP unit per decoder layer plus the root) over a 1-D
``dp`` device mesh, so every rank is a data-parallel rank and a collector of its own rows.

Micro-batch loss weighting (``loss_fn.loss_scale``, else ``EngineConfig.loss_scale``)
------------------------------------------------------------------------------------
``loss_fn(outputs, micro_batch)`` must return the **mean** of its loss over the micro-batch's
units: response tokens (``"tokens"``, units = ``response_mask.sum()``), sequences with at least
one response token (``"sequences"``, for seq-mean aggregations) or rows (``"rows"``). A loss
object names its units in a ``loss_scale`` attribute (the pipelines' loss objects derive it from
their aggregation mode); a plain function gets ``EngineConfig.loss_scale``. Before the
micro-batch loop the engine all-reduces the unit count ``N`` of the whole *global* mini-batch
(all DP ranks); it multiplies micro-batch m's loss by ``n_m / N`` (``n_m``: the units of m), and
by ``dp_size`` to undo FSDP's gradient averaging over ranks. ``sum_m (n_m / N) mean_m`` is the
mean over the global mini-batch, so the gradient is that of the whole mini-batch's loss,
independent of ``micro_batch_size`` and of the DP size, for token- and sequence-level means alike.
A micro-batch with ``n_m = 0`` (every response masked out) weighs 0 exactly: ``loss_fn`` is not called for it
(unless a ``metric_scales`` unit of it is > 0, for the metrics; its loss is then not backpropagated), so a mean over
no unit (0/0 = NaN) cannot poison the step; it still runs the same forward and a zero backward, for FSDP's
collectives. A step whose gradient norm is not finite is skipped (``skipped=1``) with a WARNING on rank 0.
The reported ``loss`` and every loss_fn metric are the same weighted means, except that a metric named in the
loss object's ``metric_scales`` (``{name: "tokens" | "sequences" | "rows"}``) is weighted by those units: a
token-mean metric such as a clip fraction or the entropy stays the mean over the mini-batch's tokens under a
sequence-mean loss, so it does not change with ``micro_batch_size`` either. Metrics are summed over the ranks by
name: the ranks agree on the union of the names first, and a metric that a micro-batch (or a whole rank) does not
report contributes 0 there, so ``loss_fn`` may report a metric for some data only (its value is then the weighted
sum over the micro-batches that report it, divided by the mini-batch's units).

Ranks with fewer micro-batches than others run zero-weighted dummy micro-batches so that every
rank issues the same FSDP collectives (a batch need not split evenly over ranks); a rank with no rows at all
(a global mini-batch whose rows other ranks hold) runs them on one filler row.

Failures stay collective: a batch a rank refuses is refused on every rank before any forward (a batch that is
not a mapping of tensors, a missing or misshapen column, a mask that is not 0/1, token ids that are not integers or
lie outside the model's vocabulary, an explicit ``lr`` that is not a finite number > 0; for ``compute_log_prob`` /
``compute_values`` also an empty batch). A ``loss_fn`` that raises on one rank (or returns a non-scalar, a loss
detached from the outputs, or a metric that is not a number) stops every rank after that micro-batch's forward and
before its backward: one all-reduce of a per-rank flag per micro-batch. The failing rank raises its own error, the
others one naming it; the gradients of the step's earlier micro-batches are dropped (under
``accumulate_without_sync`` FSDP holds them unreduced, so one synced zero-weighted backward on a filler row reduces
them first) and no optimizer step is taken, so the engine is as it was before the call. Every backward also carries
a zero-weighted term of the main output, so it reaches every parameter on every rank and FSDP's gradient
collectives pair up even where a loss does not depend on the model (a constant zero loss for a micro-batch is legal
and trains nothing).

What the ranks cannot agree on beforehand stops them all the hard way: an error that one rank raises inside a
call's collective work (inside the backward itself, e.g. autograd's "modified by an inplace operation" when a loss
wrote into a tensor the backward needs; inside the model's forward; a ``KeyboardInterrupt`` in ``loss_fn``; a
collective that failed; a ``load`` that fails after its checks agreed, with some of the rank's shards already
overwritten: a model part checkpoint, part old weights must not train on). That rank leaves what it raised in the
process group's store, aborts every process group of its process and calls ``on_abort`` (the engines' orchestra
workers pass ``Worker.declare_dead``: supervision then reports the rank dead; the pipeline runner stops the run with
the error and shuts the cluster down, which ends every rank's process). Its peers wait in their collective until
that process ends: on gloo (torch 2.13) an aborted group's connections close only when the process exits or frees
the group, which the engine's model still holds; then their collectives fail at once (instead of at the process
group's timeout, 30 minutes on gloo by default: a hung job with no error). The failing rank raises its own error
(with a note saying so), the others an :class:`EngineAbortedError` naming it and what it raised. The process groups
are gone, so the engine, and every other engine of the process made before the abort, refuses later calls with an
``EngineAbortedError``: restart the ranks (a new process group). With one rank there is no peer to release, and
nothing is aborted. A caller's own per-rank work that leads into the engine's collectives (a worker's mini-batch
split before ``train_step``) goes under the same guard with :meth:`FSDPEngine.collective`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from engines._data import (
    batch_rows,
    entropy_from_logits,
    logprobs_from_logits,
    model_inputs,
    position_ids_from_mask,
    slice_rows,
    tensor_dict,
    to_tensordict,
)
from engines._dist import agreed, failed_ranks, init_distributed, is_agreed

__all__ = ["EngineAbortedError", "EngineConfig", "FSDPEngine", "LossFn", "lr_factor"]

log = logging.getLogger("orchestra")

LossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], tuple[torch.Tensor, Mapping[str, Any]]]
"""``loss_fn(outputs, micro_batch) -> (loss, metrics)``; see the module docstring for weighting."""

ModelKind = Literal["auto", "causal_lm", "value"]
LOSS_SCALES = ("tokens", "sequences", "rows")

_FAILED_KEY = "orchestra/engine_failed/"  # + rank: what a rank raised alone inside a collective (process-group store)
_ABORTED_FOR = "orc_aborted_for"  # set on the error a guard aborted the process groups for: outer guards pass it on
_aborts: list[str] = []  # why this process's process groups were aborted, each time (engines made before refuse)


def _dropout_off(model: nn.Module) -> list[str]:
    """Set every dropout rate of ``model`` to 0 and say which were not: ``nn.Dropout`` modules, float attributes
    of its modules named ``*dropout*`` (transformers' attention keeps its rate so) and its config's ``*dropout*`` /
    ``*pdrop*`` fields. An RL update must see the log-probs ``compute_log_prob`` (eval mode) gave for the same
    weights (as TRL's ``disable_dropout``)."""
    found: dict[str, float] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p:
            found.setdefault(f"{type(m).__name__}.p", m.p)
            m.p = 0.0
        for attr, v in list(vars(m).items()):
            if "dropout" in attr and type(v) is float and v:
                found.setdefault(f"{type(m).__name__}.{attr}", v)
                setattr(m, attr, 0.0)
    cfg = getattr(model, "config", None)
    for attr, v in (list(vars(cfg).items()) if cfg is not None and hasattr(cfg, "__dict__") else []):
        if ("dropout" in attr or "pdrop" in attr) and type(v) is float and v:
            found.setdefault(f"config.{attr}", v)
            setattr(cfg, attr, 0.0)
    return [f"{k}={v:g}" for k, v in found.items()]


class EngineAbortedError(RuntimeError):
    """A rank failed inside a call's collective work on its own, so the process groups were aborted (the other ranks'
    collectives fail at once instead of waiting for the timeout); the engines of these processes can no longer be
    used: restart the ranks."""


@dataclass(frozen=True)
class EngineConfig:
    """Optimisation and execution options of an :class:`FSDPEngine`.

    lr / weight_decay / betas / eps: AdamW (weight decay applies to every parameter); lr finite > 0, weight_decay
        >= 0, each beta in [0, 1), eps finite > 0 (``__post_init__`` raises a ValueError naming the field otherwise,
        as for min_lr_ratio outside [0, 1], total_steps < 1 and a NaN grad_clip).
    lr_schedule: "constant" or "cosine" (to ``min_lr_ratio * lr`` at step index ``total_steps``: one past the
        last of ``total_steps`` steps, which runs slightly above it), both
        after a linear warmup of ``warmup_steps`` (step s uses ``lr * (s + 1) / warmup_steps``). Step counts
        (warmup_steps, total_steps, schedule_start) and micro-batch sizes must be integers, and a cosine schedule
        needs total_steps > warmup_steps (ValueError otherwise).
    schedule_start: optimizer steps taken before the schedule starts (a warm start's, each given its own
        ``lr`` in ``train_step``): step ``schedule_start`` is the schedule's step 0.
    grad_clip: max global grad norm; None or <= 0 disables clipping (the norm is still reported).
    micro_batch_size: rows per forward/backward in ``train_step``.
    forward_micro_batch_size: rows per forward in ``compute_log_prob``/``compute_values``
        (None: same as ``micro_batch_size``).
    loss_scale: "tokens", "sequences" or "rows": the units a plain loss function averages over, for
        weighting micro-batches (module docstring); a loss object's own ``loss_scale`` wins.
    seed: seeds torch's global RNG when the engine is built (before the model factory runs) and so dropout and
        whatever else draws from it. It does not set the initial weights of a model from the engines' builders:
        ``engines.models.build_causal_lm`` / ``build_value_model`` / ``build_reward_model`` seed their init with their
        own ``seed`` argument (default 0) in a forked RNG, so pass the seed to the builder inside the factory (e.g.
        ``lambda: build_causal_lm(cfg, seed=s)``). A factory that draws from the global RNG (``from_config``) does
        follow this seed.
    mixed_precision: bf16 params / fp32 gradient reduction; None means on for CUDA, off on CPU.
    reshard_after_forward: FSDP2 option (True frees gathered params after each forward).
    accumulate_without_sync: skip the gradient reduce-scatter on all but the last micro-batch
        (less communication, more memory for unsharded gradients).
    gradient_checkpointing: recompute decoder-layer activations in backward (HF non-reentrant
        checkpointing; less activation memory, ~1/3 more compute).
    device: "cpu", "cuda", "cuda:1"...; None picks cuda:<LOCAL_RANK> when available, else cpu.
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    schedule_start: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0
    micro_batch_size: int = 8
    forward_micro_batch_size: int | None = None
    loss_scale: Literal["tokens", "sequences", "rows"] = "tokens"
    seed: int = 0
    mixed_precision: bool | None = None
    reshard_after_forward: bool = True
    accumulate_without_sync: bool = False
    gradient_checkpointing: bool = False
    device: str | None = None

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> ValueError:
            return ValueError(f"EngineConfig.{field} must be {rule}, got {getattr(self, field)!r}")

        def number(x: Any) -> bool:
            try:
                return not isinstance(x, bool) and math.isfinite(float(x))
            except (TypeError, ValueError):
                return False

        if self.lr_schedule not in ("constant", "cosine"):
            raise bad("lr_schedule", "'constant' or 'cosine'")
        if not (number(self.lr) and self.lr > 0):
            raise bad("lr", "a finite number > 0")
        if not (number(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise bad("min_lr_ratio", "in [0, 1] (the end of the cosine schedule as a fraction of lr)")
        def integer(x: Any) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        if self.total_steps is not None and not (integer(self.total_steps) and self.total_steps >= 1):
            raise bad("total_steps", "an integer >= 1 or None")
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("EngineConfig: lr_schedule='cosine' needs total_steps > 0 (the step where lr reaches "
                             "min_lr_ratio*lr)")
        if not (integer(self.warmup_steps) and self.warmup_steps >= 0):
            raise bad("warmup_steps", "an integer >= 0 (optimizer steps)")
        if not (integer(self.schedule_start) and self.schedule_start >= 0):
            raise bad("schedule_start", "an integer >= 0 (optimizer steps)")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"EngineConfig: total_steps ({self.total_steps}) must be greater than warmup_steps "
                             f"({self.warmup_steps}) with lr_schedule='cosine': the decay runs from the end of the "
                             f"warmup to total_steps, so it would never run (the LR would drop from lr to "
                             f"min_lr_ratio*lr at once); raise total_steps or lower warmup_steps")
        if not (number(self.weight_decay) and self.weight_decay >= 0):
            raise bad("weight_decay", "a finite number >= 0")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(number(b) and 0.0 <= b < 1.0 for b in self.betas)):
            raise bad("betas", "two numbers in [0, 1) (AdamW's beta1, beta2)")
        if not (number(self.eps) and self.eps > 0):
            raise bad("eps", "a finite number > 0")
        clip = self.grad_clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or math.isnan(clip)):
            raise bad("grad_clip", "a number (<= 0 or None: no clipping)")
        if self.loss_scale not in LOSS_SCALES:
            raise bad("loss_scale", f"one of {', '.join(LOSS_SCALES)}")
        if not (integer(self.micro_batch_size) and self.micro_batch_size >= 1):
            raise bad("micro_batch_size", "an integer >= 1 (rows)")
        if self.forward_micro_batch_size is not None and not (integer(self.forward_micro_batch_size)
                                                               and self.forward_micro_batch_size >= 1):
            raise bad("forward_micro_batch_size", "an integer >= 1 or None (rows)")


def lr_factor(config: EngineConfig, step: int) -> float:
    """Multiplier of ``config.lr`` for optimizer step ``step`` (0-based, counted from ``config.schedule_start``):
    warmup, then schedule."""
    step = max(0, step - config.schedule_start)
    w = config.warmup_steps
    if w > 0 and step < w:
        return (step + 1) / w
    if config.lr_schedule == "constant":
        return 1.0
    assert config.total_steps is not None
    progress = min(1.0, max(0.0, (step - w) / max(1, config.total_steps - w)))
    r = config.min_lr_ratio
    return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress))


_SCHEDULE_FIELDS = ("lr", "lr_schedule", "warmup_steps", "total_steps", "schedule_start", "min_lr_ratio")


def _warn_schedule_change(saved: Mapping[str, Any] | None, now: EngineConfig, where: Any, rank: int) -> None:
    """A checkpoint written under another LR schedule continues under this one: say which fields differ (a
    field the checkpoint lacks counts at its default), as the step's learning rate then differs from the run's.
    Every rank of a group loads the same checkpoint under the same config and finds the same difference, so
    rank 0 warns (once per load) and the other ranks log it at DEBUG."""
    if not isinstance(saved, Mapping):
        return
    defaults = EngineConfig()
    diff = [f"{k}: {saved.get(k, getattr(defaults, k))!r} -> {getattr(now, k)!r}" for k in _SCHEDULE_FIELDS
            if saved.get(k, getattr(defaults, k)) != getattr(now, k)]
    if diff:
        log.log(logging.WARNING if rank == 0 else logging.DEBUG,
                "%s was written under another learning-rate schedule; it continues under this engine's (%s)",
                os.fspath(where), "; ".join(diff))


_OPTIMIZER_FIELDS = ("weight_decay", "betas", "eps")


def _hparam(value: Any) -> Any:
    """A param-group value in a comparable, printable form (betas come back from JSON as a list)."""
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else value


def _apply_optimizer_hparams(optimizer: torch.optim.Optimizer, now: EngineConfig, where: Any, rank: int) -> None:
    """Set the running config's AdamW hyperparameters on every param group after a load (the checkpoint's groups
    carry the values it was written with) and say which differed: the config in effect is this engine's, as for
    ``lr``. Rank 0 warns (once per load), the other ranks log it at DEBUG."""
    diff: dict[str, str] = {}
    for group in optimizer.param_groups:
        for k in _OPTIMIZER_FIELDS:
            want = _hparam(getattr(now, k))
            had = _hparam(group.get(k))
            if had != want:
                diff.setdefault(k, f"{k}: {had!r} -> {want!r}")
            group[k] = want
    if diff:
        log.log(logging.WARNING if rank == 0 else logging.DEBUG,
                "%s was written with other optimizer hyperparameters; this engine's config applies from now on "
                "(%s)", os.fspath(where), "; ".join(diff.values()))


def _detect_kind(model: nn.Module) -> Literal["causal_lm", "value"]:
    name = type(model).__name__
    if name.endswith("ForCausalLM") or hasattr(model, "lm_head"):
        return "causal_lm"
    if name.endswith("ForTokenClassification"):
        num_labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if num_labels != 1:
            raise ValueError(f"a value model needs num_labels=1, {name} has {num_labels}; use engines.models.build_value_model")
        return "value"
    raise ValueError(
        f"cannot tell whether {name} is a causal LM or a value model: pass model_kind='causal_lm' or 'value'"
    )


def _layers_to_shard(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    # fallback: children of the largest ModuleList (decoder stacks are ModuleLists)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _micro_units(
    loss_fn: LossFn, default: str, response_mask: torch.Tensor, ranges: list[tuple[int, int]], tokens: list[float]
) -> list[float]:
    """Per micro-batch, the units ``loss_fn`` averages over (its ``loss_scale``, else ``default``)."""
    return _units_of(getattr(loss_fn, "loss_scale", None) or default, response_mask, ranges, tokens)


def _units_of(scale: str, response_mask: torch.Tensor, ranges: list[tuple[int, int]], tokens: list[float],
              what: str = "loss_fn.loss_scale") -> list[float]:
    """Per micro-batch, how many units of ``scale`` (one of ``LOSS_SCALES``) it holds."""
    if scale == "tokens":
        return tokens
    if scale == "sequences":
        has_token = response_mask.bool().any(-1)
        return [float(has_token[s:e].sum().item()) for s, e in ranges]
    if scale == "rows":
        return [float(e - s) for s, e in ranges]
    raise ValueError(f"train_step: {what} must be one of {', '.join(LOSS_SCALES)}, got {scale!r}")


def _check_temperature(temperature: float, what: str) -> None:
    """Logits are divided by ``temperature``: refuse 0 (NaN log-probs), a negative value (the inverted
    distribution) and a non-finite one, with the same message in every entry point."""
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"{what}: temperature must be a finite number > 0, got {temperature!r}; pass the sampling "
                         f"temperature the responses were generated with (1.0 for greedy)")


class _Problem(NamedTuple):
    """Why a rank refuses its batch: the exception type and message it raises (the other ranks raise too)."""

    error: type[Exception]
    message: str


def _mask_problem(mask: torch.Tensor, what: str, rank: int) -> _Problem | None:
    """``response_mask`` must hold only 0 and 1: the engine multiplies its outputs by it and counts its sum as
    tokens, while the losses count ``mask.bool()``; any other value would scale one and not the other."""
    if mask.dtype == torch.bool:
        return None
    bad = (mask != 0) & (mask != 1)
    if not bool(bad.any()):
        return None
    values = sorted({float(v) for v in mask[bad].unique()[:5].tolist()}, key=str)
    return _Problem(ValueError, f"{what}: response_mask must hold only 0 and 1 (1: a response token), but rank "
                                f"{rank}'s holds {values} at {int(bad.sum())} position(s); pass a 0/1 (or bool) mask "
                                f"and put token weights into the loss")


def _column_shape_problem(batch: Mapping[str, Any], data: Mapping[str, torch.Tensor], rows: int,
                          names: tuple[str, ...], what: str, rank: int) -> _Problem | None:
    """Each of the named columns the caller passed must be ``[rows, length]``. Read from ``batch`` as well as
    ``data``: ``tensor_dict`` drops a tensor whose first dimension is not ``rows``, which would otherwise be
    reported as missing."""
    for name in names:
        v = data.get(name, batch.get(name) if hasattr(batch, "get") else None)
        if isinstance(v, torch.Tensor) and (v.dim() != 2 or v.shape[0] != rows):
            return _Problem(ValueError, f"{what}: column {name!r} has shape {tuple(v.shape)} on rank {rank}; it must "
                                        f"be [rows, length] with rows = {rows}")
    return None


def _token_problem(data: Mapping[str, torch.Tensor], vocab: int | None, what: str, rank: int) -> _Problem | None:
    """Token ids must index the model's embedding (0 <= id < vocab): a bad id would fail in the forward of one rank
    while the others wait for it in FSDP's all-gathers (on CUDA it is a device-side assert)."""
    if vocab is None:
        return None
    for name in ("input_ids", "prompts", "responses"):
        ids = data.get(name)
        if ids is None:
            continue
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            return _Problem(ValueError, f"{what}: column {name!r} on rank {rank} holds {ids.dtype} values; token ids "
                                        f"must be integers (torch.long)")
        if ids.numel() == 0:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            bad = ids[(ids < 0) | (ids >= vocab)]
            return _Problem(ValueError, f"{what}: column {name!r} on rank {rank} holds token ids outside the model's "
                                        f"vocabulary [0, {vocab}): {sorted(set(bad[:5].tolist()))} at "
                                        f"{int(bad.numel())} position(s); check the tokenizer matches the model")
    return None


# what train_step reports of its own (a loss_fn's metrics of these names would mix with them)
_OWN_RESULTS = frozenset({"loss", "grad_norm", "lr", "tokens", "rows", "micro_batches", "step", "skipped"})


def _metric_value(name: str, v: Any) -> float:
    """A loss_fn metric as a float: a number or a one-element tensor."""
    try:
        return float(v.detach().item()) if isinstance(v, torch.Tensor) else float(v)
    except (TypeError, ValueError, RuntimeError) as e:
        shape = f" of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else ""
        raise ValueError(f"train_step: loss_fn's metric {name!r} must be a number or a one-element tensor, got "
                         f"{type(v).__name__}{shape} ({e})") from e


def _lr_problem(lr: float | None, rank: int) -> _Problem | None:
    """An explicit ``lr`` must be a finite number > 0 (refused on every rank, like a bad batch)."""
    if lr is None:
        return None
    try:
        ok = math.isfinite(lr) and lr > 0
    except TypeError:
        ok = False
    return None if ok else _Problem(ValueError, f"train_step: lr must be a finite number > 0, got {lr!r} (rank {rank})")


COLUMN_SHAPES = ("tokens", "rows|tokens")
"""Shapes a loss may declare for a column in ``required_columns``: ``[rows, response_len]``, or that or ``[rows]``."""


def _shape_text(kind: str, rows: int, R: int) -> str:
    tokens = f"[rows, response_len] = {(rows, R)}"
    return tokens if kind == "tokens" else f"[rows] = {(rows,)} or {tokens}"


def _train_batch_problem(batch: Mapping[str, Any], data: Mapping[str, torch.Tensor], rows: int, loss_fn: LossFn,
                         rank: int) -> _Problem | None:
    """What is wrong with a rank's train_step batch, before anything is computed from it (None: nothing): the model
    inputs, ``response_mask`` (shape ``[rows, response_len]``, 0/1 values) and each column ``loss_fn`` declares in
    ``required_columns`` (``{name: (shape kind, what to pass)}``, optional): present, floating point, of its
    shape. ``batch`` is the caller's mapping (``data`` drops tensors whose first dimension is not ``rows``)."""
    def shape_of(name: str) -> tuple[int, ...] | None:
        v = batch.get(name) if hasattr(batch, "get") else None
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    if "responses" not in data or data["responses"].dim() != 2:
        had = shape_of("responses")
        return _Problem(KeyError if had is None else ValueError,
                        f"train_step: batch needs 'responses' [rows, response_len] (rank {rank} got "
                        + (f"keys {sorted(data)})" if had is None else f"shape {had} for {rows} rows)"))
    R = data["responses"].shape[1]
    problem = _column_shape_problem(batch, data, rows, ("prompts", "input_ids", "attention_mask"), "train_step", rank)
    if problem is not None:
        return problem
    try:
        _, attention_mask, R = model_inputs(data, "train_step")
    except (KeyError, ValueError) as e:
        return _Problem(type(e), f"{e.args[0] if e.args else e} (rank {rank})")
    problem = _prompt_problem(attention_mask, R, "train_step", rank)
    if problem is not None:
        return problem
    if "response_mask" not in data:
        return _Problem(KeyError, f"train_step: batch needs 'response_mask' [rows, response_len] (rank {rank} got "
                                  f"keys {sorted(data)})")
    if tuple(data["response_mask"].shape) != (rows, R):
        return _Problem(ValueError, f"train_step: column 'response_mask' has shape {tuple(data['response_mask'].shape)} "
                                    f"on rank {rank}; it must be {_shape_text('tokens', rows, R)} (response_len: the "
                                    f"width of 'responses')")
    problem = _mask_problem(data["response_mask"], "train_step", rank)
    if problem is not None:
        return problem
    who = getattr(loss_fn, "__name__", None) or type(loss_fn).__name__
    for name, (kind, purpose) in (getattr(loss_fn, "required_columns", None) or {}).items():
        if kind not in COLUMN_SHAPES:
            raise ValueError(f"train_step: {who}.required_columns[{name!r}] must be one of {COLUMN_SHAPES}, got {kind!r}")
        expected = _shape_text(kind, rows, R)
        if name not in data:
            had = shape_of(name)
            if had is None:
                return _Problem(KeyError, f"train_step: {who} needs column {name!r} {expected} ({purpose}), but rank "
                                          f"{rank}'s batch has none (it has {sorted(data)})")
            return _Problem(ValueError, f"train_step: column {name!r} has shape {had} on rank {rank}; {who} needs "
                                        f"{expected}")
        v = data[name]
        allowed = [(rows, R)] if kind == "tokens" else [(rows,), (rows, R)]
        if tuple(v.shape) not in allowed:
            return _Problem(ValueError, f"train_step: column {name!r} has shape {tuple(v.shape)} on rank {rank}; "
                                        f"{who} needs {expected}")
        if not v.is_floating_point():
            return _Problem(ValueError, f"train_step: column {name!r} has dtype {v.dtype} on rank {rank}; {who} "
                                        f"needs a floating-point tensor ({purpose}); cast it with .float()")
    return None


def _prompt_problem(attention_mask: torch.Tensor, R: int, what: str, rank: int) -> _Problem | None:
    """Prompts must be LEFT-padded with at least one real token (as ``RolloutEngine.generate`` requires): the
    engine reads the response's first log-prob / value at the last prompt column, so a right-padded prompt or a row
    without a prompt token gives wrong numbers silently. None when every row is fine, else the first bad row."""
    prompt_mask = attention_mask[:, :-R]
    if prompt_mask.shape[0] == 0:
        return None
    empty = (prompt_mask != 0).sum(-1) == 0
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        return _Problem(ValueError, f"{what}: row {rows[0]} (rank {rank}; {len(rows)} such row(s): {rows[:5]}) has no "
                                    f"real prompt token (attention_mask is 0 over all {prompt_mask.shape[1]} prompt "
                                    f"columns); every row needs a prompt of at least one token: drop the row or "
                                    f"give it one (e.g. a BOS token)")
    right = prompt_mask[:, -1] == 0
    if bool(right.any()):
        rows = right.nonzero().flatten().tolist()
        return _Problem(ValueError, f"{what}: prompts must be LEFT-padded, but row {rows[0]} (rank {rank}; {len(rows)} "
                                    f"such row(s): {rows[:5]}) has attention_mask 0 in the last prompt column "
                                    f"(column {prompt_mask.shape[1] - 1}, just before the response); pad prompts on "
                                    f"the left (tokenizer padding_side='left')")
    return None


def _filler_row(data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One fully attended row of token id 0, shaped like ``data``'s model inputs: what a rank that holds no rows of
    a step runs its zero-weighted dummy micro-batches on (a model cannot run a forward on zero rows)."""
    input_ids, _, R = model_inputs(data, "train_step")
    ids = torch.zeros((1, input_ids.shape[1]), dtype=input_ids.dtype, device=input_ids.device)
    return {"input_ids": ids, "responses": ids[:, -R:], "attention_mask": torch.ones_like(ids)}


class FSDPEngine:
    """A model sharded with FSDP2 over all ranks of the default process group.

    Build it on every rank with the same model (e.g. ``lambda: build_causal_lm(cfg, seed=0)``).
    If no process group exists, one is created from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    (or a private single-rank group when those are unset). ``model_kind`` "causal_lm" gives
    ``compute_log_prob``; "value" (token-classification model with one label) gives
    ``compute_values``; "auto" tells them apart by class.

    All returned tensors are on CPU, one row per input row of this rank.
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        config: EngineConfig | None = None,
        *,
        model_kind: ModelKind = "auto",
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.config = config if config is not None else EngineConfig()
        cfg = self.config
        self.device = init_distributed(torch.device(cfg.device) if cfg.device else None)
        torch.manual_seed(cfg.seed)
        if not isinstance(model, nn.Module):
            model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or a factory returning one, got {type(model).__name__}")
        self.model_kind: Literal["causal_lm", "value"] = (
            _detect_kind(model) if model_kind == "auto" else model_kind
        )
        if self.model_kind not in ("causal_lm", "value"):
            raise ValueError(f"model_kind must be 'auto', 'causal_lm' or 'value', got {model_kind!r}")
        if any(p.dtype != torch.float32 for p in model.parameters()):
            dtypes = sorted({str(p.dtype) for p in model.parameters()})
            raise ValueError(
                f"FSDPEngine trains fp32 master weights; the model has {dtypes}. Build it with "
                "dtype=torch.float32 (bf16 compute comes from mixed_precision on CUDA)."
            )

        self._world = dist.get_world_size()
        self._rank = dist.get_rank()
        # the store outlives an abort of the process groups (a rank that hosts it keeps serving its peers' reads)
        self._store = dist.distributed_c10d._get_default_store() if self._world > 1 else None
        self._generation = len(_aborts)  # an abort after this leaves the engine without its process groups
        self._on_abort = on_abort
        self.mesh = init_device_mesh(self.device.type, (self._world,), mesh_dim_names=("dp",))
        mp_on = cfg.mixed_precision if cfg.mixed_precision is not None else self.device.type == "cuda"
        kw: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": cfg.reshard_after_forward}
        if mp_on:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if hasattr(model, "config") and hasattr(model.config, "use_cache"):
            model.config.use_cache = False
        dropped = _dropout_off(model)
        if dropped and self._rank == 0:
            log.warning("FSDPEngine: the model's dropout is turned off for training (%s): with it, train_step's "
                        "log-probs differ from compute_log_prob's (eval mode) for the same weights, so the "
                        "policy ratio of an update is not 1 and clipping hits random tokens", ", ".join(dropped))
        if cfg.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            elif hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            else:
                raise TypeError(f"{type(model).__name__} cannot checkpoint activations; set gradient_checkpointing=False")
        for layer in _layers_to_shard(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)  # moves parameters to the mesh device
        model.to(self.device)  # buffers (e.g. rotary inv_freq) too
        self.model = model
        self.mixed_precision = bool(mp_on)
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr * lr_factor(cfg, 0),
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=True,
        )
        self.global_step = 0
        self._offloaded = False

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel mesh."""
        return self._rank

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks."""
        return self._world

    @property
    def is_collector(self) -> bool:
        """Whether this rank's outputs are part of the result (always, with pure DP)."""
        return True

    @property
    def lr(self) -> float:
        """Learning rate the next ``train_step`` will use."""
        return self.config.lr * lr_factor(self.config, self.global_step)

    # ------------------------------------------------------------------ forward
    def _check_ready(self, what: str) -> None:
        if len(_aborts) > self._generation:
            raise EngineAbortedError(f"FSDPEngine.{what}: this engine can no longer be used: "
                                     f"{_aborts[self._generation]}. Restart its ranks (new processes, a new process "
                                     f"group)")
        if self._offloaded:
            raise RuntimeError(f"FSDPEngine.{what}: the engine is offloaded to CPU; call onload() first")

    def _agree(self, error: BaseException) -> BaseException:
        """``error`` is raised on every rank by agreement (after a collective that told each rank): no abort."""
        return agreed(error)

    def collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Around a caller's own per-rank work that leads into this engine's collective calls (a worker's update
        that splits its rows, then calls ``train_step``): an error one rank raises there, before the engine's own
        guard, stops every rank as one raised inside the engine does (module docstring), instead of leaving the
        peers in the engine's collectives until the process group's timeout. ``what`` names the call in the errors.
        Errors raised on every rank alike pass as they are when marked ``engines._dist.agreed``."""
        return self._collective(what)

    @contextlib.contextmanager
    def _collective(self, what: str, deterministic: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Around a call's collective work: an error this rank raises that the ranks did not agree on aborts the
        process groups, so that no peer waits for ever in a collective (module docstring). Errors marked
        ``_dist.agreed`` pass as they are, and so do those of the types in ``deterministic``: errors every rank raises
        alike from the same inputs before any collective (a checkpoint's unsupported layout), and those an inner
        guard already aborted for (guards nest: a worker's around the engine's)."""
        try:
            yield
        except BaseException as e:
            if (is_agreed(e) or isinstance(e, deterministic) or self._world == 1 or hasattr(e, _ABORTED_FOR)
                    or isinstance(e, EngineAbortedError)):
                raise
            raised = self._abort(what, e)
            setattr(raised, _ABORTED_FOR, what)
            if raised is e:
                raise
            raise raised from e

    def _abort(self, what: str, error: BaseException) -> BaseException:
        """Abort this process's process groups after ``error`` in ``what``; return what this rank raises: its own
        error (noted) when no peer failed first, else an EngineAbortedError naming the ranks that did."""
        others = self._failures()
        unknown = others is None  # the store is gone (its host, rank 0, may have exited): who failed first is unknown
        others = others or {}
        if not others and not unknown:
            text = f"{type(error).__name__}: {error}"
            try:
                self._store.set(f"{_FAILED_KEY}{self._rank}", text[:4000])
            except Exception:  # noqa: BLE001 - the peers will not learn who failed: logged, the abort goes on
                log.exception("FSDPEngine.%s on rank %d: could not leave the error in the process group's store",
                              what, self._rank)
        if others:
            why = f"rank(s) {sorted(others)} failed inside {what}'s collective work"
        elif unknown:
            why = (f"rank {self._rank} saw {type(error).__name__} inside {what}'s collective work, and the process "
                   f"group's store could not be read to learn which rank failed first (rank 0 hosts it: it may have "
                   f"exited)")
        else:
            why = (f"rank {self._rank} raised {type(error).__name__} inside {what}'s collective work, and no other "
                   f"rank had reported an error")
        log.error("FSDPEngine.%s on rank %d: %s; aborting the process groups so that no rank waits in a collective",
                  what, self._rank, why)
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - a backend without abort: destroying the group also closes its connections
            log.exception("FSDPEngine.%s on rank %d: abort failed; destroying the process group instead", what,
                          self._rank)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - logged; this rank still raises its error, and its process must end
                log.exception("FSDPEngine.%s on rank %d: destroying the process group failed too", what, self._rank)
        _aborts.append(why)
        if self._on_abort is not None:  # e.g. the rank's Worker.declare_dead: a live process keeps its peers blocked
            try:
                self._on_abort(f"FSDPEngine.{what}: {why} ({type(error).__name__}: {str(error)[:2000]})")
            except Exception:  # noqa: BLE001 - the abort stands; this rank still raises its error below
                log.exception("FSDPEngine.%s on rank %d: on_abort raised", what, self._rank)
        if unknown:
            error.add_note(f"{what} on rank {self._rank}: {why}; the process groups were aborted and this engine can "
                           f"no longer be used: restart its ranks")
            return error
        if not others:
            error.add_note(f"{what} on rank {self._rank}: this error was raised inside the call's collective work "
                           f"and no other rank had reported one (a rank that died reports none), so this rank aborted "
                           f"its process groups: the other ranks' collectives fail once this process ends; this engine "
                           f"can no longer be used: restart its ranks")
            return error
        named = "; ".join(f"rank {r}: {t}" for r, t in sorted(others.items()))
        return EngineAbortedError(f"{what} on rank {self._rank}: rank(s) {sorted(others)} failed inside the call's "
                                  f"collective work ({named}); the process groups were aborted so that no rank waits "
                                  f"for ever, and this engine can no longer be used: restart its ranks (this rank saw "
                                  f"{type(error).__name__}: {error})")

    def _failures(self) -> dict[int, str] | None:
        """What other ranks left in the store before aborting (a peer that fails inside a collective writes there
        first, so a rank whose collective failed because of it finds it); None when the store cannot be read."""
        found: dict[int, str] = {}
        try:
            self._store.set_timeout(datetime.timedelta(seconds=10))
            for r in range(self._world):
                key = f"{_FAILED_KEY}{r}"
                if r != self._rank and self._store.check([key]):
                    found[r] = self._store.get(key).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - the store is gone with its host: said in this rank's error
            log.warning("FSDPEngine on rank %d: could not read the process group's store (%s: %s)", self._rank,
                        type(e).__name__, e)
            return None
        return found

    def _forward(
        self, mb: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        input_ids, attention_mask, R = model_inputs(mb, "FSDPEngine")
        position_ids = position_ids_from_mask(attention_mask)
        out: dict[str, torch.Tensor] = {}
        if self.model_kind == "causal_lm":
            logits = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=R + 1,
            ).logits[:, :-1]
            logits = logits.float()
            if temperature != 1.0:
                logits = logits / temperature
            out["log_probs"] = logprobs_from_logits(logits, input_ids[:, -R:])
            if with_entropy:
                out["entropy"] = entropy_from_logits(logits)
        else:
            with warnings.catch_warnings():
                # the head's Linear on [b, T, H] returns a view; we never modify it in place
                warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
                logits = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                ).logits
            # value of the state before response token t = head output at the position before it
            out["values"] = logits[:, -R - 1 : -1, 0].float()
        return out

    def _micro_ranges(self, rows: int, size: int) -> list[tuple[int, int]]:
        return [(s, min(s + size, rows)) for s in range(0, rows, size)]

    def _global_micro_count(self, local: int, problem: _Problem | None, what: str) -> int:
        """The most micro-batches any rank has (collective); raises on every rank if any rank's batch was
        refused (``problem``: this rank's reason, or None)."""
        t = torch.tensor([local, 0 if problem is None else self._rank + 1], dtype=torch.int64, device=self.device)
        if self._world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self._raise_refused(problem, int(t[1].item()), what)
        return int(t[0].item())

    def _vocab_size(self) -> int | None:
        """Rows of the model's input embedding (None for a model without one)."""
        get = getattr(self.model, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        n = getattr(emb, "num_embeddings", None)
        return int(n) if n is not None else None

    def _inference_problem(self, batch: Mapping[str, Any], data: Mapping[str, torch.Tensor], rows: int,
                           what: str) -> _Problem | None:
        """Why this rank refuses a compute_log_prob / compute_values batch (None: it does not)."""
        if rows < 1:
            return _Problem(ValueError, f"{what}: empty batch on rank {self._rank}; every rank needs at least one row")
        problem = (_column_shape_problem(batch, data, rows, ("prompts", "responses", "input_ids", "attention_mask",
                                                             "response_mask"), what, self._rank)
                   or _token_problem(data, self._vocab_size(), what, self._rank))
        if problem is not None:
            return problem
        try:
            _, attention_mask, R = model_inputs(data, what)
        except (KeyError, ValueError) as e:
            return _Problem(type(e), f"{e.args[0] if e.args else e} (rank {self._rank})")
        problem = _prompt_problem(attention_mask, R, what, self._rank)
        if problem is not None:
            return problem
        if "response_mask" in data:
            if tuple(data["response_mask"].shape) != (rows, R):
                return _Problem(ValueError, f"{what}: column 'response_mask' has shape "
                                            f"{tuple(data['response_mask'].shape)} on rank {self._rank}; it must be "
                                            f"[rows, response_len] = {(rows, R)}")
            return _mask_problem(data["response_mask"], what, self._rank)
        return None

    def _read_batch(self, batch: Any, keys: list[str] | None, what: str
                    ) -> tuple[int, dict[str, torch.Tensor], _Problem | None]:
        """(rows, tensors on the device, a problem if the batch cannot be read at all): read so that an unreadable
        batch is refused on every rank, not raised by this one alone."""
        try:
            return batch_rows(batch), tensor_dict(batch, self.device, keys), None
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            return 0, {}, _Problem(ValueError, f"{what}: rank {self._rank} cannot read its batch ({type(e).__name__}: "
                                               f"{e}); pass a mapping of tensors with one row per sample")

    def _agree_on_loss(self, failure: BaseException | None, micro: int, data: Mapping[str, torch.Tensor]) -> None:
        """After each micro-batch's loss (collective, before its backward): if ``loss_fn`` failed on any rank, every
        rank stops here, the failing ones with their own error and the others with one naming them, with the
        gradients of the step's earlier micro-batches dropped and no step taken. Without it, a rank whose loss
        raised left its peers waiting in the backward's gradient collectives for ever."""
        ranks = failed_ranks(failure is not None, self.device)
        if not ranks:
            return
        if self.config.accumulate_without_sync and self._world > 1:
            # the earlier micro-batches' gradients wait unreduced inside FSDP (not in .grad, which zero_grad
            # clears): one synced zero-weighted backward on every rank reduces them into .grad, dropped below
            self.model.set_requires_gradient_sync(True)
            flush = self._forward(_filler_row(data), 1.0, False)
            (sum(v.sum() for v in flush.values()) * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        if failure is not None:
            raise self._agree(failure)
        raise self._agree(RuntimeError(f"train_step: loss_fn raised on rank(s) {ranks} in micro-batch {micro} (their "
                                       f"errors say what); rank {self._rank} stopped with them before the backward, "
                                       f"and no rank took the step"))

    def _check_outputs_for(self, loss_fn: LossFn, with_entropy: bool) -> None:
        """``loss_fn.required_outputs`` (optional) names the outputs it reads: refuse, before any collective, a
        call that will not compute one of them (the same on every rank: the arguments are the same)."""
        produced = {"log_probs", "entropy"} if with_entropy else {"log_probs"}
        if self.model_kind == "value":
            produced = {"values"}
        for name in getattr(loss_fn, "required_outputs", None) or ():
            if name in produced:
                continue
            if name == "entropy" and self.model_kind == "causal_lm":
                hint = "pass with_entropy=True (or drop the loss's entropy term)"
            else:
                hint = f"this {self.model_kind} engine computes only {sorted(produced)}"
            raise ValueError(f"train_step: {type(loss_fn).__name__} needs the engine output {name!r}, which this call "
                             f"does not compute; {hint}")

    def _raise_refused(self, problem: _Problem | None, refused: int, what: str) -> None:
        """After the ranks exchanged ``refused`` (the highest refused rank + 1, 0 if none): raise this rank's own
        error, or one naming the refusing rank, so that no rank goes on alone into a collective."""
        if problem is not None:
            raise self._agree(problem.error(problem.message))
        if refused:
            raise self._agree(ValueError(f"{what}: rank {refused - 1} refused its batch (its error says why); this rank's batch "
                             f"is fine, but no rank computed anything"))

    @torch.no_grad()
    def _inference(self, batch: Mapping[str, Any], temperature: float, with_entropy: bool, what: str) -> TensorDict:
        self._check_ready(what)
        _check_temperature(temperature, what)
        keys = ["prompts", "responses", "input_ids", "attention_mask", "response_mask"]
        rows, data, unreadable = self._read_batch(batch, keys, what)
        self.model.eval()
        size = self.config.forward_micro_batch_size or self.config.micro_batch_size
        ranges = self._micro_ranges(rows, size) if rows > 0 and unreadable is None else []
        # refused on every rank (``_global_micro_count``), so that no rank goes on alone into the forward's
        # collectives: an empty batch, missing or inconsistent model inputs, a mask that is not 0/1, bad token ids
        problem = unreadable or self._inference_problem(batch, data, rows, what)
        parts: list[dict[str, torch.Tensor]] = []
        with self._collective(what):
            n_global = self._global_micro_count(len(ranges), problem, what)
            for i in range(n_global):
                s, e = ranges[i] if i < len(ranges) else ranges[0]
                out = self._forward(slice_rows(data, s, e), temperature, with_entropy)
                if i < len(ranges):
                    parts.append(out)
        result = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        if "response_mask" in data:
            m = data["response_mask"].to(torch.float32)
            result = {k: v * m for k, v in result.items()}
        return to_tensordict(result, rows)

    def compute_log_prob(
        self, batch: Mapping[str, Any], temperature: float = 1.0, with_entropy: bool = False
    ) -> TensorDict:
        """Log-probs [B, R] (and entropy [B, R]) of the response tokens, in micro-batches.

        Logits are divided by ``temperature`` first (a finite number > 0, as in ``train_step``); logits at
        position t score token t+1.
        Positions where ``response_mask`` is 0 are returned as 0 when the batch has that key (a 0/1 or bool
        mask: other values raise a ValueError on every rank).
        Collective: every rank must call it (with at least one row).
        """
        if self.model_kind != "causal_lm":
            raise TypeError("compute_log_prob needs a causal LM engine; this engine holds a value model (use compute_values)")
        return self._inference(batch, temperature, with_entropy, "compute_log_prob")

    def compute_values(self, batch: Mapping[str, Any]) -> TensorDict:
        """Critic values [B, R]: ``values[:, t]`` is the value of the prefix before response token t.

        (The head output at the position of the token preceding response token t.)
        Collective: every rank must call it.
        """
        if self.model_kind != "value":
            raise TypeError("compute_values needs a value-model engine (model_kind='value', e.g. build_value_model)")
        return self._inference(batch, 1.0, False, "compute_values")

    # ------------------------------------------------------------------ training
    def train_step(
        self,
        batch: Mapping[str, Any],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        with_entropy: bool = True,
        lr: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step over this rank's rows (collective: all ranks call it); ``lr`` replaces the
        schedule's rate for this step (a warm start's own rate). A rank may pass zero rows (its columns shaped
        ``[0, ...]``) when another rank holds the step's rows: it still enters every collective.

        ``loss_fn(outputs, micro_batch)`` gets ``outputs`` with ``log_probs`` [b, R] and ``entropy``
        [b, R] (causal LM; entropy if ``with_entropy``) or ``values`` [b, R] (value model), with
        gradients (a ``loss_fn.required_outputs`` tuple, if present, is checked first: a ValueError names what to
        pass; so are the model inputs, ``response_mask`` [rows, response_len] of 0/1, and every column in
        ``loss_fn.required_columns`` (``{name: ("tokens" | "rows|tokens", what to pass)}``): missing, misshapen or
        non-float columns raise a KeyError / ValueError naming the column, its shape and the expected one, on
        every rank), and ``micro_batch``: every tensor of the batch sliced to the micro-batch, on
        the engine's device. It returns (mean loss over the micro-batch's units, metrics). See
        the module docstring for the weighting. ``temperature`` (a finite number > 0, else ValueError, as in
        ``compute_log_prob``) divides the logits. Returns global metrics: loss, the loss_fn
        metrics, grad_norm (before clipping), lr, tokens, rows, micro_batches, step, skipped
        (1.0 when the gradient was not finite and the update was skipped). A batch with no response token on any
        rank is not trained on: no forward, no optimizer step (no momentum or weight decay), the schedule does not
        advance; it returns loss 0, grad_norm 0, skipped 1 (no loss_fn metrics) and rank 0 logs a warning. A
        ``loss_fn`` that raises on any rank (or returns a loss with ``requires_grad`` False) makes every rank raise
        before that micro-batch's backward, with no step taken (module docstring).
        """
        self._check_ready("train_step")
        _check_temperature(temperature, "train_step")
        self._check_outputs_for(loss_fn, with_entropy)
        cfg = self.config
        rows, data, unreadable = self._read_batch(batch, None, "train_step")  # rows may be 0: see the docstring
        loss_scale = getattr(loss_fn, "loss_scale", None) or cfg.loss_scale
        # a metric is weighted by the units it is a mean over: the loss's, or those loss_fn.metric_scales names
        metric_scales: dict[str, str] = dict(getattr(loss_fn, "metric_scales", None) or {})
        scales = sorted({*metric_scales.values()} - {loss_scale})
        # a refused batch still enters the two all-reduces below (with zero counts), so that every rank raises
        problem = (unreadable or _lr_problem(lr, self._rank)
                   or _train_batch_problem(batch, data, rows, loss_fn, self._rank)
                   or _token_problem(data, self._vocab_size(), "train_step", self._rank))
        if problem is None:
            ranges = self._micro_ranges(rows, cfg.micro_batch_size)
            tok = [float(data["response_mask"][s:e].sum().item()) for s, e in ranges]
            units = _micro_units(loss_fn, cfg.loss_scale, data["response_mask"], ranges, tok)
            scale_units = {sc: _units_of(sc, data["response_mask"], ranges, tok, "a value of loss_fn.metric_scales")
                           for sc in scales}
        else:
            ranges, tok, units, scale_units = [], [], [], {sc: [] for sc in scales}
        with self._collective("train_step"):
            counts = torch.tensor([sum(units), sum(tok), float(rows), float(len(ranges)),
                                   *[sum(scale_units[sc]) for sc in scales]], dtype=torch.float64, device=self.device)
            if self._world > 1:
                dist.all_reduce(counts)
            n_global = self._global_micro_count(len(ranges), problem, "train_step")
            total_units, total_tokens, total_rows, total_micro, *scale_totals = counts.tolist()
            weights_by_scale = {loss_scale: (units, total_units),
                                **{sc: (scale_units[sc], t) for sc, t in zip(scales, scale_totals)}}
            if total_rows == 0:
                raise self._agree(ValueError("train_step: the batch has no rows on any rank; pass at least one row (a "
                                             "rank may hold none as long as another rank holds some)"))

            self.model.train()
            if lr is None:
                lr = self.lr
                if not (math.isfinite(lr) and lr >= 0):  # EngineConfig's checks make this unreachable; never step
                    raise self._agree(ValueError(f"train_step: the LR schedule gives lr={lr} at step {self.global_step}; "
                                                 f"check EngineConfig.lr and min_lr_ratio (config: {self.config})"))
            if total_tokens == 0:  # every rank knows it from the all-reduce: all return here, no collective is left
                log.log(logging.WARNING if self._rank == 0 else logging.DEBUG,
                        "train_step: the batch has no response token on any rank (response_mask is 0 everywhere in "
                        "%d rows); nothing to train on, so the optimizer step is skipped (skipped=1: no update, no "
                        "momentum or weight decay, the LR schedule stays at step %d)", int(total_rows),
                        self.global_step)
                return {"loss": 0.0, "grad_norm": 0.0, "lr": lr, "tokens": 0.0, "rows": total_rows,
                        "micro_batches": total_micro, "step": float(self.global_step), "skipped": 1.0}
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            metric_sums: dict[str, float] = {}
            for i in range(n_global):
                if cfg.accumulate_without_sync and self._world > 1:
                    self.model.set_requires_gradient_sync(i == n_global - 1)
                real = i < len(ranges)
                if real or ranges:
                    mb = slice_rows(data, *(ranges[i] if real else ranges[0]))
                else:  # this rank holds no rows: its dummy micro-batches run on one filler row
                    mb = _filler_row(data)
                outputs = self._forward(mb, temperature, with_entropy and self.model_kind == "causal_lm")
                if not real:  # keep collectives in step with ranks that have more micro-batches
                    self._agree_on_loss(None, i, data)
                    dummy = sum(v.sum() for v in outputs.values()) * 0.0
                    dummy.backward()
                    continue
                main = outputs["values"] if self.model_kind == "value" else outputs["log_probs"]
                w = units[i] / total_units if total_units > 0 else 0.0
                # a micro-batch with no unit of the loss (nor of any metric) weighs 0: loss_fn is not called (a mean
                # over no unit is 0/0 = NaN there, and NaN * 0 would poison the whole step's gradient); it still runs
                # the same backward (a finite zero through the outputs) so every rank issues the same collectives
                counts_here = units[i] > 0 or any(scale_units[sc][i] > 0 for sc in scales)
                if not counts_here:
                    self._agree_on_loss(None, i, data)
                    (main.sum() * 0.0).backward()
                    continue
                failure: BaseException | None = None
                try:
                    loss, metrics = loss_fn(outputs, mb)
                    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                        raise TypeError("loss_fn must return (scalar loss tensor, metrics dict)")
                    if not loss.requires_grad:
                        raise ValueError("train_step: loss_fn returned a loss that does not depend on the model's "
                                         "outputs (requires_grad is False); build it from the outputs it is given, and "
                                         "do not call train_step under torch.no_grad")
                    clash = sorted(_OWN_RESULTS.intersection(metrics or {}))
                    if clash:  # "loss" was added into the step's loss, the others overwritten by its own results
                        raise ValueError(f"train_step: loss_fn returned metric(s) {clash}, named like train_step's "
                                         f"own results {sorted(_OWN_RESULTS)}; rename them (e.g. 'pg_loss')")
                    values = {k: _metric_value(k, v) for k, v in (metrics or {}).items()}
                except Exception as e:  # noqa: BLE001 - raised below, on this rank and (named) on the others
                    failure = e
                self._agree_on_loss(failure, i, data)  # every rank, before any backward collective
                # the zero-weighted term makes every rank's backward reach every parameter, so that FSDP's gradient
                # collectives pair up even where the loss does not depend on the model (a constant zero loss). A
                # micro-batch with no loss unit (called for another scale's metrics) backprops only that zero term
                if units[i] > 0:
                    (loss * (w * self._world) + main.sum() * 0.0).backward()
                    metric_sums["loss"] = metric_sums.get("loss", 0.0) + w * float(loss.detach().item())
                else:
                    (main.sum() * 0.0).backward()
                for k, fv in values.items():
                    mu, mtotal = weights_by_scale[metric_scales.get(k, loss_scale)]
                    # a metric over no unit of its scale here (0/0 = NaN) weighs 0: adds 0, not NaN x 0 (the key stays:
                    # every rank sums the same names)
                    share = (mu[i] / mtotal if mtotal > 0 else 0.0) * fv if mu[i] > 0 else 0.0
                    metric_sums[k] = metric_sums.get(k, 0.0) + share
            if cfg.accumulate_without_sync and self._world > 1:
                self.model.set_requires_gradient_sync(True)

            max_norm = cfg.grad_clip if cfg.grad_clip is not None and cfg.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norm_f = float(grad_norm.item())
            skipped = not math.isfinite(grad_norm_f)
            if skipped:
                log.log(logging.WARNING if self._rank == 0 else logging.DEBUG,
                        "train_step: grad_norm=%s is not finite in optimizer step %d (this mini-batch: %d rows, %d "
                        "response tokens, %d micro-batches); the step is skipped (skipped=1: no update, the LR "
                        "schedule stays at step %d). A loss_fn that returns NaN/inf for some micro-batch (e.g. a mean "
                        "over a mask with no token: divide by mask.sum().clamp(min=1)), or too high a learning rate, "
                        "causes this", grad_norm_f, self.global_step + 1, int(total_rows), int(total_tokens),
                        int(total_micro), self.global_step)
            else:
                self.optimizer.step()
                self.global_step += 1
            self.optimizer.zero_grad(set_to_none=True)

            result = self._sum_by_name(metric_sums)
            result.update(
                grad_norm=grad_norm_f,
                lr=lr,
                tokens=total_tokens,
                rows=total_rows,
                micro_batches=total_micro,
                step=float(self.global_step),
                skipped=float(skipped),
            )
            return result

    def _sum_by_name(self, sums: Mapping[str, float]) -> dict[str, float]:
        """Sum each named value over the ranks (collective). The ranks first agree on the union of their names
        (``all_gather_object``); a name a rank lacks counts as 0 there, so values are never added across names."""
        keys = sorted(sums)
        if self._world > 1:
            gathered: list[Any] = [None] * self._world
            dist.all_gather_object(gathered, keys)
            keys = sorted(set().union(*gathered))
        vec = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64, device=self.device)
        if self._world > 1 and keys:
            dist.all_reduce(vec)
        return dict(zip(keys, vec.tolist()))

    # ------------------------------------------------------------------ state
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict on CPU. Collective: call on all ranks.

        With ``rank0_only`` (default) only rank 0 receives the tensors (others get ``{}``) and
        gathering goes layer by layer through CPU; otherwise every rank gets a full copy.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._check_ready("full_state_dict")
        with self._collective("full_state_dict"):
            if rank0_only:
                opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
                return get_model_state_dict(self.model, options=opts)
            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}

    def save(self, directory: str | os.PathLike) -> None:
        """Sharded checkpoint: this rank's model and optimizer shards as safetensors, layout and step in JSON
        (``engines.checkpoint``; nothing is pickled). Collective; ``directory`` must be visible to all ranks. A rank
        that cannot write its part raises ``CheckpointError`` on every rank, and the engine stays usable."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from engines.checkpoint import CheckpointError, model_record, save_sharded

        self._check_ready("save")
        # a rank that cannot write its part raises CheckpointError on every rank, and the engine goes on
        with self._collective("save", deterministic=(CheckpointError,)):
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            save_sharded(directory, model_sd, optim_sd, device=self.device,
                         engine_state={"global_step": self.global_step, "lr": self.lr, "model_kind": self.model_kind,
                                       "config": asdict(self.config),
                                       "model": model_record(self.model, self.model_kind)})

    def load(self, directory: str | os.PathLike, *, verify: bool = True) -> None:
        """Restore model, optimizer, step (hence the LR schedule) and, with the same DP size, RNG from
        :meth:`save`, written by any DP size. The running config's learning-rate schedule and AdamW weight_decay,
        betas and eps apply after the load (the optimizer moments are the checkpoint's); rank 0 logs a WARNING naming
        each one that differs from the checkpoint's. ``verify`` checks each file's size and sha256 against the index
        first. A missing, corrupt or mismatching checkpoint raises ``engines.checkpoint.CheckpointError``
        before the engine changes. Collective."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from engines.checkpoint import CheckpointError, load_sharded, model_record

        self._check_ready("load")
        # the checks agree across ranks (all load or none does); a failure after them, with this rank's shards half
        # overwritten, aborts: no rank may train on with a model that is part checkpoint, part old weights
        with self._collective("load", deterministic=(CheckpointError,)):
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = load_sharded(directory, model_sd, optim_sd, device=self.device, verify=verify,
                                 model=model_record(self.model, self.model_kind))
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            self.global_step = int(state["global_step"])
            _warn_schedule_change(state.get("config"), self.config, directory, self._rank)
            _apply_optimizer_hparams(self.optimizer, self.config, directory, self._rank)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr

    # ------------------------------------------------------------------ memory
    def _state_bytes(self) -> int:
        n = 0
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            n += local.numel() * local.element_size()
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    local = v.to_local() if hasattr(v, "to_local") else v
                    n += local.numel() * local.element_size()
        return n

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for st in self.optimizer.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and k != "step":
                    st[k] = v.to(device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def offload(self) -> int:
        """Move parameters (this rank's shards) and optimizer state to host memory.

        Returns the bytes moved. On a CPU engine nothing moves and 0 is returned. While
        offloaded, compute calls raise; call :meth:`onload` first.
        """
        if self._offloaded or self.device.type == "cpu":
            self._offloaded = self.device.type != "cpu"
            return 0
        self.optimizer.zero_grad(set_to_none=True)
        moved = self._state_bytes()
        self._move(torch.device("cpu"))
        torch.cuda.empty_cache()
        self._offloaded = True
        return moved

    def onload(self) -> int:
        """Move parameters and optimizer state back to the device; returns bytes moved (0 on CPU)."""
        if not self._offloaded:
            return 0
        self._move(self.device)
        self._offloaded = False
        return self._state_bytes()
