"""Each generate call the runner makes is seeded by what it is (its step, and its round: DAPO's extra sampling rounds;
ReMax's greedy rollout apart), not by how many calls its rank made before it. With ``runner.max_staleness=1`` the
next step's rollout is launched before the step's DAPO rounds, so a per-rank running count saved in a checkpoint
(less the one call launched ahead) named the wrong calls: the resumed steps sampled with other seeds than the
uninterrupted run (docs/checkpoints.md: a frozen-weights ``max_staleness=1`` resume is identical)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

import pipelines.runner as runner_mod
from engines.workers import generation_seed
from fake_engine_ckpt import FakeCluster, write_engine_checkpoint
from local_jobs import local_runner
from pipelines.config import load_config
from pipelines.runner import Runner

STALE = ("runner.max_staleness=1", "runner.checkpoint_every=1", "runner.total_steps=3")
ROUNDS = {0: 2, 1: 1, 2: 2}  # extra sampling rounds each step of the fake DAPO step makes


class _Rollouts:
    """A generate call's result for a step that never reads it."""

    def cancel(self) -> None:
        return None


class SeedingRollout:
    """A colocated actor group whose ``generate`` seeds each call as the rollout workers do (``generation_seed`` of
    the base seed, the DP rank and the call's key, or the rank's running count of calls when none is given) and logs
    (what was asked, the seed); ``save`` / ``load`` keep the running count as the workers do (less the
    ``pending_generate_calls`` the runner names)."""

    def __init__(self, log: list[tuple[Any, int]]) -> None:
        self.log, self.calls = log, 0

    def generate(self, batch: Any, micro_batches: int = 1, seed: int = 0, call: Any = None, **overrides: Any) -> Any:
        key = self.calls if call is None else call
        self.calls += 1
        asked = (json.dumps(batch["prompts"].tolist()), json.dumps(overrides, sort_keys=True))
        self.log.append((asked, generation_seed(seed, 0, key)))
        return _Rollouts()

    async def save(self, directory: str, pending_generate_calls: int = 0) -> str:
        write_engine_checkpoint(directory)
        (Path(directory) / "calls.json").write_text(json.dumps(self.calls - pending_generate_calls))
        return directory

    async def load(self, directory: str, verify: bool = True) -> int:
        self.calls = json.loads((Path(directory) / "calls.json").read_text())
        return 0


class SeedingCluster(FakeCluster):
    """A cluster of one :class:`SeedingRollout` actor, the rollout colocated with it."""

    def __init__(self, log: list[tuple[Any, int]]) -> None:
        self.actor = self.rollout = SeedingRollout(log)


async def _fake_dapo(ctx: Any, rollouts: Any) -> dict[str, float]:
    """A DAPO-like step: ``ROUNDS[step]`` extra sampling rounds of 3 prompts, no update."""
    for _ in range(ROUNDS[ctx.step]):
        ctx.sample_more(3)
    return {"reward/mean": 0.0}


async def _fake_run(out: Path, monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...],
                    resume: bool = False) -> list[tuple[Any, int]]:
    """Run (or resume) a 3-step job of the fake DAPO step on a :class:`SeedingCluster`; the calls' log."""
    log: list[tuple[Any, int]] = []
    monkeypatch.setattr(runner_mod, "build_cluster", lambda cfg, task: SeedingCluster(log))
    cfg = load_config(None, [f"runner.output_dir={out}", "resources.backend=local", "data.prompts_per_step=4",
                             *STALE, *extra])
    r = Runner(cfg, resume=resume, progress=False)
    r.step_fn = _fake_dapo
    await r.run()
    return log


def _resume_dir(whole: Path, resumed: Path) -> None:
    """``resumed``: an output dir holding only ``whole``'s checkpoint after step 0."""
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_000000", resumed / "checkpoints" / "step_000000")
    (resumed / "checkpoints" / "latest").write_text("step_000000")


@pytest.mark.parametrize("extra", [(), ("algorithm.adv_estimator=remax",)], ids=["rounds", "rounds+greedy"])
async def test_a_stale_resume_with_extra_rounds_seeds_every_call_as_the_uninterrupted_run(tmp_path, monkeypatch,
                                                                                          extra):
    whole = await _fake_run(tmp_path / "whole", monkeypatch, extra)
    _resume_dir(tmp_path / "whole", tmp_path / "resumed")
    resumed = await _fake_run(tmp_path / "resumed", monkeypatch, extra, resume=True)
    seeds = dict(whole)
    assert len(seeds) == len(whole) and len(set(seeds.values())) == len(whole)  # each call its own seed
    # resumed: step 1's and 2's rollouts, step 1's round and step 2's two rounds (ReMax: and their greedy rollouts)
    assert len(resumed) == (2 + ROUNDS[1] + ROUNDS[2]) + (2 if extra else 0)
    for asked, seed in resumed:
        assert asked in seeds, "the resumed run asked for a call the uninterrupted run never made"
        assert seed == seeds[asked], "a resumed call sampled with another seed than the uninterrupted run's"


async def test_a_checkpoint_from_before_keyed_seeds_resumes_with_a_warning(tmp_path, caplog):
    """A checkpoint written when the seeds came from per-rank counters resumes (the counters are loaded, unused);
    the resumed steps cannot sample what the interrupted run would have, and a warning says so."""
    cfg = load_config(None, [f"runner.output_dir={tmp_path / 'run'}"])
    first = Runner(cfg, progress=False)
    first.cluster = FakeCluster()
    saved = await first.save(3)
    state = json.loads((saved / "runner.json").read_text())
    assert state.pop("generate_seeds") == "step-round"
    second = Runner(cfg, progress=False, resume_from=saved)
    second.cluster = FakeCluster()
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        await second._restore(state)
    assert second.start_step == 4
    assert any("seeded" in r.getMessage() and "counter" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    third = Runner(cfg, progress=False, resume_from=saved)
    third.cluster = FakeCluster()
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        await third._restore()
    assert not any("counter" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # two real (in-process) DAPO jobs, ~5 s
async def test_a_frozen_dapo_stale_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """End to end: DAPO with max_staleness=1 and frozen weights, its step 0 using an extra round after step 1's
    rollout was launched; the resumed steps' rewards, tokens and dynamic-sampling counts equal the uninterrupted
    run's."""
    frozen = (*STALE, "algorithm.name=dapo", "actor.lr=1e-30", "algorithm.dynamic_sampling_max_rounds=2")
    rounds: dict[str, list[int]] = {}
    sample_more = Runner._sample_more

    def recording(self: Runner, step: int, count: int) -> Any:
        rounds.setdefault(self.out.name, []).append(step)
        return sample_more(self, step, count)

    monkeypatch.setattr(Runner, "_sample_more", recording)
    full = await local_runner(tmp_path / "whole", *frozen).run()
    assert 0 in rounds.get("whole", []), f"step 0 made no extra round, so this tests nothing: {rounds}"
    _resume_dir(tmp_path / "whole", tmp_path / "resumed")
    hist = await local_runner(tmp_path / "resumed", *frozen, resume=True).run()
    keys = [k for k in full[1] if k.startswith(("reward/", "response_length/", "dynamic_sampling/"))
            or k == "actor/tokens"]
    assert [h["step"] for h in hist] == [1, 2] and keys
    for a, b in zip(full[1:], hist):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}, f"step {a['step']}"
