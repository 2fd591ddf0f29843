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
                                       ["algorithm.name=ppo", "rollout.n=1", "algorithm.kl_in=reward"]])
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
