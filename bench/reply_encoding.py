"""What a general-path reply costs by how it is encoded: a small Batch result as an Output object vs as one frame.

    python -m bench.reply_encoding [--ranks 4] [--iters 300] [--blocks 6]

Each sample is N bare Ray actor calls and a blocking ``ray.get`` of their replies (no orchestra call path, so that
only the reply's encoding differs):

- ``none``: the actor returns None (the floor);
- ``output``: it returns the Output header of a 4-row Batch result with its rows inline, as a rank's reply was
  before 2026-12-04 (Ray pickles the object with cloudpickle; the controller unpickles it in ``ray.get``);
- ``frame``: it returns the same Output as one frame (``_frame.dumps_frame``, what ``Host._reply`` does now), and
  the controller reads each with ``_frame.read_reply``.

The three run interleaved, ``--blocks`` blocks of ``iters / blocks`` samples each. Prints JSON: per way, the median
wall ms per sample, the controller's CPU ms per sample (the whole process) and each rank's CPU ms per sample
(``/proc/<pid>/stat``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
import torch

from orchestra import Batch, _frame
from orchestra._wire import Output, PartInfo

from ._common import emit

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _output() -> Output:
    b = Batch.from_dict({"x": torch.arange(4)})
    return Output(0, parts=(PartInfo(b, len(b), b.nbytes, tag="bench:0:1"),), keys=tuple(b.keys()))


@ray.remote(num_cpus=0.01)
class _Rank:
    def pid(self) -> int:
        return os.getpid()

    def none(self) -> None:
        return None

    def output(self) -> Output:
        return _output()

    def frame(self) -> bytes:
        return _frame.dumps_frame(_output())


def _cpu(pids: list[int]) -> float:
    total = 0
    for p in pids:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total * _TICK_S


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--blocks", type=int, default=6)
    a = p.parse_args()
    ray.init(num_cpus=max(8, a.ranks), include_dashboard=False, logging_level="ERROR")
    ranks = [_Rank.remote() for _ in range(a.ranks)]
    pids = ray.get([r.pid.remote() for r in ranks])
    ways = {
        "none": lambda: ray.get([r.none.remote() for r in ranks]),
        "output": lambda: ray.get([r.output.remote() for r in ranks]),
        "frame": lambda: [_frame.read_reply(v) for v in ray.get([r.frame.remote() for r in ranks])],
    }
    assert ways["frame"]()[0].parts[0].ref["x"].tolist() == ways["output"]()[0].parts[0].ref["x"].tolist()
    per = max(1, a.iters // a.blocks)
    wall: dict[str, list[float]] = {k: [] for k in ways}
    ctl: dict[str, list[float]] = {k: [] for k in ways}
    rank: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():  # warm up
        for _ in range(20):
            fn()
    for _ in range(a.blocks):
        for k, fn in ways.items():
            t, c, r = time.perf_counter(), time.process_time(), _cpu(pids)
            for _ in range(per):
                fn()
            wall[k].append((time.perf_counter() - t) / per * 1e3)
            ctl[k].append((time.process_time() - c) / per * 1e3)
            rank[k].append((_cpu(pids) - r) / per / len(pids) * 1e3)
    out = {"bench": "reply_encoding", "ranks": a.ranks, "iters": per * a.blocks, "blocks": a.blocks}
    for k in ways:
        out[k] = {"wall_ms": round(statistics.median(wall[k]), 3), "controller_cpu_ms": round(statistics.median(ctl[k]), 3),
                  "rank_cpu_ms": round(statistics.median(rank[k]), 3)}
    out["frame_over_output_wall"] = round(out["frame"]["wall_ms"] / out["output"]["wall_ms"], 3)
    out["frame_over_output_controller_cpu"] = round(out["frame"]["controller_cpu_ms"] / out["output"]["controller_cpu_ms"], 3)
    emit(out)
    ray.shutdown()


if __name__ == "__main__":
    main()
