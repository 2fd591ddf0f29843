"""Loading one large shard the way a rank does (``engines.checkpoint.load_sharded``: the file read once, its size
and sha256 checked on those bytes, the safetensors library parsing the same bytes): wall time and the peak memory
the load adds over the model's own tensor, each load in a fresh process (so the peak is its own).

Run: ``python -m bench.checkpoint_load [--mib 256] [--repeats 3]`` prints one JSON object: median load seconds with
and without the sha256 check, and the peak RSS each load added, in MiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

_NO_OPTIM = {"state": {}, "param_groups": []}


def _save(directory: str, mib: int) -> None:
    import torch

    from engines.checkpoint import save_sharded

    save_sharded(directory, {"w": torch.randn(mib * 1024 * 1024 // 4)}, _NO_OPTIM, device=torch.device("cpu"),
                 engine_state={"global_step": 1})


def _load(directory: str, mib: int, verify: bool) -> dict[str, float]:
    import torch

    from engines.checkpoint import load_sharded

    out = torch.zeros(mib * 1024 * 1024 // 4)  # the model's tensor, resident before the load
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    load_sharded(directory, {"w": out}, _NO_OPTIM, device=torch.device("cpu"), verify=verify)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_added_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--_load", nargs=2, help=argparse.SUPPRESS)  # child: DIRECTORY VERIFY
    args = ap.parse_args()
    if args._load:
        print(json.dumps(_load(args._load[0], args.mib, args._load[1] == "1")))
        return
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as d:
        _save(d, args.mib)
        runs: dict[str, list[dict[str, float]]] = {"verify": [], "no_verify": []}
        for _ in range(args.repeats):
            for key, flag in (("verify", "1"), ("no_verify", "0")):
                out = subprocess.run([sys.executable, "-m", "bench.checkpoint_load", "--mib", str(args.mib),
                                      "--_load", d, flag], capture_output=True, text=True, check=True)
                runs[key].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"mib": args.mib, "repeats": args.repeats, **{
        f"{key}_{m}": round(statistics.median(r[m] for r in rs), 3)
        for key, rs in runs.items() for m in ("seconds", "peak_added_mib")}}))


if __name__ == "__main__":
    main()
