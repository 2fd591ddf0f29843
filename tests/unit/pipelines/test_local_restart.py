"""An elastic restart of an in-process job (``resources.backend=local``) needs no Ray: its pools take no node
capacity, so the restart does not ask a Ray cluster (there is none) whether they fit again."""

from __future__ import annotations

import json
from typing import Any

import pytest
import ray

from pipelines.config import load_config
from pipelines.runner import Runner

TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=1", "resources.backend=local", "resources.actor_workers=1",
        "resources.rollout_workers=1", "task.params={format_bonus: 0.5}", "runner.checkpoint_every=0",
        "runner.max_restarts=1", "runner.total_steps=2"]


@pytest.mark.slow  # a real (in-process) job, ~5 s
async def test_an_in_process_job_restarts_after_a_death_without_ray(tmp_path, monkeypatch):
    from orchestra.testing import kill_rank

    def no_ray() -> list:  # what ray.nodes() does in a process without Ray, whatever this test session started
        raise ray.exceptions.RaySystemError("Ray has not been started yet")

    monkeypatch.setattr(ray, "nodes", no_ray)
    runner = Runner(load_config(None, [*TINY, f"runner.output_dir={tmp_path}"]), progress=False)
    step_fn, killed = runner.step_fn, []

    async def step_killing_the_actor_once_at_step_1(ctx: Any, rollouts: Any) -> dict:
        if ctx.step == 1 and not killed:
            killed.append(ctx.cluster.actor)  # before the kill: supervision cancels this step once it reports it
            await kill_rank(ctx.cluster.actor, 0)
        return await step_fn(ctx, rollouts)

    runner.step_fn = step_killing_the_actor_once_at_step_1
    hist = await runner.run()
    assert [h["step"] for h in hist] == [0, 1]
    events = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "event" in r]
    assert [(e["event"], e["step"], e["restart"]) for e in events] == [("restart", 1, 1)]
