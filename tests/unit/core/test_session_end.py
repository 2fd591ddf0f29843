"""What ``orc.shutdown()`` ends stays ended, and a second ``orc.init`` says what it does not take.

A ResourcePool made before ``orc.shutdown()`` reserved in the session that ended: on Ray a group on it failed with
Ray's "state API before ray.init()" naming neither the pool nor the shutdown, and on the in-process backend it quietly
started ranks of a backend that had ended. ``orc.init(num_cpus=64)`` while a cluster of 2 CPUs runs returned that
cluster without a word. Each script runs in a process of its own: ``orc.shutdown()`` here would also stop a Ray
cluster this session's other tests use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

POOL_AFTER_SHUTDOWN = """
import asyncio
import orchestra as orc
from orchestra import PlacementError, ResourcePool, WorkerGroup
from test_local_backend import Keeper

async def main():
    orc.init(backend="local", num_cpus=2)
    old = ResourcePool([1])
    async with WorkerGroup(old, Keeper) as g:
        await g.describe()
    orc.shutdown()
    orc.init(backend="local", num_cpus=2)
    g = WorkerGroup(old, Keeper)
    try:
        await g.ready()
    except PlacementError as e:
        assert "made before orc.shutdown()" in str(e) and "make a new ResourcePool" in str(e), e
        print("refused")
    else:
        print("ran on a pool of an ended session")
    await g.aclose()
    async with WorkerGroup(ResourcePool([1]), Keeper) as g:  # a new pool works
        await g.describe()
    orc.shutdown()
    print("ok")

asyncio.run(main())
"""

INIT_TWICE = """
import logging
import orchestra as orc
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
orc.init(backend="local", num_cpus=2)
orc.init(backend="local", num_cpus=2)
print("--- same settings: no warning above this line")
s = orc.init(backend="local", num_cpus=64)
assert s["CPU"] == 2.0
orc.shutdown()
print("ok")
"""


def _run(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_a_pool_made_before_shutdown_is_refused_after_it_naming_what_to_do():
    proc = _run(POOL_AFTER_SHUTDOWN)
    assert proc.returncode == 0 and proc.stdout.split() == ["refused", "ok"], proc.stdout + proc.stderr


def test_init_again_with_other_resources_warns_that_they_are_not_taken():
    proc = _run(INIT_TWICE)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, proc.stderr
    assert "num_cpus=64 (it has 2)" in warnings[0] and "orc.shutdown() first" in warnings[0]
