"""Reply completion: how the controller learns that N actor calls finished, three ways, on the same actors.

    python -m bench.replies [--ranks 1,2,4,8,16] [--iters 300] [--blocks 6]

Each sample is N bare actor calls (``Host.noop`` of a group's actors, no argument) and waiting for all their
replies:

- ``sync``: ``ray.get`` of the N refs (what a blocking controller such as verl's does);
- ``per_ref``: an asyncio gather of ``asyncio.wrap_future(ref.future())`` (Ray's async completion, one callback
  and one loop wake-up per ref: what orchestra did for calls on fewer than 8 ranks before reply lanes);
- ``lane``: the futures ``orchestra._replies.batched`` gives for the refs (a reply lane: one blocking ``ray.get``
  in a persistent thread, one loop callback; what a general-path orchestra call uses now).

The three run interleaved, ``--blocks`` blocks of ``iters / blocks`` calls each, so that drift on shared cores hits
them alike. Prints JSON: per size and way, the median wall ms per sample, the controller's CPU ms per sample (the
whole process) and that CPU split by thread (``/proc/self/task``): ``main`` (the event loop), ``ray_io`` (Ray's
I/O thread, which runs per-ref callbacks), ``lanes`` (the reply lanes), ``other``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import ray

import orchestra as orc
from orchestra import ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import _replies
from orchestra import dispatch as D

from ._common import emit

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


class Idle(Worker):
    @endpoint(D.broadcast())
    def noop(self) -> None:
        return None


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by kind."""
    out = {"main": 0.0, "ray_io": 0.0, "lanes": 0.0, "other": 0.0}
    pid = str(os.getpid())
    lanes = {str(lane.thread.native_id) for lane in list(_replies._lanes)}  # Python does not name OS threads
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) * _TICK_S
        kind = ("main" if tid == pid else "ray_io" if name == "worker.io" else
                "lanes" if tid in lanes else "other")
        out[kind] += cpu
    return out


async def measure(n: int, iters: int, blocks: int) -> dict:
    async with WorkerGroup(ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01), Idle,
                           group_name=f"replies{n}") as g:
        actors = g.actors  # raw handles: the calls below are bare Ray actor calls

        async def sync() -> None:
            ray.get([a.noop.remote() for a in actors])

        async def per_ref() -> None:
            await asyncio.gather(*[asyncio.wrap_future(a.noop.remote().future()) for a in actors])

        async def lane() -> None:
            futs = _replies.batched([a.noop.remote() for a in actors])
            assert futs is not None, "no reply lane was free"
            await asyncio.gather(*futs)

        ways = {"sync": sync, "per_ref": per_ref, "lane": lane}
        for fn in ways.values():  # warm up (and start a lane)
            for _ in range(10):
                await fn()
        wall: dict[str, list[float]] = {k: [] for k in ways}
        cpu = {k: 0.0 for k in ways}
        threads = {k: {"main": 0.0, "ray_io": 0.0, "lanes": 0.0, "other": 0.0} for k in ways}
        per_block = max(1, iters // blocks)
        for _ in range(blocks):
            for k, fn in ways.items():
                c0, t0 = time.process_time(), _thread_cpu()
                for _ in range(per_block):
                    s = time.perf_counter()
                    await fn()
                    wall[k].append((time.perf_counter() - s) * 1e3)
                cpu[k] += time.process_time() - c0
                for kind, v in _thread_cpu().items():
                    threads[k][kind] += v - t0.get(kind, 0.0)
        calls = per_block * blocks
        out: dict[str, float] = {}
        for k in ways:
            out[f"{k}_ms"] = round(statistics.median(wall[k]), 3)
            out[f"{k}_cpu_ms"] = round(cpu[k] / calls * 1e3, 3)
            for kind, v in threads[k].items():
                out[f"{k}_{kind}_cpu_ms"] = round(v / calls * 1e3, 3)
        out["lane_vs_sync"] = round(out["lane_ms"] / out["sync_ms"], 3)
        out["per_ref_vs_sync"] = round(out["per_ref_ms"] / out["sync_ms"], 3)
        return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1,2,4,8,16")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--blocks", type=int, default=6)
    a = p.parse_args()
    _replies.MIN_BATCH = 1  # the lane way at every size, one rank included (orchestra lanes calls from 2 ranks)
    orc.init(num_cpus=64)
    try:
        results = {n: await measure(n, a.iters, a.blocks) for n in (int(x) for x in a.ranks.split(","))}
    finally:
        orc.shutdown()
    emit({"bench": "replies", "ways": ["sync", "per_ref", "lane"],
          "note": "thread CPU from /proc at clock-tick resolution (10 ms): read it over many calls",
          "results": {str(n): r for n, r in results.items()}})


if __name__ == "__main__":
    asyncio.run(main())
