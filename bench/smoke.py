"""Every benchmark, run once at its smallest: does each still run to its JSON?

    python -m bench.smoke [--only transport,forwarding] [--timeout 600]

A benchmark's baseline can stop working without any test failing: ``bench.transport`` and ``bench.forwarding``
called orchestra's generated actor methods as their raw-Ray baselines and failed at their first raw call for three
days (replies had become frames), so the numbers they give could not be measured again. This runs each module of
``bench/`` in its own process with the arguments in ``QUICK`` (a few iterations, small sizes: ~5 minutes in all
here), one after the other, and prints JSON: per benchmark its exit status, wall seconds, whether its output
parsed as JSON, and the last lines of its error output when it failed. Exits 1 when any failed. Run it before
citing a benchmark's numbers after a change to the call path or the wire.

``QUICK`` names every module of ``bench/`` (``tests/unit/test_bench_smoke.py`` checks it): a module left out on
purpose maps to None with the reason in ``SKIPPED``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ._common import emit

ROOT = Path(__file__).resolve().parent.parent

QUICK: dict[str, list[str] | None] = {
    "algorithm_study": None,
    "backends": None,
    "batch_checks": ["--rows", "1024", "--iters", "2"],
    "batch_wire": ["--calls", "500", "--rounds", "1"],
    "callpath": ["--iters", "30", "--rounds", "1"],
    "chain_memory": ["--steps", "20"],
    "checkpoint": ["--repeats", "1"],
    "checkpoint_load": ["--mib", "16", "--repeats", "1"],
    "engines": ["--steps", "2", "--warmup", "1", "--rounds", "1", "--gen-repeats", "2"],
    "engines_baseline": ["--steps", "2", "--repeats", "2"],
    "fast_path": ["--iters", "30", "--rounds", "1"],
    "forwarding": ["--sizes", "4", "--unaligned", "", "--samples", "2", "--iters", "1", "--warmup", "0"],
    "overhead": ["--iters", "30"],
    "overlap": ["--steps", "1"],
    "rank_path": ["--calls", "200", "--rounds", "1"],
    "recovery": ["--steps", "4", "--kill-after", "2"],
    "replies": ["--ranks", "2,4", "--iters", "30", "--blocks", "2"],
    "reply_encoding": ["--iters", "30", "--blocks", "2"],
    "scaling": ["--ranks", "4,8", "--iters", "10"],
    "soak": ["--calls", "300"],
    "spawn": ["--rounds", "1"],
    "startup": ["--rounds", "1"],
    "transport": ["--sizes", "1,4", "--iters", "1", "--warmup", "0"],
}
SKIPPED = {
    "algorithm_study": "trains five algorithms for 100 steps each (hours); its parts are the pipelines' tests",
    "backends": "runs test suites in pytest subprocesses; the suites themselves run in CI",
}
HELPERS = {"__init__", "_common", "smoke"}


def modules() -> list[str]:
    """The benchmark modules of ``bench/`` (its helpers and this script left out)."""
    return sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in HELPERS)


def printed_a_document(stdout: str) -> bool:
    """Whether ``stdout`` holds a benchmark's JSON object (``emit``): Ray's log monitor may print worker log lines
    (a killed rank's, in ``bench.recovery`` and ``bench.soak``) to the same stdout, before or after it."""
    decoder = json.JSONDecoder()
    at = 0
    while (at := stdout.find("{", at)) != -1:
        if at == 0 or stdout[at - 1] == "\n":
            try:
                value, _ = decoder.raw_decode(stdout, at)
            except ValueError:
                pass
            else:
                if isinstance(value, dict):
                    return True
        at += 1
    return False


def run_one(name: str, args: list[str], timeout: float) -> dict:
    """Run ``python -m bench.<name> *args`` from the repository root; its status, seconds, and whether it printed
    JSON (a benchmark that exits 0 without its JSON did not measure)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "rc": None, "seconds": round(time.perf_counter() - t0, 1),
                "error": f"did not finish within {timeout:.0f} s"}
    seconds = round(time.perf_counter() - t0, 1)
    printed_json = printed_a_document(p.stdout)
    out = {"ok": p.returncode == 0 and printed_json, "rc": p.returncode, "seconds": seconds,
           "printed_json": printed_json}
    if not out["ok"]:
        out["error"] = "\n".join(p.stderr.strip().splitlines()[-12:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each benchmark may take")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or modules()
    unknown = [n for n in names if n not in QUICK]
    if unknown:
        ap.error(f"no quick arguments for {unknown}; known: {sorted(QUICK)}")
    results = {}
    for name in names:
        args = QUICK[name]
        if args is None:
            results[name] = {"ok": None, "skipped": SKIPPED[name]}
            continue
        results[name] = run_one(name, args, a.timeout)
        print(f"bench.smoke: {name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s)",
              file=sys.stderr, flush=True)
    failed = sorted(n for n, r in results.items() if r["ok"] is False)
    emit({"bench": "smoke", "failed": failed, "results": results})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
