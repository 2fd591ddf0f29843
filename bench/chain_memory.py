"""What a loop that feeds each result into the next call keeps alive: ``x = g.echo(x)`` on 2 ranks.

    python -m bench.chain_memory [--steps 200] [--mib 1]

Each step's result holds ``--mib`` MiB of rows per rank, stored in Ray's object store (above the size that rides in
a reply). The loop never awaits the chain: it awaits a broadcast call each step (each rank runs it after the chain's
call), as a training loop awaits its metrics. Run twice, over the fast path (the default for a repeated call) and
with it off (one Ray actor task per rank).

Prints JSON: at every tenth of the steps, the objects the controller references according to Ray's reference
counter (``objects_held``), the calls of the chain still alive in the controller (``calls_alive``, weak references
to each step's call) and the controller's RSS in MiB; and the objects held at the end. A call that keeps its inputs
after it finished keeps the whole chain: ``objects_held`` and ``calls_alive`` grow with the steps; they should stay
flat (the last call and its upstream: 2 calls, one object per rank each).
"""

from __future__ import annotations

import argparse
import gc
import weakref

import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

from ._common import emit, rss_mib
from .soak import _objects_in_store


class Chained(Worker):
    @endpoint(D.shard())
    def echo(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.broadcast())
    def noop(self) -> None:
        return None


async def _loop(g: WorkerGroup, steps: int, mib: float) -> list[dict[str, float]]:
    cols = max(1, int(mib * 2**20 / 4 / 8))  # 8 rows a rank of float32
    x = g.echo(Batch.from_dict({"x": torch.arange(16), "w": torch.ones(16, cols)}))
    alive: list[weakref.ref] = []
    marks = []
    every = max(1, steps // 10)
    for i in range(1, steps + 1):
        x = g.echo(x)
        alive.append(weakref.ref(x._inv))
        await g.noop()  # each rank runs it after the chain's call; the chain itself is never awaited
        if i % every == 0:
            gc.collect()
            marks.append({"step": i, "objects_held": _objects_in_store(),
                          "calls_alive": sum(r() is not None for r in alive), "rss_mib": round(rss_mib(), 1)})
    assert (await x)["x"].tolist() == list(range(16))
    return marks


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--mib", type=float, default=1.0)
    a = p.parse_args()
    orc.init(num_cpus=8)
    out: dict[str, object] = {"bench": "chain_memory", "steps": a.steps, "mib_per_rank": a.mib}
    try:
        async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Chained,
                               group_name="chain") as g:
            for name, fast in (("fast_path", True), ("ray_calls", False)):
                g.fast_path = fast
                out[name] = await _loop(g, a.steps, a.mib)
                gc.collect()
                out[name + "_objects_held_after"] = _objects_in_store()
    finally:
        orc.shutdown()
    emit(out)


if __name__ == "__main__":
    orc.run(main())
