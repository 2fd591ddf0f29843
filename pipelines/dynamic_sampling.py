"""DAPO's dynamic sampling as a pipeline stage: drop the prompt groups whose rewards are all equal and keep
sampling fresh prompts, a bounded number of extra rounds, until the step has ``data.prompts_per_step`` groups.

Each round's reward stage streams over its rollout parts; as soon as a round's scores are in, the next round (sized
by the keep rate seen so far) is launched with the current weights. The controller decides from the scores alone
(a float per row); the kept rows are gathered worker to worker (``AdvantageWorker.gather_groups`` reads each
round's rollout future from the rollout workers), so no rollout row passes through the controller.
When ``algorithm.dynamic_sampling_max_rounds`` extra rounds are used up the step trains on the groups it kept and
says so (``dynamic_sampling/bound_hit``, a log line); it never trains on nothing: below the rows the update needs
(a row per mini-batch on every actor rank) it tops up with dropped groups, whose advantages are 0
(``dynamic_sampling/filler_groups``; ``SampledGroups.filler`` marks their rows, and the update zeroes their
advantages after any score shaping and whitening).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from orchestra import Batch, DataFuture

from .advantage_worker import gather_groups, left_pad_prompts
from .algorithms import dynamic_sampling_filter
from .stage import StepContext

__all__ = ["SampledGroups", "dynamic_sampling", "gather_groups", "groups_to_train", "left_pad_prompts",
           "next_round_prompts"]

log = logging.getLogger("orchestra")

@dataclass(frozen=True)
class SampledGroups:
    """What the stage hands to the update: the chosen groups' rollout rows (a future of the gather, on the workers)
    and reward columns (row-aligned, prompt-major, ``rollout.n`` rows a group), every sampled row's score, the
    ``dynamic_sampling/*`` metrics, and ``filler`` (bool [rows], row-aligned with ``scores``): the rows of dropped
    groups that only fill the update, whose advantages the update must hold at exactly 0."""

    rollouts: DataFuture
    scores: Batch
    sampled_scores: Tensor
    metrics: dict[str, float]
    filler: Tensor


def next_round_prompts(missing: int, kept: int, seen: int, *, cap: int, multiple: int = 1) -> int:
    """Prompts the next round samples to replace ``missing`` groups: ``missing`` divided by the keep rate so far
    (``kept / seen`` groups; ``cap`` when nothing was kept yet), rounded up to a multiple of ``multiple`` (the
    rollout workers, so that each gets a row) and kept within ``[multiple, cap]`` (``cap`` rounded up too). The runner
    draws at most an epoch of records (``Runner._sample_more``): rounded up, a round can ask for more than short
    data holds, and one draw never holds a record twice."""
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


def _picks(masks: list[Tensor], limit: int) -> list[tuple[int, list[int]]]:
    """The first ``limit`` rows where ``masks`` are True, in round order, as (round, row indices)."""
    out = []
    for r, m in enumerate(masks):
        if limit <= 0:
            break
        rows = torch.nonzero(m).flatten()[:limit].tolist()
        if rows:
            out.append((r, rows))
            limit -= len(rows)
    return out


async def dynamic_sampling(ctx: StepContext, rollouts: DataFuture) -> SampledGroups:
    """Score ``rollouts`` (the step's first round), drop all-equal groups and sample more rounds (at most
    ``algorithm.dynamic_sampling_max_rounds``) until ``data.prompts_per_step`` groups are kept."""
    cfg, c = ctx.cfg, ctx.cluster
    n, target, max_rounds = cfg.rollout.n, cfg.data.prompts_per_step, cfg.algorithm.dynamic_sampling_max_rounds
    min_groups = math.ceil(cfg.resources.actor_workers * cfg.actor.mini_batches / n)
    pad_id = 0  # under attention_mask 0, so any valid token id
    rounds: list[DataFuture] = []  # each round's rollout rows: stay on the rollout workers
    round_scores: list[Batch] = []  # each round's reward columns: small, read by the controller
    keeps: list[Tensor] = []  # per round: which rows belong to kept groups
    sampled: list[Tensor] = []
    kept = seen = extra = 0
    fut = rollouts
    while True:
        scores_f = ctx.stage("reward" if extra == 0 else f"reward_round{extra}",
                             c.reward.score.options(stream=True)(fut))
        scored = await scores_f  # the scores alone decide; the rows are never fetched here
        s = scored["scores"]
        sampled.append(s)
        f = dynamic_sampling_filter(s, group_size=n)
        rounds.append(fut)
        round_scores.append(scored)
        keeps.append(f.keep)
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
    kept_picks, filler_picks = _picks(keeps, take * n), _picks([~k for k in keeps], filler * n)
    picks = kept_picks + filler_picks
    kept_rows = sum(len(rows) for _, rows in kept_picks)
    is_filler = torch.arange(kept_rows + sum(len(rows) for _, rows in filler_picks)) >= kept_rows
    chosen_s = Batch.concat([round_scores[r][rows] for r, rows in picks])
    chosen_r = c.advantage.gather_groups(*rounds, picks=picks, pad_id=pad_id)
    metrics = {"dynamic_sampling/rounds": float(extra + 1), "dynamic_sampling/extra_rounds": float(extra),
               "dynamic_sampling/groups": float(seen), "dynamic_sampling/kept_groups": float(kept),
               "dynamic_sampling/dropped_groups": float(seen - kept), "dynamic_sampling/trained_groups": float(take),
               "dynamic_sampling/filler_groups": float(filler), "dynamic_sampling/bound_hit": float(bound_hit),
               "dynamic_sampling/keep_rate": kept / max(seen, 1),
               "dynamic_sampling/trained_reward_mean": float(chosen_s["scores"].double().mean())}
    return SampledGroups(rollouts=chosen_r, scores=chosen_s, sampled_scores=torch.cat(sampled), metrics=metrics,
                         filler=is_filler)
