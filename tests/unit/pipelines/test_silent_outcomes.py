"""What an adversarial review of the pipelines found reported wrong or not at all (session 37), each on a tiny
in-process job (``resources.backend=local``) or the piece itself: PPO's advantage moments when it does not whiten,
DAPO's extra rounds' uids and stage times, the step a failed stage belongs to, a second failure in ``join``, warnings
for non-finite steps the guard tolerates, and the CLI's flags between the config file and the overrides."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

import orchestra as orc
from local_jobs import local_runner
from pipelines.cli import main as cli_main
from pipelines.health import NonFiniteGuard
from pipelines.join import join


def test_ppo_without_whitening_reports_the_advantages_moments_not_the_identity(tmp_path):
    hist = orc.run(local_runner(tmp_path, "runner.total_steps=2", "algorithm.name=ppo",
                                "algorithm.whiten_advantages=false").run())
    for rec in hist:
        assert (rec["adv/mean"], rec["adv/std"]) != (0.0, 1.0), rec
        assert math.isfinite(rec["adv/mean"]) and rec["adv/std"] > 0


def test_dapo_extra_rounds_give_each_prompt_a_uid_of_its_own(tmp_path):
    from pipelines.dynamic_sampling import dynamic_sampling
    from pipelines.grpo import critic_free_update

    r = local_runner(tmp_path, "runner.total_steps=2", "algorithm.name=dapo", "rollout.max_new_tokens=4")
    seen: dict[int, set] = {}
    rounds = []

    async def step(ctx, rollouts):
        g = await dynamic_sampling(ctx, rollouts)
        rounds.append(g.metrics["dynamic_sampling/rounds"])
        rows = await g.rollouts
        for u, p in zip(rows["uid"].tolist(), rows["prompts"].tolist()):
            seen.setdefault(u, set()).add(tuple(p))
        m = await critic_free_update(ctx, g.rollouts, g.scores, streamed=False, filler=g.filler)
        return {**m, **ctx.score_metrics(g.sampled_scores), **g.metrics}

    r.step_fn = step
    orc.run(r.run())
    assert max(rounds) > 1, "the job took no extra round: the test needs one"
    assert {u: len(ps) for u, ps in seen.items() if len(ps) > 1} == {}


def test_a_dapo_step_records_the_time_of_each_of_its_stages(tmp_path):
    hist = orc.run(local_runner(tmp_path, "runner.total_steps=1", "algorithm.name=dapo", "rollout.max_new_tokens=4",
                                "algorithm.kl_coef=0.01").run())
    for name in ("old_log_prob", "ref_log_prob", "update_actor", "reward"):
        assert f"time/{name}" in hist[0], sorted(k for k in hist[0] if k.startswith("time/"))


def test_a_failed_stage_names_the_step_it_failed_in(tmp_path):
    r = local_runner(tmp_path, "runner.total_steps=3")
    step_fn = r.step_fn

    async def step(ctx, rollouts):
        if ctx.step == 1:
            raise ZeroDivisionError("boom in reward")
        return await step_fn(ctx, rollouts)

    r.step_fn = step
    with pytest.raises(ZeroDivisionError) as info:
        orc.run(r.run())
    assert any("step 1" in n for n in getattr(info.value, "__notes__", [])), getattr(info.value, "__notes__", None)


async def _fail(msg: str, gate: asyncio.Event) -> None:
    await gate.wait()
    raise RuntimeError(msg)


def test_join_reports_every_failure_of_the_same_turn_not_only_the_first(caplog):
    async def main():
        gate = asyncio.Event()
        task = asyncio.ensure_future(join(_fail("actor failed", gate), _fail("critic failed", gate)))
        await asyncio.sleep(0)
        gate.set()
        with pytest.raises(RuntimeError) as info:
            await task
        return info.value

    with caplog.at_level(logging.ERROR):
        err = asyncio.run(main())
    assert str(err) == "actor failed" and not getattr(err, "__notes__", None)  # raised unchanged
    said = [r.getMessage() for r in caplog.records if r.name == "orchestra"]
    assert len(said) == 1 and "critic failed" in said[0] and "actor failed" in said[0]
    assert "never retrieved" not in caplog.text


def test_join_of_two_readers_of_one_failed_upstream_leaves_its_error_as_it_was(caplog):
    async def main():
        shared = RuntimeError("upstream failed")

        async def reader():
            raise shared

        with pytest.raises(RuntimeError) as info:
            await join(reader(), reader())
        return shared, info.value

    with caplog.at_level(logging.ERROR):
        shared, raised = asyncio.run(main())
    assert raised is shared and not getattr(shared, "__notes__", None)
    assert not [r for r in caplog.records if r.name == "orchestra"]


def test_each_non_finite_step_the_guard_tolerates_is_a_warning(caplog):
    g = NonFiniteGuard(3)
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        g.check(0, {"actor/loss": 0.5})
        assert caplog.records == []
        g.check(1, {"actor/loss": float("nan")})
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "step 1" in msg and "actor/loss" in msg and "1 of" in msg and "max_bad_steps=3" in msg


def test_some_updates_of_a_step_skipped_is_a_warning(caplog):
    g = NonFiniteGuard(3)
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        g.check(4, {"actor/loss": 0.5, "actor/optimizer_steps": 4.0, "actor/skipped": 1.0, "actor/grad_norm": 1.0})
    msg = caplog.text
    assert "step 4" in msg and "1 of 4 actor updates" in msg


def test_a_run_that_ends_inside_a_run_of_non_finite_steps_says_so(tmp_path, caplog):
    r = local_runner(tmp_path, "runner.total_steps=3", "runner.max_bad_steps=3")
    step_fn = r.step_fn

    async def step(ctx, rollouts):
        m = await step_fn(ctx, rollouts)
        return {**m, "actor/loss": float("nan")} if ctx.step >= 1 else m

    r.step_fn = step
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        orc.run(r.run())
    assert "the run ended after 2 consecutive non-finite steps" in caplog.text


@pytest.fixture
def no_run(monkeypatch):
    import pipelines.runner as runner

    calls = []

    def fake_run(cfg, **kwargs):
        calls.append((cfg, kwargs))
        return []

    monkeypatch.setattr(runner, "run", fake_run)
    return calls


def test_overrides_may_follow_the_flags(tmp_path, no_run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("runner:\n  total_steps: 5\n")
    assert cli_main(["train", "job.yaml", "--no-progress", "runner.total_steps=7", "actor.lr=1e-4"]) == 0
    cfg, kwargs = no_run[0]
    assert cfg.runner.total_steps == 7 and cfg.actor.lr == 1e-4 and kwargs["progress"] is False


def test_an_unknown_flag_is_still_refused(tmp_path, no_run, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("runner:\n  total_steps: 5\n")
    with pytest.raises(SystemExit) as info:
        cli_main(["train", "job.yaml", "--bogus"])
    assert info.value.code == 2 and "--bogus" in capsys.readouterr().err and no_run == []


def test_a_config_file_after_an_override_is_refused_saying_where_it_goes(tmp_path, no_run, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("runner:\n  total_steps: 5\n")
    assert cli_main(["train", "runner.total_steps=7", "job.yaml"]) == 2
    err = capsys.readouterr().err
    assert "job.yaml" in err and "first" in err and no_run == []


def test_an_override_without_a_value_is_named_as_such(tmp_path, no_run, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("runner:\n  total_steps: 5\n")
    assert cli_main(["train", "job.yaml", "actor.lr"]) == 2
    err = capsys.readouterr().err
    assert "write actor.lr=VALUE" in err and "comes first" not in err and no_run == []
