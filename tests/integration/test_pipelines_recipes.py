"""The DAPO and ReMax example configs run end to end (2 steps, tiny batch) on a real local Ray cluster: DAPO's
dynamic sampling launches extra rounds and trains on a full batch of kept groups; ReMax's greedy rollout is
generated, scored and used as the baseline (here on the harder addition task)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.runner import Runner

ROOT = Path(__file__).resolve().parents[2]
TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=2", "runner.total_steps=2", "runner.checkpoint_every=0", "runner.plot=false",
        "task.params={format_bonus: 0.5}"]


async def _run(example: str, overrides: list[str]) -> list[dict]:
    cfg = load_config(ROOT / "examples" / example, [*TINY, *overrides])
    return await Runner(cfg, progress=False).run()


@pytest.mark.slow
async def test_dapo_example_samples_until_the_batch_is_full(tmp_path):
    hist = await _run("dapo_digits.yaml", [f"runner.output_dir={tmp_path}"])
    assert [h["step"] for h in hist] == [0, 1]
    for h in hist:
        kept, trained = h["dynamic_sampling/kept_groups"], h["dynamic_sampling/trained_groups"]
        assert h["dynamic_sampling/groups"] == kept + h["dynamic_sampling/dropped_groups"] >= 8
        assert 1 <= h["dynamic_sampling/rounds"] <= 4  # the first round and at most 3 extra
        # a full batch of kept groups, or the bound was hit and said so
        assert trained == 8 or (h["dynamic_sampling/bound_hit"] == 1 and trained == kept)
        # actor/rows counts the update's rows once (over its 4 mini-batches): n=4 rows a group
        assert h["actor/rows"] == 4 * (trained + h["dynamic_sampling/filler_groups"])
        assert h["actor/optimizer_steps"] == 16 and "reward/overlong_penalty" in h
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "dynamic_sampling/keep_rate" in recs[-1]


@pytest.mark.slow
async def test_remax_example_on_the_addition_task(tmp_path):
    hist = await _run("remax_digits.yaml", [f"runner.output_dir={tmp_path}", "task.name=addition",
                                            "rollout.max_new_tokens=4", "rollout.n=2"])
    assert [h["step"] for h in hist] == [0, 1]
    for h in hist:
        # 8 prompts x 2 samples (in 4 mini-batches: actor/rows counts the update's rows once)
        assert 0.0 <= h["reward/greedy_mean"] <= 1.0 and h["actor/rows"] == 16
        assert "time/greedy_reward" in h and h["actor/weights_version"] == h["step"] + 1


@pytest.mark.parametrize("example", ["dapo_digits.yaml", "remax_digits.yaml"])
async def test_recipe_resumes_exactly(tmp_path, example):
    """4 steps in one go and 2 + resume-to-4 from the step-1 checkpoint give the same steps 2-3: DAPO's extra
    sampling rounds draw from the restored sampler and RNG, ReMax's greedy rollouts from the restored weights."""
    # a run of 2 steps extended to 4 by the resume (a changed total_steps; tests/integration/test_pipelines.py resumes
    # an unchanged config). Constant LR: the cut run's cosine would end at its own total_steps=2
    common = ["runner.checkpoint_every=2", "actor.lr_schedule=constant", "actor.min_lr_ratio=0",  # (cosine's only)
              "resources.backend=local", "resources.actor_workers=1", "resources.rollout_workers=1"]
    if example == "dapo_digits.yaml":  # groups of 2 are often all-equal: extra rounds at every step, not by chance
        common.append("rollout.n=2")
    full = await _run(example, [*common, "runner.total_steps=4", f"runner.output_dir={tmp_path / 'full'}"])
    await _run(example, [*common, "runner.total_steps=2", f"runner.output_dir={tmp_path / 'cut'}"])
    cfg = load_config(ROOT / "examples" / example,
                      [*TINY, *common, "runner.total_steps=4", f"runner.output_dir={tmp_path / 'cut'}"])
    resumed = await Runner(cfg, resume=True, progress=False).run()
    assert [r["step"] for r in resumed] == [2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in full[2:])  # it trains, so equality means something
    if example == "dapo_digits.yaml":
        assert sum(r["dynamic_sampling/rounds"] for r in full[2:]) > 2  # extra rounds were drawn after the cut
    skip = ("time", "perf/")
    for a, b in zip(full[2:], resumed):
        keys = [k for k in a if not k.startswith(skip) and "seconds" not in k]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


async def test_resume_with_a_changed_config_says_what_changed(tmp_path, caplog):
    """A resumed run with other training settings is not the interrupted run continued: the runner logs each
    changed key against the config the checkpoint was written with (here ``runner.total_steps``, which moves the
    cosine schedule's end, and ``actor.lr``), even after a failed resume attempt rewrote ``config.json``; keys that
    change only reporting (``runner.plot``) are not listed."""
    from pipelines.checkpoint import CheckpointError

    common = ["runner.checkpoint_every=1", "resources.backend=local", "resources.actor_workers=1",
              "resources.rollout_workers=1", f"runner.output_dir={tmp_path}"]

    def cfg(*more: str):
        return load_config(ROOT / "examples" / "remax_digits.yaml", [*TINY, *common, *more])

    await Runner(cfg("runner.total_steps=1"), progress=False).run()
    with pytest.raises(CheckpointError):  # a model that does not fit the checkpoint: the attempt fails
        await Runner(cfg("runner.total_steps=2", "model.hidden_size=32"), resume=True, progress=False).run()
    caplog.clear()
    with caplog.at_level("WARNING", logger="orchestra"):
        await Runner(cfg("runner.total_steps=2", "actor.lr=0.01", "runner.plot=true"), resume=True,
                     progress=False).run()
    msgs = [r.getMessage() for r in caplog.records if "--resume with a changed config" in r.getMessage()]
    assert len(msgs) == 1 and "LR schedule" in msgs[0]
    assert "runner.total_steps: 1 -> 2" in msgs[0] and "actor.lr: 0.002 -> 0.01" in msgs[0]
    assert "hidden_size" not in msgs[0] and "runner.plot" not in msgs[0]
