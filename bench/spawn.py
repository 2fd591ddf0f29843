"""Spawned ranks (``engines._dist.spawn``): wall time of a 2-rank spawn and each rank's CPU, forked from the fork
server against fresh interpreters, interleaved.

    python -m bench.spawn [--rounds 3]

``engines._dist.spawn`` forks its ranks from a fork server that imported torch, transformers and the engines once
(``engines._dist.PRELOAD``); a changed environment makes it start fresh interpreters instead, which is how the
``fresh`` rounds here are made (one environment variable set for the call). Two rank functions: ``imports`` only
imports what an engine test imports; ``engine_step`` builds a tiny 2-rank FSDP engine and trains one step (what
the engine and loss-scaling tests do per spawn). The first fork-server round includes starting the server.

Prints JSON: per function and way, the median wall seconds of a spawn and the median CPU seconds of a rank
(``os.times`` in the rank: what the rank spent, imports included; a forked rank's count starts at the fork).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from engines._dist import spawn

from ._common import emit


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def imports(rank: int, world: int) -> float:
    """Import what an engine test's rank imports; return this rank's CPU seconds."""
    import engines.fsdp  # noqa: F401
    import engines.models  # noqa: F401

    return _cpu()


def engine_step(rank: int, world: int) -> float:
    """Build a tiny 2-rank FSDP engine and train one step; return this rank's CPU seconds."""
    import torch

    from engines.fsdp import EngineConfig, FSDPEngine
    from engines.models import build_causal_lm, tiny_qwen2_config

    engine = FSDPEngine(lambda: build_causal_lm(tiny_qwen2_config(64)), EngineConfig(micro_batch_size=2))
    g = torch.Generator().manual_seed(rank)
    prompts, responses = torch.randint(3, 64, (2, 4), generator=g), torch.randint(3, 64, (2, 8), generator=g)
    batch = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
             "attention_mask": torch.ones(2, 12, dtype=torch.long), "response_mask": torch.ones(2, 8, dtype=torch.long)}

    def loss(outputs: dict, mb: dict) -> tuple[torch.Tensor, dict]:
        m = mb["response_mask"].float()
        return -(outputs["log_probs"] * m).sum() / m.sum(), {}

    engine.train_step(batch, loss)
    return _cpu()


def _round(fn: Any, fresh: bool) -> tuple[float, float]:
    if fresh:
        os.environ["BENCH_SPAWN_FRESH"] = "1"  # any change since the server started: fresh interpreters
    try:
        t0 = time.perf_counter()
        cpus = spawn(fn, 2)
        return time.perf_counter() - t0, statistics.fmean(cpus)
    finally:
        os.environ.pop("BENCH_SPAWN_FRESH", None)


def measure(rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": 2, "rounds": rounds}
    for fn in (imports, engine_step):
        got: dict[str, list[tuple[float, float]]] = {"fork_server": [], "fresh": []}
        for _ in range(rounds):
            got["fork_server"].append(_round(fn, fresh=False))
            got["fresh"].append(_round(fn, fresh=True))
        out[fn.__name__] = {way: {"wall_s": round(statistics.median(w for w, _ in s), 3),
                                  "rank_cpu_s": round(statistics.median(c for _, c in s), 3),
                                  "samples": [[round(w, 3), round(c, 3)] for w, c in s]}
                            for way, s in got.items()}
        out[fn.__name__]["wall_ratio_fresh_over_fork_server"] = round(
            out[fn.__name__]["fresh"]["wall_s"] / out[fn.__name__]["fork_server"]["wall_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    emit(measure(args.rounds))


if __name__ == "__main__":
    main()
