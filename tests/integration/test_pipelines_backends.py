"""The same job on both backends: a run with every worker in this process (``resources.backend=local``) gives the
same metrics, bit for bit, as the run on the Ray cluster — so a pipeline test on the in-process backend tests what
the cluster runs."""

from __future__ import annotations

import pytest

from pipelines.config import ConfigError, load_config
from pipelines.runner import Runner

TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=2", "runner.total_steps=2", "task.params={format_bonus: 0.5}",
        "runner.checkpoint_every=1"]


def _numbers(history: list[dict]) -> list[dict]:
    """Every metric that does not measure time."""
    return [{k: v for k, v in h.items() if k not in ("time", "wall_time") and not k.startswith(("time/", "perf/"))
             and not k.endswith("_seconds")} for h in history]


@pytest.mark.parametrize("algorithm", [["algorithm.name=grpo"],
                                       ["algorithm.name=ppo", "rollout.n=1"]])
async def test_a_job_gives_the_same_metrics_in_process_and_on_ray(tmp_path, algorithm):
    runs = {}
    for backend in ("local", "ray"):
        out = tmp_path / backend
        cfg = load_config(None, [*TINY, *algorithm, f"resources.backend={backend}", f"runner.output_dir={out}"])
        runs[backend] = _numbers(await Runner(cfg, progress=False).run())
        assert (out / "checkpoints" / "latest").read_text() == "step_000001"
    assert [h["step"] for h in runs["local"]] == [0, 1]
    differ = [(h["step"], k, h[k], r.get(k)) for h, r in zip(runs["local"], runs["ray"]) for k in h if h[k] != r.get(k)]
    assert differ == [] and len(runs["local"]) == len(runs["ray"])


def test_the_in_process_backend_refuses_multi_rank_fsdp_before_starting():
    with pytest.raises(ConfigError, match="resources.actor_workers") as info:
        load_config(None, ["resources.backend=local", "resources.actor_workers=2", "resources.rollout_workers=2"])
    assert "one process" in str(info.value) or "this process" in str(info.value)


async def test_a_dapo_step_reads_scores_into_the_controller_never_rollout_rows(tmp_path):
    """Dynamic sampling decides from the scores alone: the kept rows are gathered worker to worker, so what the
    controller materializes is bounded by the reward columns of the sampled rows (in-process: the same accounting
    as on Ray, in seconds)."""
    import orchestra as orc

    cfg = load_config("examples/dapo_digits.yaml", [
        "data.prompts_per_step=8", "actor.micro_batch_size=32", "actor.warmup_steps=0", "runner.total_steps=1",
        "resources.backend=local", "resources.actor_workers=1", "resources.rollout_workers=1",
        "runner.checkpoint_every=0", f"runner.output_dir={tmp_path}"])
    orc.reset_controller_stats()
    hist = await Runner(cfg, progress=False).run()
    sampled_rows = int(hist[0]["dynamic_sampling/groups"]) * cfg.rollout.n
    trained_rows = int(hist[0]["dynamic_sampling/trained_groups"]) * cfg.rollout.n
    assert hist[0]["dynamic_sampling/extra_rounds"] >= 1 and trained_rows > 0
    # float32 scores [B] and token_level_scores [B, R] of every sampled row, int64 lengths of every trained row
    # (the overlong penalty); the rows themselves (token ids [B, P + R] and more) never
    allowed = sampled_rows * 4 * (1 + cfg.rollout.max_new_tokens) + trained_rows * 8
    assert 0 < orc.controller_stats()["bytes_materialized"] <= allowed
