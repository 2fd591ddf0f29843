"""Tiny in-process training jobs (``resources.backend=local``: no Ray) for the runner's tests, and a step that kills
the actor's rank once, from inside the run, at a chosen step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelines.config import load_config
from pipelines.runner import Runner

# one actor and one rollout rank in this process, 8 prompts x 4 samples a step: a step takes about a second
LOCAL_TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
              "runner.micro_batches_per_step=1", "resources.backend=local", "resources.actor_workers=1",
              "resources.rollout_workers=1", "task.params={format_bonus: 0.5}"]


def local_runner(out: Path, *overrides: str, resume: bool = False) -> Runner:
    """A Runner of ``LOCAL_TINY`` plus ``overrides``, writing into ``out``."""
    return Runner(load_config(None, [*LOCAL_TINY, *overrides, f"runner.output_dir={out}"]), resume=resume,
                  progress=False)


def kill_actor_once_at(runner: Runner, step: int) -> list[Any]:
    """Make ``runner``'s step ``step`` kill actor rank 0 (and wait until the group reports it) the first time it
    runs, then go on as the step would. Returns the list the killed group is put into, before the kill: the
    supervision that reports the death cancels the step, so nothing after the kill runs."""
    from orchestra.testing import kill_rank

    step_fn, killed = runner.step_fn, []

    async def killing_step(ctx: Any, rollouts: Any) -> dict:
        if ctx.step == step and not killed:
            killed.append(ctx.cluster.actor)
            await kill_rank(ctx.cluster.actor, 0)
        return await step_fn(ctx, rollouts)

    runner.step_fn = killing_step
    return killed
