"""Recovery time of the main job (``examples/grpo_digits.yaml``, a few steps) after a SIGKILLed actor worker.

A run with checkpoints every 2 steps; once ``--kill-after`` steps are recorded an actor rank is killed with
SIGKILL, and the runner restarts the job from its latest checkpoint. Measured from the kill to the next finished
step, split into:

- detection: kill -> the controller knows (supervision's ``on_death`` or a failed call)
- teardown: every group closed (actors killed, pools released)
- placement: the pools placed again (waits until the cluster fits them; Ray frees the old ones asynchronously)
- startup: every rank's worker process started and constructed (imports torch, builds the model)
- restore: the latest good checkpoint verified and loaded, rollout weights synced
- first_step: the first step after the restart, to its end (the run is then back to normal)

Run: ``python -m bench.recovery [--steps 5] [--kill-after 3] [--out docs/bench/recovery.json]``; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import anyio  # noqa: E402

from bench._common import emit  # noqa: E402


async def _kill_when(runner: Any, steps_done: int, rank: int, killed: dict[str, float]) -> None:
    """SIGKILL actor ``rank`` once ``steps_done`` steps are recorded (bounded wait for the condition)."""
    with anyio.fail_after(600):
        while runner.cluster is None or len(runner.history) < steps_done or runner.current_step != steps_done:
            await anyio.sleep(0.02)
        pid = next(d["pid"] for d in await runner.cluster.actor.describe() if d["rank"] == rank)
    killed["t"] = time.time()
    killed["pid"] = pid
    os.kill(pid, signal.SIGKILL)


async def measure(steps: int, kill_after: int, rank: int, config: str) -> dict[str, Any]:
    """Run the job with one kill; return the restart's phases in seconds."""
    from pipelines.config import load_config
    from pipelines.runner import Runner

    out = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    cfg = load_config(config, [f"runner.total_steps={steps}", "runner.checkpoint_every=2", "runner.plot=false",
                               "runner.trace=false", f"runner.output_dir={out}"])
    runner = Runner(cfg, progress=False)
    killed: dict[str, float] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(_kill_when, runner, kill_after, rank, killed)
        t0 = time.time()
        hist = await runner.run()
    if len(runner.restarts) != 1:
        raise RuntimeError(f"expected one restart, the run had {runner.restarts}")
    ev = runner.restarts[0]
    first = next(h for h in hist if h["step"] == ev["resume_step"])
    step_s = [h["perf/step_s"] for h in hist if h["step"] < kill_after]
    res = {
        "config": config, "steps": steps, "killed": f"actor rank {rank} (pid {killed['pid']}) during step {ev['step']}",
        "checkpoint": ev["checkpoint"], "resume_step": ev["resume_step"],
        "detection_s": ev["noticed_at"] - killed["t"], "teardown_s": ev["teardown_s"],
        "placement_s": ev["placement_s"], "startup_s": ev["startup_s"], "restore_s": ev["restore_s"],
        "first_step_s": first["time"] - ev["time"],
        "recovery_s": ev["time"] - killed["t"],  # kill -> ready to run again
        "kill_to_next_step_s": first["time"] - killed["t"],
        "lost_s": ev["lost_s"], "steps_redone": ev["step"] - ev["resume_step"],
        "median_step_s_before": sorted(step_s)[len(step_s) // 2] if step_s else None,
        "run_s": time.time() - t0,
    }
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/grpo_digits.yaml")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=3, help="kill once this many steps are recorded")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    import orchestra as orc

    res = orc.run(measure(a.steps, a.kill_after, a.rank, a.config))
    emit(res)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
