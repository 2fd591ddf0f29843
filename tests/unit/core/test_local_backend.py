"""The in-process backend's own rules (the contract it shares with Ray is in tests/contract): what is copied when,
what a death does to queued calls, how placement waits, and how the backend is chosen."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra._local import LocalBackend


class Keeper(Worker):
    def __init__(self) -> None:
        self.kept: list = []
        self.gate = threading.Event()

    @endpoint
    def keep(self, t: torch.Tensor) -> int:
        self.kept.append(t)
        return len(self.kept)

    @endpoint
    def first(self) -> list:
        return self.kept[0].tolist()

    @endpoint
    def block(self) -> str:
        self.gate.wait(60)
        return "released"

    @endpoint(D.shard())
    def rows(self, b: Batch) -> Batch:
        return b


@pytest.fixture
def backend():
    return LocalBackend(num_cpus=2)


async def test_arguments_are_copied_when_the_call_is_sent(backend):
    async with WorkerGroup(ResourcePool([1], backend=backend), Keeper) as g:
        t = torch.zeros(3)
        fut = g.keep(t)
        t.add_(5)  # after sending: the call must not see it (as on Ray, which serializes at .remote())
        assert await fut == [1]
        assert await g.first() == [[0.0, 0.0, 0.0]]


async def test_a_killed_rank_fails_its_running_and_queued_calls(backend):
    g = WorkerGroup(ResourcePool([1], backend=backend), Keeper)
    await g.ready()
    running, queued = g.block(), g.first()
    backend.kill(g.actors[0])
    for fut in (running, queued):
        with pytest.raises(orc.WorkerDiedError):
            await fut
    with pytest.raises(orc.WorkerDiedError):  # the control lane is gone too
        await g.ping()
    await g.aclose()


async def test_placement_waits_for_another_pools_release(backend):
    first = WorkerGroup(ResourcePool([2], cpus_per_worker=1.0, backend=backend), Keeper)
    await first.ready()
    refused = WorkerGroup(ResourcePool([2], cpus_per_worker=1.0, placement_timeout=0.1, backend=backend), Keeper)
    with pytest.raises(orc.PlacementError, match="not free"):  # every CPU is held by the first pool
        await refused.ready()
    await refused.aclose()
    second = WorkerGroup(ResourcePool([2], cpus_per_worker=1.0, backend=backend), Keeper)
    waiting = asyncio.ensure_future(second.ready())
    await first.aclose()
    await asyncio.wait_for(waiting, 30)  # placed once the first pool's CPUs came back
    assert await second.ping() == [0, 1]
    await second.aclose()


def test_a_pool_names_its_backend():
    assert ResourcePool([1], backend="local").backend.name == "local"
    with pytest.raises(ValueError, match="choose 'ray' or 'local'"):
        ResourcePool([1], backend="slurm")


def test_init_local_takes_no_cluster_arguments():
    with pytest.raises(ValueError, match="starts no cluster"):
        orc.init(backend="local", address="ray://somewhere:10001")
    with pytest.raises(ValueError, match="choose 'ray'"):
        orc.init(backend="threads")


INIT_LOCAL = """
import asyncio
import orchestra as orc
from orchestra import ResourcePool, WorkerGroup, _backend
from test_local_backend import Keeper

async def main():
    session = orc.init(backend="local", num_cpus=3)
    assert session["CPU"] == 3.0
    pool = ResourcePool([1])
    assert pool.backend.name == "local"
    async with WorkerGroup(pool, Keeper) as g:
        assert (await g.describe())[0]["node_id"] == "local"
    orc.shutdown()
    assert _backend.current().name == "ray"
    print("ok")

asyncio.run(main())
"""


def test_init_local_makes_new_pools_in_process_until_shutdown():
    """In a process of its own: ``orc.shutdown()`` here would also stop a Ray cluster this session's other tests
    use."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", INIT_LOCAL], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
