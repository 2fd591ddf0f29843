"""The algorithm study of docs/algorithms.md: GRPO, Dr. GRPO, RLOO, REINFORCE++ and DAPO on the addition task,
same base config (``examples/study_addition.yaml``), same seeds, same step budget; then a table and one PNG.

    python -m bench.algorithm_study run [--steps 100] [--seeds 0] [--out outputs/study] [--only grpo,rloo]
    python -m bench.algorithm_study summarize [--out outputs/study] [--threshold 0.05] [--reward-threshold 0.2]
                                              [--png docs/img/algorithm_study.png]

``run`` calls ``orchestra train`` once per (algorithm, seed), one after the other (each run uses the 2 workers of
the base config); ``summarize`` reads each run's ``metrics.jsonl`` and prints JSON: per run the first step whose
10-step mean of ``reward/solved`` (exact match) reaches ``--threshold`` and of ``reward/mean`` reaches
``--reward-threshold``, the final 10-step means, the wall time and the responses sampled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._common import emit

BASE = "examples/study_addition.yaml"
ALGORITHMS: dict[str, list[str]] = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "dr_grpo": ["algorithm.adv_estimator=dr_grpo", "actor.loss_agg=seq-mean-token-sum-norm"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_pp"],  # (kl_in=reward without a KL term: refused)
    "dapo": ["algorithm.name=dapo", "actor.clip_ratio_high=0.28"],
}
WINDOW = 10


def _moving(vals: list[float], w: int = WINDOW) -> list[float]:
    """Trailing ``w``-step mean of ``vals``."""
    return [sum(vals[max(0, i - w + 1): i + 1]) / len(vals[max(0, i - w + 1): i + 1]) for i in range(len(vals))]


def run(names: list[str], seeds: list[int], steps: int, out: Path) -> None:
    """One ``orchestra train`` per algorithm and seed into ``out/<name>_s<seed>``; wall times in ``out/walls.json``."""
    walls_path = out / "walls.json"
    out.mkdir(parents=True, exist_ok=True)
    walls = json.loads(walls_path.read_text()) if walls_path.exists() else {}
    for seed in seeds:
        for name in names:
            tag = f"{name}_s{seed}"
            cmd = ["orchestra", "train", BASE, *ALGORITHMS[name], f"runner.total_steps={steps}",
                   f"runner.seed={seed}", f"data.seed={seed}", f"rollout.seed={seed}",
                   f"runner.output_dir={out / tag}", "--overwrite", "--no-progress"]
            print(" ".join(cmd), file=sys.stderr, flush=True)
            t0 = time.time()
            subprocess.run(cmd, check=True)
            walls[tag] = time.time() - t0
            walls_path.write_text(json.dumps(walls, indent=2))


def summarize(out: Path, threshold: float, png: Path | None, reward_threshold: float = 0.2) -> dict[str, Any]:
    """Steps to the exact-match ``threshold`` and to the ``reward_threshold`` (10-step means), final values, wall
    time and responses sampled of every run under ``out`` (``<algorithm>_s<seed>``), the same per algorithm over
    its seeds; optional PNG of both curves (one colour per algorithm, a line per seed)."""
    walls = json.loads((out / "walls.json").read_text()) if (out / "walls.json").exists() else {}
    rows: dict[str, Any] = {}
    curves: dict[str, tuple[list[int], list[float], list[float]]] = {}
    for d in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()):
        recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        recs = [r for r in recs if "step" in r and "reward/solved" in r]
        if not recs:
            continue
        steps = [r["step"] for r in recs]
        solved = _moving([r["reward/solved"] for r in recs])
        reward = _moving([r["reward/mean"] for r in recs])
        reached = next((s for s, v in zip(steps, solved) if v >= threshold), None)
        reached_r = next((s for s, v in zip(steps, reward) if v >= reward_threshold), None)
        cfg = json.loads((d / "config.json").read_text())
        per_step = cfg["data"]["prompts_per_step"]
        groups = sum(r.get("dynamic_sampling/groups", per_step) for r in recs)  # DAPO samples extra rounds
        rows[d.name] = {"steps": len(recs), "first_step_at_threshold": reached,
                        "first_step_at_reward_threshold": reached_r,
                        "start_solved": round(statistics.fmean(r["reward/solved"] for r in recs[:WINDOW]), 4),
                        "final_solved_10step_mean": round(solved[-1], 4),
                        "final_reward_10step_mean": round(reward[-1], 4),
                        "wall_s": round(walls.get(d.name, recs[-1]["time"] - recs[0]["time"]), 1),
                        "responses_sampled": int(groups) * cfg["rollout"]["n"]}
        curves[d.name] = (steps, solved, reward)
    by_alg: dict[str, list[str]] = {}
    for tag in rows:
        by_alg.setdefault(tag.rsplit("_s", 1)[0], []).append(tag)
    algorithms: dict[str, Any] = {}
    for alg, tags in by_alg.items():
        runs = [rows[t] for t in tags]
        hit = [r["first_step_at_threshold"] for r in runs]
        algorithms[alg] = {
            "seeds": len(runs),
            "first_step_at_threshold": hit,
            "final_solved_10step_mean": [r["final_solved_10step_mean"] for r in runs],
            "final_solved_mean_over_seeds": round(statistics.fmean(r["final_solved_10step_mean"] for r in runs), 4),
            "final_reward_mean_over_seeds": round(statistics.fmean(r["final_reward_10step_mean"] for r in runs), 4),
            "start_solved_mean_over_seeds": round(statistics.fmean(r["start_solved"] for r in runs), 4),
            "wall_s": [r["wall_s"] for r in runs],
            "responses_sampled_per_run": round(statistics.fmean(r["responses_sampled"] for r in runs)),
        }
    if png is not None and curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, (alg, tags) in enumerate(sorted(by_alg.items())):
            color = colors[i % len(colors)]
            for j, tag in enumerate(sorted(tags)):  # one line per seed, the algorithm's colour
                steps, solved, reward = curves[tag]
                label = f"{alg} ({len(tags)} seeds)" if j == 0 else None
                ax_r.plot(steps, reward, color=color, lw=1.0, alpha=0.8, label=label)
                ax_s.plot(steps, solved, color=color, lw=1.0, alpha=0.8, label=label)
        ax_r.axhline(reward_threshold, color="grey", lw=0.8, ls="--")
        ax_s.axhline(threshold, color="grey", lw=0.8, ls="--")
        for ax, what in ((ax_r, "reward/mean"), (ax_s, "exact match (reward/solved)")):
            ax.set_xlabel("RL step (after the warm start)")
            ax.set_ylabel(f"{what}, {WINDOW}-step mean")
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", fontsize=8)
        seeds = sorted({t.rsplit("_s", 1)[1] for t in rows})
        fig.suptitle(f"two-digit addition (examples/study_addition.yaml): same budget, seeds {', '.join(seeds)}")
        fig.tight_layout()
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png)
        plt.close(fig)
    return {"threshold": threshold, "reward_threshold": reward_threshold, "algorithms": algorithms, "runs": rows}


def main() -> None:
    """CLI: ``run`` or ``summarize``."""
    p = argparse.ArgumentParser(prog="python -m bench.algorithm_study")
    p.add_argument("command", choices=("run", "summarize"))
    p.add_argument("--out", type=Path, default=Path("outputs/study"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", default="0")
    p.add_argument("--only", default=",".join(ALGORITHMS))
    p.add_argument("--threshold", type=float, default=0.05, help="exact-match threshold")
    p.add_argument("--reward-threshold", type=float, default=0.2)
    p.add_argument("--png", type=Path, default=None)
    a = p.parse_args()
    if a.command == "run":
        run(a.only.split(","), [int(s) for s in a.seeds.split(",")], a.steps, a.out)
    else:
        emit(summarize(a.out, a.threshold, a.png, a.reward_threshold))


if __name__ == "__main__":
    main()
