"""Checkpoint cost of the main job's actor (``examples/grpo_digits.yaml`` model, one rank, no Ray):
``engines.checkpoint`` (safetensors shards + JSON) vs ``torch.distributed.checkpoint`` (the format it replaced,
whose ``.metadata`` is a pickle) on the same state, plus the run-level manifest (write + verify).

Run: ``python -m bench.checkpoint [--repeats 7]`` prints one JSON object: bytes on disk, median save and load
milliseconds per format (load includes the engine's own size + sha256 check), manifest write + verify ms. The two
formats alternate, each round after one warm-up round of both that is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402


def _dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def measure(repeats: int = 7) -> dict[str, Any]:
    """Save/load the engine state ``repeats`` times per format; medians in ms and bytes on disk."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from engines.checkpoint import load_sharded, save_sharded
    from engines.fsdp import EngineConfig, FSDPEngine
    from engines.models import build_causal_lm, tiny_qwen2_config
    from engines.tokenizer import CharTokenizer
    from pipelines.checkpoint import verify, write_manifest

    torch.set_num_threads(1)
    vocab = CharTokenizer().vocab_size
    model = tiny_qwen2_config(vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, intermediate_size=256, tie_word_embeddings=True)
    eng = FSDPEngine(lambda: build_causal_lm(model, seed=0), EngineConfig(lr=2e-3))
    out: dict[str, Any] = {"params": sum(p.numel() for p in eng.model.parameters()), "repeats": repeats}
    names = ("torch.distributed.checkpoint", "safetensors+json")

    def once(name: str) -> tuple[float, float, float, int]:
        """One save, manifest write + verify, and load in ``name``'s format: (save s, load s, manifest s, bytes)."""
        d = tempfile.mkdtemp(prefix="bench_ckpt_")
        try:
            model_sd, optim_sd = get_state_dict(eng.model, eng.optimizer)
            t0 = time.perf_counter()
            if name == "safetensors+json":
                save_sharded(d, model_sd, optim_sd, device=eng.device, engine_state={"global_step": 0})
            else:
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=d)
            save = time.perf_counter() - t0
            size = _dir_bytes(d)
            t0 = time.perf_counter()
            write_manifest(Path(d))
            verify(Path(d))
            manifest = time.perf_counter() - t0
            t0 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(eng.model, eng.optimizer)
            if name == "safetensors+json":
                load_sharded(d, model_sd, optim_sd, device=eng.device)
            else:
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=d)
            set_state_dict(eng.model, eng.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            return save, time.perf_counter() - t0, manifest, size
        finally:
            shutil.rmtree(d)

    runs: dict[str, list[tuple[float, float, float, int]]] = {n: [] for n in names}
    for i in range(repeats + 1):  # the formats alternate; the first round of each warms up and is not counted
        for name in names:
            r = once(name)
            if i:
                runs[name].append(r)
    for name in names:
        save_s, load_s, manifest_s, sizes = zip(*runs[name])
        out[name] = {"bytes": sizes[-1], "save_ms": round(1000 * statistics.median(save_s), 1),
                     "load_ms": round(1000 * statistics.median(load_s), 1),
                     "manifest_write_verify_ms": round(1000 * statistics.median(manifest_s), 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    print(json.dumps(measure(p.parse_args().repeats), indent=1))


if __name__ == "__main__":
    main()
