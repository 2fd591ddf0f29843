"""With ``runner.max_staleness=1`` the next step's prompts are drawn before a checkpoint is written. A resume from
that checkpoint trains each step on the prompts the uninterrupted run drew for it: before, the sampler state in
the checkpoint already counted the next batch, so a resume skipped one batch of prompts and every later step
trained on other data, silently."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from local_jobs import local_runner

from pipelines.runner import Runner

STALE = ("runner.max_staleness=1", "runner.checkpoint_every=1", "runner.total_steps=3")


@pytest.mark.slow  # two real (in-process) jobs, ~10 s
async def test_a_resume_trains_each_step_on_the_prompts_the_interrupted_run_drew(tmp_path, monkeypatch):
    drawn: dict[str, dict[int, Any]] = {}
    launch = Runner._launch

    def recording(self: Runner, step: int) -> Any:
        out = launch(self, step)
        drawn[self.out.name][step] = out.prompts["prompts"].tolist()
        return out

    monkeypatch.setattr(Runner, "_launch", recording)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    drawn["whole"], drawn["resumed"] = {}, {}
    await local_runner(whole, *STALE).run()
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000000", resumed / "checkpoints" / "step_000000")
    (resumed / "checkpoints" / "latest").write_text("step_000000")
    hist = await local_runner(resumed, *STALE, resume=True).run()
    assert [h["step"] for h in hist] == [1, 2]
    assert sorted(drawn["whole"]) == [0, 1, 2] and sorted(drawn["resumed"]) == [1, 2]
    assert len({str(p) for p in drawn["whole"].values()}) == 3  # three different batches: equality means something
    for step in (1, 2):
        assert drawn["resumed"][step] == drawn["whole"][step], f"step {step} trained on other prompts"


@pytest.mark.slow  # two real (in-process) jobs, ~10 s
@pytest.mark.parametrize("algo", [(), ("algorithm.adv_estimator=remax",)], ids=["grpo", "remax"])
async def test_a_resume_with_frozen_weights_samples_what_the_uninterrupted_run_sampled(tmp_path, algo):
    """The checkpoint's generate-call counter already counted the rollout launched ahead (and thrown away: a resume
    generates it again), so every resumed step sampled with the seed of the uninterrupted run's next step. With the
    weights frozen (lr 1e-30) nothing else differs, so the resumed steps must equal the uninterrupted ones."""
    frozen = (*STALE, "actor.lr=1e-30", *algo)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    full = await local_runner(whole, *frozen).run()
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000000", resumed / "checkpoints" / "step_000000")
    (resumed / "checkpoints" / "latest").write_text("step_000000")
    hist = await local_runner(resumed, *frozen, resume=True).run()
    keys = [k for k in full[1] if k.startswith(("reward/", "response_length/")) or k == "actor/tokens"]
    assert keys
    for a, b in zip(full[1:], hist):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}, f"step {a['step']}"
