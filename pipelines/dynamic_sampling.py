"""DAPO's dynamic sampling as a pipeline stage: drop the prompt groups whose rewards are all equal and keep
sampling fresh prompts, a bounded number of extra rounds, until the step has ``data.prompts_per_step`` groups.

Each round's reward stage streams over its rollout parts; as soon as a round's scores are in, the next round (sized
by the keep rate seen so far) is launched with the current weights. The kept rows are gathered by the controller
(the update needs one batch of a variable make-up); with the tiny models here that is a few hundred KB a step.
When ``algorithm.dynamic_sampling_max_rounds`` extra rounds are used up the step trains on the groups it kept and
says so (``dynamic_sampling/bound_hit``, a log line); it never trains on nothing: below the rows the update needs
(a row per mini-batch on every actor rank) it tops up with dropped groups, whose advantages are 0
(``dynamic_sampling/filler_groups``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from orchestra import Batch, DataFuture

from .algorithms import dynamic_sampling_filter
from .stage import StepContext

__all__ = ["SampledGroups", "dynamic_sampling", "groups_to_train", "left_pad_prompts", "next_round_prompts"]

log = logging.getLogger("orchestra")

_PROMPT_COLUMNS = ("prompts", "input_ids", "attention_mask")  # the prompt is the left part of these


@dataclass(frozen=True)
class SampledGroups:
    """What the stage hands to the update: the chosen groups' rollout rows and reward columns (row-aligned,
    prompt-major, ``rollout.n`` rows a group), every sampled row's score, and the ``dynamic_sampling/*`` metrics."""

    rollouts: Batch
    scores: Batch
    sampled_scores: Tensor
    metrics: dict[str, float]


def next_round_prompts(missing: int, kept: int, seen: int, *, cap: int, multiple: int = 1) -> int:
    """Prompts the next round samples to replace ``missing`` groups: ``missing`` divided by the keep rate so far
    (``kept / seen`` groups; ``cap`` when nothing was kept yet), rounded up to a multiple of ``multiple`` (the
    rollout workers, so that each gets a row) and kept within ``[multiple, cap]`` (``cap`` rounded up too)."""
    if missing < 1 or cap < 1 or multiple < 1 or kept < 0 or seen < kept:
        raise ValueError(f"next_round_prompts: need missing, cap, multiple >= 1 and 0 <= kept <= seen; got "
                         f"missing={missing}, kept={kept}, seen={seen}, cap={cap}, multiple={multiple}")
    want = cap if kept == 0 else math.ceil(missing * seen / kept)
    top = math.ceil(cap / multiple) * multiple
    return min(max(math.ceil(want / multiple) * multiple, multiple), top)


def groups_to_train(kept: int, dropped: int, target: int, min_groups: int) -> tuple[int, int]:
    """``(kept groups trained on, dropped groups added as filler)``: at most ``target`` kept groups; filler only
    to reach ``min_groups`` (the update's minimum), as far as ``dropped`` groups allow."""
    if min(kept, dropped, target, min_groups) < 0:
        raise ValueError(f"groups_to_train: counts must be >= 0, got {kept}, {dropped}, {target}, {min_groups}")
    take = min(kept, target)
    return take, min(max(min_groups - take, 0), dropped)


def left_pad_prompts(batch: Batch, width: int, pad_id: int) -> Batch:
    """``batch`` with its prompt part left-padded to ``width`` tokens (pad in ``prompts``/``input_ids``, 0 in
    ``attention_mask``), so that rounds with different prompt widths concatenate; positions come from the mask."""
    have = batch["prompts"].shape[1]
    if have > width:
        raise ValueError(f"left_pad_prompts: prompts are {have} wide, more than width={width}")
    if have == width:
        return batch
    cols = {k: torch.nn.functional.pad(batch[k], (width - have, 0), value=0 if k == "attention_mask" else pad_id)
            for k in _PROMPT_COLUMNS if k in batch}
    return batch | Batch.from_dict(cols)


def _concat(parts: list[Batch], pad_id: int) -> Batch:
    width = max(p["prompts"].shape[1] for p in parts)
    return Batch.concat([left_pad_prompts(p, width, pad_id) for p in parts])


async def dynamic_sampling(ctx: StepContext, rollouts: DataFuture) -> SampledGroups:
    """Score ``rollouts`` (the step's first round), drop all-equal groups and sample more rounds (at most
    ``algorithm.dynamic_sampling_max_rounds``) until ``data.prompts_per_step`` groups are kept."""
    cfg, c = ctx.cfg, ctx.cluster
    n, target, max_rounds = cfg.rollout.n, cfg.data.prompts_per_step, cfg.algorithm.dynamic_sampling_max_rounds
    min_groups = math.ceil(cfg.resources.actor_workers * cfg.actor.mini_batches / n)
    pad_id = 0  # under attention_mask 0, so any valid token id
    kept_r: list[Batch] = []
    kept_s: list[Batch] = []
    dropped_r: list[Batch] = []
    dropped_s: list[Batch] = []
    sampled: list[Tensor] = []
    kept = seen = extra = 0
    fut = rollouts
    while True:
        scores_f = ctx.stage("reward" if extra == 0 else f"reward_round{extra}",
                             c.reward.score.options(stream=True)(fut))
        rows, scored = await fut, await scores_f
        s = scored["scores"]
        sampled.append(s)
        f = dynamic_sampling_filter(s, group_size=n)
        kept_r.append(rows[f.keep])
        kept_s.append(scored[f.keep])
        dropped_r.append(rows[~f.keep])
        dropped_s.append(scored[~f.keep])
        kept, seen = kept + f.kept_groups, seen + f.groups
        if kept >= target or extra >= max_rounds:
            break
        if ctx.sample_more is None:
            raise RuntimeError("dynamic sampling needs StepContext.sample_more to launch more rollouts; run the "
                               "step through pipelines.runner.Runner")
        extra += 1
        fut = ctx.sample_more(next_round_prompts(target - kept, kept, seen, cap=target,
                                                 multiple=cfg.resources.rollout_workers))
    take, filler = groups_to_train(kept, seen - kept, target, min_groups)
    bound_hit = kept < target
    if bound_hit:
        log.warning("step %d: dynamic sampling kept %d of %d groups after %d extra round(s) "
                    "(algorithm.dynamic_sampling_max_rounds=%d); training on those%s", ctx.step, kept, target,
                    extra, max_rounds, f" plus {filler} all-equal group(s) to fill the update" if filler else "")
    parts_r, parts_s = [], []
    if take:
        parts_r.append(_concat([p for p in kept_r if len(p)], pad_id)[: take * n])
        parts_s.append(Batch.concat([p for p in kept_s if len(p)])[: take * n])
    if filler:
        parts_r.append(_concat([p for p in dropped_r if len(p)], pad_id)[: filler * n])
        parts_s.append(Batch.concat([p for p in dropped_s if len(p)])[: filler * n])
    chosen_s = Batch.concat(parts_s)
    metrics = {"dynamic_sampling/rounds": float(extra + 1), "dynamic_sampling/extra_rounds": float(extra),
               "dynamic_sampling/groups": float(seen), "dynamic_sampling/kept_groups": float(kept),
               "dynamic_sampling/dropped_groups": float(seen - kept), "dynamic_sampling/trained_groups": float(take),
               "dynamic_sampling/filler_groups": float(filler), "dynamic_sampling/bound_hit": float(bound_hit),
               "dynamic_sampling/keep_rate": kept / max(seen, 1),
               "dynamic_sampling/trained_reward_mean": float(chosen_s["scores"].double().mean())}
    return SampledGroups(rollouts=_concat(parts_r, pad_id), scores=chosen_s, sampled_scores=torch.cat(sampled),
                         metrics=metrics)
