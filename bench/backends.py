"""Test-suite speed on the two backends: the same test files under ``--orc-backend=ray`` and ``--orc-backend=local``.

    python -m bench.backends [--repeats 1]

Runs, each in a fresh pytest process and back to back in this run: the user's test file of docs/testing.md
(``tests/plugin_user``, nothing but ``make_group``), and the backend contract suite (``tests/contract``) with its
``ray`` and its ``local`` parameter. Prints wall seconds per run (the whole pytest process: start-up, cluster,
tests, teardown) and the ratio ray / local. Target (issue 10): the user's file at least 3x faster in-process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._common import emit

ROOT = Path(__file__).resolve().parent.parent


def _pytest(args: list[str], cwd: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    summary = re.sub(r"=+", "", tail[0]).strip()
    if proc.returncode != 0:
        raise RuntimeError(f"pytest {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return {"wall_s": round(wall, 2), "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    runs: dict[str, list[dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        user = Path(tmp)
        for name in ("user_workers.py", "test_user_worker.py"):
            (user / name).write_text((ROOT / "tests" / "plugin_user" / name).read_text())
        for _ in range(args.repeats):
            for backend in ("ray", "local"):  # alternated, so a change in load hits both
                runs.setdefault(f"user_file_{backend}", []).append(
                    _pytest([f"--orc-backend={backend}", "--orc-num-cpus=2", str(user)], user))
            for backend in ("ray", "local"):
                runs.setdefault(f"contract_{backend}", []).append(
                    _pytest(["-k", backend, str(ROOT / "tests" / "contract")], ROOT))

    def best(key: str) -> float:
        return min(float(r["wall_s"]) for r in runs[key])

    emit({"bench": "backends", "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], "runs": runs,
          "user_file_speedup": round(best("user_file_ray") / best("user_file_local"), 2),
          "contract_speedup": round(best("contract_ray") / best("contract_local"), 2)})


if __name__ == "__main__":
    main()
