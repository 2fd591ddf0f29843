"""Baselines for the engines, without Ray: the floor the WorkerGroup versions are compared to.

(a) FSDP2 train-step time of :class:`engines.fsdp.FSDPEngine` on N local ranks started with
    plain ``torch.multiprocessing`` (median over ``steps`` steps after ``warmup``);
(b) rollout tokens/s of :class:`engines.rollout.RolloutEngine` vs ``model.generate`` on the same
    model (batch 16 x 32 new tokens, sampling at temperature 1, no stop token).

Run: ``python -m bench.engines_baseline [--world-size 2] [--steps 10]`` prints one JSON object.
The measuring functions are importable (e.g. by a WorkerGroup benchmark):
``fsdp_step_time(engine_factory, batch, steps)``, ``rollout_tokens_per_s(engine, batch, ...)``,
``hf_generate_tokens_per_s(model, batch, ...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from engines._dist import spawn  # noqa: E402
from engines.fsdp import EngineConfig, FSDPEngine  # noqa: E402
from engines.models import build_causal_lm, tiny_qwen2_config  # noqa: E402
from engines.rollout import RolloutEngine, SamplingParams  # noqa: E402

BENCH_MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def bench_config(**overrides: Any):
    """The benchmark's tiny Qwen2 (about 0.2 M parameters; see BENCH_MODEL)."""
    return tiny_qwen2_config(**{**BENCH_MODEL, **overrides})


def train_batch(rows: int = 16, prompt_len: int = 32, response_len: int = 32, vocab: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fixed random training batch (full-length prompts/responses, random advantages)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(3, vocab, (rows, response_len), generator=g)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.ones(rows, prompt_len + response_len, dtype=torch.long),
        "response_mask": torch.ones(rows, response_len, dtype=torch.long),
        "advantages": torch.randn(rows, response_len, generator=g),
    }


def pg_loss(outputs: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor]):
    """A vanilla policy-gradient token-mean loss (enough to exercise forward + backward)."""
    m = mb["response_mask"].float()
    return -(mb["advantages"] * outputs["log_probs"] * m).sum() / m.sum(), {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fsdp_step_time(
    engine_factory: Callable[[], Any] | Any,
    batch: Mapping[str, torch.Tensor],
    steps: int = 10,
    *,
    warmup: int = 2,
    loss_fn: Callable[..., Any] = pg_loss,
) -> float:
    """Median seconds of ``engine.train_step(batch, loss_fn)`` over ``steps`` after ``warmup``.

    ``engine_factory`` is an engine or a zero-argument callable building one (collective: call
    on every rank with that rank's rows). Anything with ``train_step`` works.
    """
    engine = engine_factory() if callable(engine_factory) and not hasattr(engine_factory, "train_step") else engine_factory
    device = getattr(engine, "device", torch.device("cpu"))
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        engine.train_step(batch, loss_fn)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fsdp_rank(rank: int, world: int, rows: int, prompt_len: int, response_len: int, micro: int, steps: int, warmup: int) -> float:
    batch = train_batch(rows, prompt_len, response_len)
    per = rows // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    cfg = EngineConfig(lr=1e-4, micro_batch_size=micro)
    return fsdp_step_time(lambda: FSDPEngine(lambda: build_causal_lm(bench_config(), seed=0), cfg), local, steps, warmup=warmup)


def fsdp_step_time_spawned(
    world_size: int = 2,
    *,
    rows: int = 16,
    prompt_len: int = 32,
    response_len: int = 32,
    micro_batch_size: int = 8,
    steps: int = 10,
    warmup: int = 2,
) -> dict[str, Any]:
    """(a): FSDP2 train step on ``world_size`` spawned ranks (gloo/nccl), 1 torch thread each.

    Returns the slowest rank's median step time (a step ends when every rank is done).
    """
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"world_size={world_size} needs {world_size} GPUs (NCCL wants one per rank), found "
            f"{torch.cuda.device_count()}; pass --world-size {torch.cuda.device_count()}"
        )
    per_rank = spawn(_fsdp_rank, world_size, rows, prompt_len, response_len, micro_batch_size, steps, warmup)
    return {
        "world_size": world_size,
        "rows": rows,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "micro_batch_size": micro_batch_size,
        "steps": steps,
        "median_step_ms": round(1000 * max(per_rank), 2),
        "per_rank_median_ms": [round(1000 * t, 2) for t in per_rank],
    }


def _time_generate(engine: RolloutEngine, batch: Mapping[str, torch.Tensor], max_new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    _sync(engine.device)
    t0 = time.perf_counter()
    out = engine.generate(batch, params)
    _sync(engine.device)
    assert out["responses"].shape[1] == max_new_tokens
    return time.perf_counter() - t0


@torch.no_grad()
def _time_hf_generate(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], max_new_tokens: int) -> float:
    device = next(model.parameters()).device
    ids = batch["prompts"].to(device)
    mask = batch["attention_mask"].to(device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
    )
    _sync(device)
    assert out.shape[1] == ids.shape[1] + max_new_tokens
    return time.perf_counter() - t0


def rollout_tokens_per_s(
    engine: RolloutEngine, batch: Mapping[str, torch.Tensor], max_new_tokens: int = 32, repeats: int = 5, warmup: int = 1
) -> float:
    """Generated tokens per second of ``engine.generate`` (median over ``repeats``), no stop token."""
    times = [_time_generate(engine, batch, max_new_tokens) for _ in range(warmup + repeats)][warmup:]
    return batch["prompts"].shape[0] * max_new_tokens / statistics.median(times)


def hf_generate_tokens_per_s(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor], max_new_tokens: int = 32, repeats: int = 5, warmup: int = 1
) -> float:
    """Same measurement with ``model.generate`` (sampling, temperature 1, no top-k/top-p, no eos)."""
    times = [_time_hf_generate(model, batch, max_new_tokens) for _ in range(warmup + repeats)][warmup:]
    return batch["prompts"].shape[0] * max_new_tokens / statistics.median(times)


def rollout_comparison(rows: int = 16, prompt_len: int = 16, max_new_tokens: int = 32, repeats: int = 15) -> dict[str, Any]:
    """(b): RolloutEngine vs model.generate on the same model and prompts, in this process.

    The two are timed alternately (A, B, A, B...) so that load from other processes hits both
    alike; medians over ``repeats`` each after one warmup run.
    """
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = build_causal_lm(bench_config(), seed=0).to(device).eval()
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompts": torch.randint(3, 256, (rows, prompt_len), generator=g),
        "attention_mask": torch.ones(rows, prompt_len, dtype=torch.long),
    }
    engine = RolloutEngine(model, pad_token_id=0)
    ours_t, hf_t = [], []
    for i in range(repeats + 1):
        a, b = _time_generate(engine, batch, max_new_tokens), _time_hf_generate(model, batch, max_new_tokens)
        if i > 0:
            ours_t.append(a)
            hf_t.append(b)
    tokens = rows * max_new_tokens
    ours, hf = tokens / statistics.median(ours_t), tokens / statistics.median(hf_t)
    return {
        "rows": rows,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "device": str(device),
        "repeats": repeats,
        "rollout_engine_tokens_per_s": round(ours, 1),
        "hf_generate_tokens_per_s": round(hf, 1),
        "rollout_engine_ms": round(1000 * statistics.median(ours_t), 2),
        "hf_generate_ms": round(1000 * statistics.median(hf_t), 2),
        "speedup_vs_generate": round(ours / hf, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run (a) and (b) and print one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    result = {
        "bench": "engines_baseline",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "model": BENCH_MODEL,
        "params": sum(p.numel() for p in build_causal_lm(bench_config(), seed=0).parameters()),
        "fsdp_train_step": fsdp_step_time_spawned(
            args.world_size, rows=args.rows, micro_batch_size=args.micro_batch_size, steps=args.steps
        ),
        "rollout": rollout_comparison(repeats=args.repeats),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
