"""Group start-up: wall time from creating an N-rank group to its first reply, and each rank's CPU by then.

    python -m bench.startup [--ranks 4] [--rounds 3]

Each round starts fresh processes, four ways, interleaved:

- ``orchestra``: ``WorkerGroup(pool, Plain)`` and ``await g.cpu()``. Each rank imports torch, tensordict (without
  ``torch._dynamo``, see ``orchestra/_tensordict.py``) and orchestra;
- ``ray_bare``: N raw Ray actors that import nothing more than Ray's worker does (the floor of a process start);
- ``ray_torch``: N raw Ray actors that import torch;
- ``ray_torch_tensordict``: N raw Ray actors that import torch and tensordict the plain way, ``torch._dynamo``
  included. That is what a rank paid before the shim, and what any Ray worker that handles TensorDicts pays.

Prints JSON: per way, median wall seconds to the first reply and median CPU seconds per rank (``os.times`` in the
rank, so it counts its imports and start, not the controller's work).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import ray

import orchestra as orc
from orchestra import ResourcePool, Worker, WorkerGroup, endpoint

from ._common import emit


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


class Plain(Worker):
    """Does nothing but report its process's CPU."""

    @endpoint
    def cpu(self) -> float:
        return _cpu()


class _Raw:
    """A raw Ray actor that imports ``modules`` in its constructor, then reports its process's CPU."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        import importlib

        for m in modules:
            importlib.import_module(m)

    def cpu(self) -> float:
        return _cpu()


RAW = {"ray_bare": (), "ray_torch": ("torch",), "ray_torch_tensordict": ("torch", "tensordict")}


async def _orchestra(ranks: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    async with WorkerGroup(ResourcePool(process_on_nodes=[ranks], cpus_per_worker=0.5), Plain) as g:
        cpus = await g.cpu()
        wall = time.perf_counter() - t0
    return wall, statistics.fmean(cpus)


def _raw(ranks: int, modules: tuple[str, ...]) -> tuple[float, float]:
    cls = ray.remote(num_cpus=0.5)(_Raw)
    t0 = time.perf_counter()
    actors = [cls.remote(modules) for _ in range(ranks)]
    try:
        cpus = ray.get([a.cpu.remote() for a in actors])
        wall = time.perf_counter() - t0
    finally:
        for a in actors:
            ray.kill(a)
    return wall, statistics.fmean(cpus)


async def measure(ranks: int, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in ("orchestra", *RAW)}
    for _ in range(rounds):
        samples["orchestra"].append(await _orchestra(ranks))
        for name, modules in RAW.items():
            samples[name].append(await asyncio.to_thread(_raw, ranks, modules))
    out: dict[str, Any] = {"ranks": ranks, "rounds": rounds}
    for name, got in samples.items():
        out[name] = {"wall_s": round(statistics.median(w for w, _ in got), 3),
                     "rank_cpu_s": round(statistics.median(c for _, c in got), 3),
                     "samples": [[round(w, 3), round(c, 3)] for w, c in got]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    orc.init(num_cpus=max(8, args.ranks))
    try:
        emit(asyncio.run(measure(args.ranks, args.rounds)))
    finally:
        orc.shutdown()


if __name__ == "__main__":
    main()
