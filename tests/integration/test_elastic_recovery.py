"""Elastic recovery on a real local Ray cluster: a SIGKILLed worker mid-run is noticed, the job is rebuilt from its
latest good checkpoint (or step 0 state) and finishes every step; the steps after the restart equal a ``--resume``
run from the same checkpoint; ``runner.max_restarts=0`` stops with an error naming the group and rank."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import anyio
import pytest

import orchestra as orc
from pipelines.cli import main as cli_main
from pipelines.config import load_config
from pipelines.objectives import PolicyLoss
from pipelines.runner import Runner

TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=1", "resources.actor_workers=2", "resources.rollout_workers=2",
        "task.params={format_bonus: 0.5}", "runner.checkpoint_every=2"]
SKIP = ("time", "perf/")


def _cli_says(err: str) -> str:
    """What the CLI printed on stderr, from its ``orchestra train: `` line on: Ray forwards the log lines of the
    workers of earlier tests (a rank that died or was declared dead) to this process's stderr at any time."""
    at = err.find("orchestra train: ")
    assert at == 0 or (at > 0 and err[at - 1] == "\n"), err
    return err[at:]


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a: dict, b: dict) -> dict:
    """The keys of ``a`` (timings aside) whose values differ in ``b``; empty when the steps are equal."""
    keys = [k for k in a if not k.startswith(SKIP) and "seconds" not in k]
    return {k: (a[k], b.get(k)) for k in keys if a[k] != b.get(k)}


async def _kill_when(runner: Runner, steps_done: int, group: str = "actor", rank: int = 1) -> int:
    """SIGKILL ``group``'s ``rank`` once ``steps_done`` steps are recorded and the next one has begun (past the
    checkpoint of the last one). Bounded wait for the condition; returns the killed pid."""
    with anyio.fail_after(240):
        while runner.cluster is None or len(runner.history) < steps_done or runner.current_step != steps_done:
            await anyio.sleep(0.05)
        g = getattr(runner.cluster, group)
        pid = next(d["pid"] for d in await g.describe() if d["rank"] == rank)
    os.kill(pid, signal.SIGKILL)
    return pid


async def _run_with_kill(runner: Runner, steps_done: int, group: str = "actor", rank: int = 1) -> list[dict]:
    """``runner.run()`` with a killer task alongside; the run's own error comes out unwrapped."""
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_kill_when, runner, steps_done, group, rank)
            hist = await runner.run()
    except BaseExceptionGroup as eg:
        if len(eg.exceptions) == 1:
            raise eg.exceptions[0] from None
        raise
    return hist


def _runner(out: Path, steps: int, *extra: str, resume: bool = False) -> Runner:
    cfg = load_config(None, [*TINY, f"runner.total_steps={steps}", f"runner.output_dir={out}", *extra])
    return Runner(cfg, resume=resume, progress=False)


async def test_sigkilled_worker_at_a_random_step_restarts_and_finishes_every_step(tmp_path):
    out = tmp_path / "run"
    at = random.Random().randrange(0, 3)  # before the first checkpoint (step 0 state) or after it
    group = random.Random().choice(["actor", "reward"])
    runner = _runner(out, 3)
    hist = await _run_with_kill(runner, at, group=group, rank=random.Random().randrange(2 if group == "actor" else 1))
    assert [h["step"] for h in hist] == [0, 1, 2], f"killed {group} during step {at}"
    lines = _lines(out)
    events = [r for r in lines if "event" in r]
    assert len(events) == 1, f"killed {group} during step {at}: {events}"
    ev = events[0]
    assert ev["event"] == "restart" and ev["step"] == at and ev["restart"] == 1
    assert f"group '{group}" in ev["reason"] and "died" in ev["reason"]
    assert ev["lost_s"] >= 0 and ev["teardown_s"] >= 0 and ev["placement_s"] >= 0 and ev["startup_s"] >= 0
    assert ev["restore_s"] >= 0
    if at >= 2:  # checkpoint_every=2: step_000001 exists once step 1 is done
        assert ev["checkpoint"] == "step_000001" and ev["resume_step"] == 2
    else:
        assert ev["checkpoint"] is None and ev["resume_step"] == 0 and "step 0" in ev["note"]
    # each step once in metrics.jsonl, in order: the redone steps replaced the lost ones
    assert [r["step"] for r in lines if "event" not in r] == [0, 1, 2]
    assert runner.restarts == events


async def test_steps_after_a_restart_equal_a_resume_from_the_same_checkpoint(tmp_path):
    killed = tmp_path / "killed"
    hist = await _run_with_kill(_runner(killed, 4), 3)  # step 3 runs: restored from step_000001, steps 2-3 redone
    ev = [r for r in _lines(killed) if "event" in r]
    assert [(e["step"], e["checkpoint"]) for e in ev] == [(3, "step_000001")]
    assert [h["step"] for h in hist] == [0, 1, 2, 3]
    assert any(h["actor/grad_norm"] > 0 for h in hist)  # it learns, so equality means something

    resumed_out = tmp_path / "resumed"
    (resumed_out / "checkpoints").mkdir(parents=True)
    shutil.copytree(killed / "checkpoints" / "step_000001", resumed_out / "checkpoints" / "step_000001")
    (resumed_out / "checkpoints" / "latest").write_text("step_000001")
    resumed = await _runner(resumed_out, 4, resume=True).run()
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(hist[2:], resumed):
        assert _same(a, b) == {}, f"step {a['step']}"


async def test_max_restarts_zero_stops_with_an_error_naming_group_and_rank(tmp_path):
    runner = _runner(tmp_path / "run", 3, "runner.max_restarts=0", "runner.checkpoint_every=0")
    with pytest.raises(orc.WorkerDiedError) as info:
        await _run_with_kill(runner, 1, group="actor", rank=1)
    assert info.value.group == "actor" and info.value.rank == 1
    assert "group 'actor'" in str(info.value) and "rank 1" in str(info.value)
    assert runner.restarts == []
    assert not any("event" in r for r in _lines(tmp_path / "run"))


def test_cli_reports_a_worker_death_it_cannot_recover_from(monkeypatch, capsys, tmp_path):
    def dies(*args: object, **kwargs: object) -> list:
        raise orc.WorkerDiedError("the worker process of rank 1 died (ActorDiedError)", group="actor", rank=1,
                                  endpoint="update_actor", exc_type="WorkerDied")

    monkeypatch.setattr("pipelines.runner.run", dies)
    assert cli_main(["train", f"runner.output_dir={tmp_path / 'out'}", "runner.max_restarts=0"]) == 1
    err = capsys.readouterr().err
    err = _cli_says(err)
    assert "group 'actor'" in err and "rank 1" in err
    assert "runner.max_restarts=0" in err


class FailsInBackwardOnRank1(PolicyLoss):
    """The GRPO policy loss, except that on actor rank 1 it writes into a tensor its own backward needs: autograd
    raises inside that rank's backward (a bug in a loss), while rank 0 waits in the gradient collectives."""

    def __call__(self, outputs, mb):
        import torch.distributed as dist

        loss, metrics = super().__call__(outputs, mb)
        if dist.get_rank() == 1:
            e = outputs["log_probs"].exp()
            loss = loss + e.sum() * 0.0
            e.mul_(2.0)
        return loss, metrics


async def test_an_error_inside_one_ranks_backward_stops_the_run_with_it_not_retried(tmp_path, monkeypatch):
    """The engine's rank 1 aborts its process groups and declares itself dead (its peer is released only when its
    process ends). The runner treats that as the endpoint error it is: the run stops with it at once, naming the
    group, rank and cause, not retried (no restart: a restart would hit the same error), and the cluster is shut
    down, which ends every rank's process."""
    monkeypatch.setattr("pipelines.grpo.PolicyLoss", FailsInBackwardOnRank1)  # pickled to the ranks by reference
    out = tmp_path / "run"
    runner = _runner(out, 3)
    with pytest.raises(orc.WorkerError, match="modified by an inplace operation") as info:
        await runner.run()
    assert info.value.group == "actor" and info.value.rank == 1, info.value
    assert runner.restarts == []
    lines = _lines(out) if (out / "metrics.jsonl").exists() else []
    assert not any("event" in r for r in lines), lines


def test_cli_reports_a_rank_declared_dead_as_not_retried(monkeypatch, capsys, tmp_path):
    def declared(*args: object, **kwargs: object) -> list:
        raise orc.WorkerDiedError("rank 1 was declared dead by its worker (role 'actor': FSDPEngine.train_step: ...)",
                                  group="actor", rank=1, endpoint="update_actor", exc_type="DeclaredDead")

    monkeypatch.setattr("pipelines.runner.run", declared)
    assert cli_main(["train", f"runner.output_dir={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    err = _cli_says(err)
    assert "declared dead" in err and "rank 1" in err
    assert "not retried" in err and "max_restarts" not in err
