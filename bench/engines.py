"""The engines inside a WorkerGroup vs the same engines without Ray (bench/engines_baseline.py).

(a) FSDP2 train step: ``ActorRolloutRefWorker.update_actor`` on 2 ranks, timed from the controller (dispatch, data
    transfer and metric reduction included) and inside the worker, vs ``FSDPEngine.train_step`` on 2 ranks started
    with plain ``torch.multiprocessing``; same model, batch, micro-batch and loss. Target: ratio <= 1.10.
    Steps are interleaved one by one (baseline step, group step, ...) with both sets of ranks kept alive, so load
    from other processes hits both alike; a standalone ``fsdp_step_time_spawned`` run is reported as well.
(b) Rollout tokens/s: RolloutEngine vs ``model.generate`` (the baseline's functions) inside a worker process and in
    this process, plus the ``generate`` endpoint end to end over 2 ranks. Target: RolloutEngine / generate >= 1.0.

Run: ``python -m bench.engines [--steps 10] [--rounds 3]`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from bench._common import emit
from bench.engines_baseline import (
    BENCH_MODEL,
    bench_config,
    fsdp_step_time,
    fsdp_step_time_spawned,
    hf_generate_tokens_per_s,
    pg_loss,
    rollout_comparison,
    rollout_tokens_per_s,
    train_batch,
)
from engines.fsdp import EngineConfig
from engines.rollout import SamplingParams
from engines.workers import ActorRolloutRefWorker
from orchestra import Batch, endpoint
from orchestra import dispatch as D


class BenchActor(ActorRolloutRefWorker):
    """The actor worker plus one bench-only endpoint that times the rollout engine in the worker's process."""

    @endpoint(D.broadcast())
    def niceness(self) -> int:
        """This process's nice value (Ray starts workers at its ``worker_niceness``, 15 unless configured)."""
        return os.nice(0)

    @endpoint(D.broadcast() | D.rank_zero())
    def rollout_vs_generate(self, rows: int, prompt_len: int, max_new_tokens: int, repeats: int,
                            rounds: int) -> dict[str, float]:
        """RolloutEngine vs model.generate on this rank's rollout model (alternating rounds; medians). Runs on rank 0
        alone, so it cannot sync weights (a collective): call ``sync_rollout_weights`` first."""
        if self._synced != self._version:
            raise RuntimeError("rollout_vs_generate: the rollout model is stale; await sync_rollout_weights() first")
        g = torch.Generator().manual_seed(0)
        batch = {"prompts": torch.randint(3, BENCH_MODEL["vocab_size"], (rows, prompt_len), generator=g),
                 "attention_mask": torch.ones(rows, prompt_len, dtype=torch.long)}
        ours, hf = [], []
        for _ in range(rounds):
            ours.append(rollout_tokens_per_s(self.rollout, batch, max_new_tokens, repeats=repeats))
            hf.append(hf_generate_tokens_per_s(self.rollout.model, batch, max_new_tokens, repeats=repeats))
        o, h = statistics.median(ours), statistics.median(hf)
        return {"rollout_engine_tokens_per_s": round(o, 1), "hf_generate_tokens_per_s": round(h, 1),
                "speedup_vs_generate": round(o / h, 3)}


def _baseline_rank(rank: int, world: int, port: int, commands: Any, results: Any, rows: int, prompt_len: int,
                   response_len: int, micro: int) -> None:
    """One rank of the plain torch.multiprocessing baseline: build the engine, then time one step per command."""
    import torch.distributed as dist

    from engines.fsdp import FSDPEngine
    from engines.models import build_causal_lm

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    batch = train_batch(rows, prompt_len, response_len)
    per = rows // world
    local = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
    engine = FSDPEngine(lambda: build_causal_lm(bench_config(), seed=0), EngineConfig(lr=1e-4, micro_batch_size=micro))
    results.put(("ready", rank, 0.0))
    while (n := commands.get()) is not None:
        results.put(("step", rank, fsdp_step_time(engine, local, n, warmup=0)))
    dist.barrier()
    dist.destroy_process_group()


class _Baseline:
    """The baseline's ranks kept alive between steps, so its steps and the group's can be interleaved one by one
    (load from other processes then hits both alike)."""

    def __init__(self, target: Any, world: int, *args: Any) -> None:
        import torch.multiprocessing as mp

        from engines._dist import free_port

        ctx = mp.get_context("spawn")
        port = free_port()
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=target, args=(r, world, port, self.commands[r], self.results, *args))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        for _ in range(world):
            self._get()

    def _get(self) -> tuple:
        import queue

        while True:
            try:
                return self.results.get(timeout=5)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"a baseline rank exited with code(s) {dead}") from None

    def step(self) -> float:
        """Seconds of one train step on every rank (the slowest rank: a step ends when all are done)."""
        for q in self.commands:
            q.put(1)
        return max(self._get()[2] for _ in self.commands)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


async def _fsdp_interleaved(group: Any, baseline: _Baseline, batch: Batch, steps: int,
                            warmup: int) -> dict[str, list[float]]:
    base, wall, inside = [], [], []
    for i in range(warmup + steps):
        b = baseline.step()
        t0 = time.perf_counter()
        m = await group.update_actor(batch, pg_loss)
        dt = time.perf_counter() - t0
        if i >= warmup:
            base.append(b)
            wall.append(dt)
            inside.append(m["actor/train_step_seconds"])
    return {"baseline": base, "group": wall, "in_worker": inside}


async def _run(args: argparse.Namespace, bench_cls: type, baseline_target: Any) -> dict[str, Any]:
    import orchestra as orc

    # Ray starts workers at nice 15 by default; the baseline runs at this process's priority. On a shared host
    # that alone slows the workers down, so the comparison sets the workers' niceness (--worker-niceness).
    orc.init(num_cpus=max(4, os.cpu_count() or 1), _system_config={"worker_niceness": args.worker_niceness})
    from orchestra import ResourcePool, WorkerGroup

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=())
    group = WorkerGroup(ResourcePool(process_on_nodes=[args.world_size]), bench_cls, bench_config(), seed=0,
                        engine=EngineConfig(lr=1e-4, micro_batch_size=args.micro_batch_size), sampling=sampling,
                        tokenizer=None, with_ref=False, group_name="bench_actor")
    await group.ready()
    niceness = {"controller": os.nice(0), "workers": await group.niceness()}
    try:
        batch = Batch.from_dict(train_batch(args.rows, args.prompt_len, args.response_len))
        baseline = _Baseline(baseline_target, args.world_size, args.rows, args.prompt_len, args.response_len,
                             args.micro_batch_size)
        try:
            t = await _fsdp_interleaved(group, baseline, batch, args.steps * args.rounds, args.warmup)
        finally:
            baseline.close()
        standalone = fsdp_step_time_spawned(args.world_size, rows=args.rows, prompt_len=args.prompt_len,
                                            response_len=args.response_len, micro_batch_size=args.micro_batch_size,
                                            steps=args.steps, warmup=args.warmup)
        med = {k: 1000 * statistics.median(v) for k, v in t.items()}
        paired = statistics.median([g / b for g, b in zip(t["group"], t["baseline"])])
        fsdp = {
            "world_size": args.world_size, "rows": args.rows, "prompt_len": args.prompt_len,
            "response_len": args.response_len, "micro_batch_size": args.micro_batch_size,
            "interleaved_steps": len(t["group"]),
            "baseline_mp_median_step_ms": round(med["baseline"], 2),
            "workergroup_update_actor_ms": round(med["group"], 2),
            # the in-worker time is the ranks' mean (the metric's reduction), the baseline's the slowest rank's:
            # no ratio of the two; their difference over-states the dispatch's cost (an upper bound)
            "workergroup_in_worker_train_step_ms_rank_mean": round(med["in_worker"], 2),
            "baseline_standalone_median_step_ms": standalone["median_step_ms"],
            "ratio": round(med["group"] / med["baseline"], 3),
            "ratio_paired_median": round(paired, 3),
            "dispatch_overhead_ms_at_most": round(med["group"] - med["in_worker"], 2),
            "target_ratio_max": 1.10,
        }
        fsdp["meets_target"] = fsdp["ratio"] <= 1.10

        # (b) rollout: inside a worker, in this process, and the generate endpoint end to end
        await group.sync_rollout_weights()
        in_worker = await group.rollout_vs_generate.options(timeout=600)(args.gen_rows, args.gen_prompt_len, args.max_new_tokens,
                                                    args.gen_repeats, 3)
        in_process = rollout_comparison(rows=args.gen_rows, prompt_len=args.gen_prompt_len,
                                        max_new_tokens=args.max_new_tokens, repeats=args.gen_repeats * 3)
        g = torch.Generator().manual_seed(0)
        prompts = Batch.from_dict({
            "prompts": torch.randint(3, BENCH_MODEL["vocab_size"], (args.gen_rows, args.gen_prompt_len), generator=g),
            "attention_mask": torch.ones(args.gen_rows, args.gen_prompt_len, dtype=torch.long)})
        await group.generate(prompts)  # warm up (and sync weights)
        times = []
        for _ in range(args.gen_repeats):
            t0 = time.perf_counter()
            out = await group.generate(prompts)
            times.append(time.perf_counter() - t0)
        assert out["responses"].shape == (args.gen_rows, args.max_new_tokens)
        e2e = args.gen_rows * args.max_new_tokens / statistics.median(times)
        rollout = {
            "rows": args.gen_rows, "prompt_len": args.gen_prompt_len, "max_new_tokens": args.max_new_tokens,
            "in_worker": in_worker,
            "in_process": {k: in_process[k] for k in ("rollout_engine_tokens_per_s", "hf_generate_tokens_per_s",
                                                      "speedup_vs_generate")},
            "generate_endpoint_tokens_per_s": round(e2e, 1),
            "generate_endpoint_ranks": args.world_size,  # (no ratio to in_process: one process, all rows)
            "target_speedup_min": 1.0,
        }
        rollout["meets_target"] = in_worker["speedup_vs_generate"] >= 1.0 and in_process["speedup_vs_generate"] >= 1.0
        return {"niceness": niceness, "fsdp_train_step": fsdp, "rollout": rollout}
    finally:
        group.shutdown()
        orc.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run (a) and (b) and print one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved steps = steps x rounds")
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="Ray's worker_niceness for the cluster this bench starts (Ray's default is 15)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--gen-rows", type=int, default=16)
    ap.add_argument("--gen-prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--gen-repeats", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    import orchestra as orc
    from bench.engines import (  # by module name: workers import, not unpickle, them
        BenchActor,
        _baseline_rank,
    )

    t0 = time.perf_counter()
    result = {
        "bench": "engines",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "model": BENCH_MODEL,
        **orc.run(_run(args, BenchActor, _baseline_rank)),
    }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    emit(result)
    return result


if __name__ == "__main__":
    main()
