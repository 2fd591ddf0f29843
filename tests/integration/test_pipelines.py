"""End-to-end GRPO and PPO runs on a real local Ray cluster: metrics, trace, checkpoints, resume, config errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipelines.checkpoint import LATEST
from pipelines.cli import main as cli_main
from pipelines.config import load_config
from pipelines.runner import Runner

TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=2", "resources.actor_workers=2", "resources.rollout_workers=2",
        "task.params={format_bonus: 0.5}"]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


async def _run(overrides: list[str], resume: bool = False) -> list[dict]:
    return await Runner(load_config(None, overrides), resume=resume, progress=False).run()


# one 4-step GRPO run on the cluster, shared: the end-to-end checks read its outputs and the resume test continues
# a copy of it from its step-1 checkpoint (each Runner run starts worker processes that import torch: seconds each)
GRPO = [*TINY, "runner.total_steps=4", "runner.trace=true", "runner.plot=true", "runner.checkpoint_every=2"]


@pytest.fixture(scope="module")
async def grpo_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """``(output_dir, history)`` of the 4-step GRPO run (trace, plot, checkpoints after steps 1 and 3)."""
    out = tmp_path_factory.mktemp("grpo") / "grpo"
    return out, await _run([*GRPO, f"runner.output_dir={out}"])


async def test_grpo_end_to_end_with_trace_and_checkpoint(grpo_run):
    out, hist = grpo_run
    assert [h["step"] for h in hist] == [0, 1, 2, 3]
    recs = _metrics(out)
    assert len(recs) == 4
    for r in recs:
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["actor/tokens"] > 0 and r["actor/rows"] == 32 and r["staleness"] == 0
        assert "time/update_actor" in r and "perf/tokens_per_s" in r
    assert recs[-1]["actor/weights_version"] == 4
    assert (out / "checkpoints" / "latest").read_text() == "step_000003"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000003"]
    assert (out / "reward.png").stat().st_size > 1000
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    spans = {e["name"] for e in events if e["ph"] == "X"}
    assert {"actor.generate[0]", "actor.generate[1]", "actor.compute_log_prob", "reward.score",
            "actor.update_actor", "step 0", "update_actor"} <= spans
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert flows and all(e["args"]["bytes"] > 0 for e in flows)
    # reward scored a part while the rollout was still producing later parts (streaming across pools)
    by_name = {}
    for e in events:
        if e["ph"] == "X":
            by_name.setdefault(e["name"], []).append(e)
    first_score = min(e["ts"] for e in by_name["reward.score"])
    last_gen_end = max(e["ts"] + e["dur"] for e in by_name["actor.generate[1]"])
    assert first_score < last_gen_end


async def test_ppo_end_to_end(tmp_path):
    out = tmp_path / "ppo"
    hist = await _run([*TINY, "algorithm.name=ppo", "rollout.n=2", "algorithm.kl_coef=0.01",
                       "algorithm.kl_in=reward", "runner.total_steps=2", f"runner.output_dir={out}"])
    assert len(hist) == 2
    r = hist[-1]
    assert r["critic/tokens"] > 0 and r["critic/grad_norm"] > 0 and "critic/vf_loss" in r
    assert "adv/std" in r and r["actor/weights_version"] == 2


async def test_resume_continues_exactly(grpo_run, tmp_path):
    """A run stopped after its step-1 checkpoint and resumed to 4 steps gives the uninterrupted run's steps 2-3.
    The stopped run is the full run's output as it stood after step 1 (runs are deterministic: a run cut at 2 steps
    writes the same checkpoint): only step_000001, ``latest`` naming it, and metrics.jsonl still holding the lines
    of steps 2-3, which the resume must drop before it writes its own."""
    full_out, full = grpo_run
    cut = tmp_path / "cut"
    shutil.copytree(full_out, cut)
    for p in (cut / "checkpoints").iterdir():
        if p.is_dir() and p.name != "step_000001":
            shutil.rmtree(p)
    (cut / "checkpoints" / LATEST).write_text("step_000001")  # what the runner's commit writes: the bare name
    assert [r["step"] for r in _metrics(cut)] == [0, 1, 2, 3]
    resumed = await _run([*GRPO, f"runner.output_dir={cut}"], resume=True)
    assert [r["step"] for r in resumed] == [2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in full)  # the run learns something, so equality means something
    skip = ("time", "perf/")
    for a, b in zip(full[2:], resumed):
        keys = [k for k in a if not k.startswith(skip) and "seconds" not in k]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    recs = _metrics(cut)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]  # the copied lines of steps 2-3 were replaced, not appended to
    assert recs[:2] == _metrics(full_out)[:2]


def test_cli_rejects_bad_config(capsys, tmp_path):
    assert cli_main(["train", "actor.lrr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "actor.lrr" in err and "did you mean 'actor.lr'" in err
    assert cli_main(["train", "rollout.temperature=-1"]) == 2
    assert "rollout.temperature" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: {name: a2c}\n")
    assert cli_main(["train", str(cfg)]) == 2
    assert "algorithm.name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["fly"])


async def test_split_placement_overlaps_next_rollout_with_update(tmp_path):
    out = tmp_path / "split"
    hist = await _run([*TINY, "resources.actor_workers=1", "resources.rollout_workers=1",
                       "resources.placement=split", "runner.max_staleness=1", "runner.total_steps=3",
                       f"runner.output_dir={out}", "runner.trace=true"])
    assert [h["staleness"] for h in hist] == [0, 1, 1]  # bounded: never older than one update
    events = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    gens = [e for e in events if e["name"].startswith("rollout.generate")]
    actor_work = [e for e in events if e["name"] in ("actor.update_actor", "actor.compute_log_prob")]
    loads = [e for e in events if e["name"] == "rollout.load_weights"]
    assert len(loads) >= 3  # weights went actor -> rollout pool after every update (plus the initial sync)

    def overlaps(a, b):
        return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]

    # the rollout pool sampled while the actor pool computed (step k+1's rollout during step k)
    assert any(overlaps(g, a) for g in gens for a in actor_work)
