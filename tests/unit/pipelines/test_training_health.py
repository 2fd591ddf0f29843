"""A diverged run stops with an error naming the step and the metric (it used to finish with NaN and exit 0)."""

import math

import pytest

from pipelines.config import ConfigError, load_config
from pipelines.health import NonFiniteGuard, TrainingDivergedError

NAN, INF = math.nan, math.inf


def _m(loss=0.5, grad=1.0, skipped=0.0, updates=4.0, role="actor"):
    return {f"{role}/loss": loss, f"{role}/grad_norm": grad, f"{role}/skipped": skipped,
            f"{role}/optimizer_steps": updates, "reward/mean": 0.1}


def test_stops_after_max_bad_consecutive_steps_naming_step_and_metric():
    guard = NonFiniteGuard(max_bad_steps=3)
    guard.check(0, _m())
    guard.check(1, _m(loss=NAN, skipped=1))
    guard.check(2, _m(grad=INF, skipped=1))
    with pytest.raises(TrainingDivergedError, match=r"at step 3: actor/loss=nan .*3 consecutive steps") as e:
        guard.check(3, _m(loss=NAN, grad=NAN, skipped=2))
    assert (e.value.step, e.value.metric) == (3, "actor/loss")


def test_a_finite_step_resets_the_count():
    guard = NonFiniteGuard(max_bad_steps=2)
    for step in range(10):
        guard.check(step, _m(loss=NAN if step % 2 else 0.3, skipped=1 if step % 2 else 0))
    assert guard.bad_run == 1


def test_stops_when_every_update_of_a_step_was_skipped():
    guard = NonFiniteGuard(max_bad_steps=3)
    with pytest.raises(TrainingDivergedError, match=r"at step 5: all 4 actor updates were skipped") as e:
        guard.check(5, _m(loss=NAN, grad=NAN, skipped=4))
    assert (e.value.step, e.value.metric) == (5, "actor/skipped")


def test_watches_the_critic_too():
    guard = NonFiniteGuard(max_bad_steps=1)
    metrics = {**_m(), **_m(grad=INF, role="critic")}
    with pytest.raises(TrainingDivergedError, match="critic/grad_norm=inf") as e:
        guard.check(0, metrics)
    assert e.value.metric == "critic/grad_norm"


def test_healthy_metrics_pass():
    guard = NonFiniteGuard()
    for step in range(5):
        guard.check(step, _m(skipped=1))  # one skipped update of four is not a divergence
    guard.check(5, {"reward/mean": 0.0})  # a step without updates
    assert guard.bad_run == 0


def test_max_bad_steps_is_a_runner_knob():
    assert load_config(None, []).runner.max_bad_steps == 3
    assert load_config(None, ["runner.max_bad_steps=1"]).runner.max_bad_steps == 1
    with pytest.raises(ConfigError, match="runner.max_bad_steps"):
        load_config(None, ["runner.max_bad_steps=0"])


@pytest.mark.slow  # a real (in-process) cluster, ~3 s
async def test_a_skipped_warm_start_step_stops_the_run(tmp_path):
    """A warm-start update skipped for a non-finite gradient is a TrainingDivergedError naming the warm start and
    the knob; before, the run went on and the skipped step shifted the RL learning-rate schedule by one."""
    from pathlib import Path

    from pipelines.runner import Runner

    cfg = load_config(Path(__file__).resolve().parents[3] / "examples" / "study_addition.yaml", [
        "data.prompts_per_step=8", "rollout.n=4", "resources.backend=local", "resources.actor_workers=1",
        "resources.rollout_workers=1", "runner.total_steps=1", "actor.warmup_steps=0",
        f"runner.output_dir={tmp_path}",
        "task.params={warm_start_steps: 4, warm_start_answers: correct, warm_start_lr: 1.0e+30}"])
    with pytest.raises(TrainingDivergedError, match=r"warm start diverged at its step \d of 4.*warm_start_lr") as e:
        await Runner(cfg, progress=False).run()
    assert e.value.metric == "actor/skipped"
