"""Soak: thousands of mixed calls with random cancellations, deadlines and a killed rank; nothing may leak.

    python -m bench.soak [--calls 5000] [--concurrency 8] [--seed 0]

Mixes shard calls, broadcasts, generator streams, ``stream()`` maps over them, forwarded chains and unions, with
~10 % of calls cancelled at a random point and ~10 % given a deadline that may expire. Part-way through, one rank
of the working group is SIGKILLed: the calls in flight fail with WorkerDiedError, the group is closed and a new
one takes its place. Every result that comes back is checked against the value computed locally.

Prints JSON: calls by outcome, wrong results (must be 0), controller RSS at start and end (growth < 50 MiB),
orchestra tasks left (0), calls still registered in flight (0), and objects the controller still references once
the last future is dropped (0; from Ray's reference counter — workers' results are freed when it lets go).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import signal
import sys
import time

import anyio
import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup

from ._common import emit, rss_mib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
from orc_test_workers import Hazard  # noqa: E402  (importable by the workers through PYTHONPATH)


def xs(n: int, start: int = 0) -> Batch:
    return Batch.from_dict({"x": torch.arange(start, start + n)})


def _check(kind: str, n: int, start: int, out: object) -> bool:
    x = torch.arange(start, start + n)
    if kind == "shard":
        return torch.equal(out["a"], x + 1)
    if kind == "broadcast":
        return out == [f"t{start}"] * 2
    if kind == "generator":
        return torch.equal(out["x"], x)
    if kind == "stream":
        return torch.equal(out["y"], x * 2)
    if kind == "forward":
        return torch.equal(out["a"], x + 1)
    if kind == "union":
        return torch.equal(out["a"], x + 1) and torch.equal(out["s"], x * 2)
    return False


def _call(g: WorkerGroup, kind: str, n: int, start: int, timeout: float | None) -> orc.DataFuture:
    o = {"timeout": timeout} if timeout else {}
    b = xs(n, start)
    if kind == "shard":
        return g.add1.options(**o)(b)
    if kind == "broadcast":
        return g.mark.options(**o)(f"t{start}")
    if kind == "generator":
        return g.slow_gen.options(**o)(b, pieces=2, delay=0.0)
    if kind == "stream":
        return g.per_part.options(**o)(g.slow_gen(b, pieces=2, delay=0.0))
    if kind == "forward":
        return g.add1.options(**o)(g.echo(b))
    return g.echo.options(**o)(g.add1(b) | g.score(b))


def _objects_in_store() -> int:
    """Objects the controller still references (owned or borrowed) according to Ray's reference counter: the
    workers' result objects are freed once the controller drops them, so 0 here means nothing is pinned."""
    counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    return sum(1 for c in counts.values() if c.get("local", 0) or c.get("submitted", 0))


async def soak(calls: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    pool = lambda: ResourcePool(process_on_nodes=[2], cpus_per_worker=0.1)  # noqa: E731
    state = {"g": await WorkerGroup(pool(), Hazard, group_name="soak0").ready(), "gen": 0}
    kill_at = calls // 2
    outcomes: dict[str, int] = {}
    wrong: list[str] = []
    slots = anyio.Semaphore(concurrency)
    replacing = anyio.Lock()

    def count(k: str) -> None:
        outcomes[k] = outcomes.get(k, 0) + 1

    async def replace_group(old: WorkerGroup) -> None:
        async with replacing:
            if state["g"] is not old:  # another call already replaced it
                return
            await old.aclose()
            state["gen"] += 1
            state["g"] = await WorkerGroup(pool(), Hazard, group_name=f"soak{state['gen']}").ready()

    async def one(i: int) -> None:
        try:
            await _one(i)
        finally:
            slots.release()

    async def _one(i: int) -> None:
        if True:
            g = state["g"]
            kind = rng.choice(["shard", "broadcast", "generator", "stream", "forward", "union"])
            n, start = rng.choice([4, 8, 16, 64]), rng.randrange(1000)
            action = rng.random()
            timeout = rng.choice([0.005, 0.05, 1.0]) if action < 0.1 else None
            try:
                fut = _call(g, kind, n, start, timeout)
            except orc.GroupClosedError:
                count("closed")
                return
            if i == kill_at:  # a rank dies while this call runs
                pid = (await g.describe())[1]["pid"]
                os.kill(pid, signal.SIGKILL)
            try:
                if 0.1 <= action < 0.2:
                    await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01]))
                    fut.cancel()
                out = await fut
            except orc.CallCancelledError:
                count("cancelled")
            except orc.CallTimeoutError:
                count("timed_out")
            except (orc.WorkerDiedError, orc.GroupClosedError) as e:
                count("died" if isinstance(e, orc.WorkerDiedError) else "closed")
                await replace_group(g)
            else:
                count("ok")
                if not _check(kind, n, start, out):
                    wrong.append(f"call {i} {kind} n={n} start={start}")

    gc.collect()
    await asyncio.sleep(0.5)
    rss0, obj0 = rss_mib(), _objects_in_store()
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(calls):
            await slots.acquire()  # bounded: at most `concurrency` calls in flight
            tg.start_soon(one, i)
    wall = time.perf_counter() - t0
    g = state["g"]
    live = len(g._shared.live)
    await g.aclose()
    gc.collect()
    with anyio.move_on_after(10):
        while [t for t in asyncio.all_tasks() if t.get_name().startswith("orchestra:")]:
            await asyncio.sleep(0.05)
    tasks_left = len([t for t in asyncio.all_tasks() if t.get_name().startswith("orchestra:")])
    objects = None
    with anyio.move_on_after(20):
        while True:  # object frees are asynchronous: wait (bounded) for the store to drain
            gc.collect()
            objects = _objects_in_store()
            if not objects:
                break
            await asyncio.sleep(0.25)
    rss1 = rss_mib()
    return {
        "calls": calls, "concurrency": concurrency, "seed": seed, "wall_s": round(wall, 1),
        "outcomes": dict(sorted(outcomes.items())), "wrong_results": len(wrong), "wrong_examples": wrong[:5],
        "groups_replaced": state["gen"], "rss_mib_start": round(rss0, 1), "rss_mib_end": round(rss1, 1),
        "rss_growth_mib": round(rss1 - rss0, 1), "orchestra_tasks_left": tasks_left, "calls_in_flight_left": live,
        "objects_in_store_start": obj0, "objects_in_store_end": objects,
        "pass": (not wrong and tasks_left == 0 and live == 0 and rss1 - rss0 < 50 and not objects
                 and outcomes.get("ok", 0) > calls // 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    orc.init(num_cpus=4)
    try:
        result = orc.run(soak(a.calls, a.concurrency, a.seed))
    finally:
        orc.shutdown()
    emit({"bench": "soak", **result})
    if not result["pass"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
