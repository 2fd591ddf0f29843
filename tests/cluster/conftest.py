"""Multi-node tests on ``ray.cluster_utils.Cluster`` (a head and worker nodes as processes on this machine).

They need their own Ray cluster, so they live apart from ``tests/integration`` (whose session starts one local
cluster for all its tests). The module's tests share one cluster (a cluster of three node processes costs seconds to
start and to shut down), connected with ``orc.init(address=...)`` — the remote-cluster path, which ships the code with
Ray's ``runtime_env`` — and shut down after the module's last test. The test that removes a node adds a 1-CPU node
back and waits until it is up, so every test finds a head with no CPUs and two live 1-CPU worker nodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

import orchestra as orc

# fast node-death detection: Ray's default takes tens of seconds to declare a killed node dead
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 1000}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head with no CPUs (it places nothing) plus two 1-CPU worker nodes; orchestra connected to it. Shared by the
    module's tests: each closes the groups it made, and one that removes a worker node adds a 1-CPU one back."""
    if ray.is_initialized():
        orc.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": FAST_HEALTH})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        # the remote-cluster path: this directory ships as the working_dir, orchestra/engines/pipelines as py_modules
        orc.init(address=c.address, runtime_env={"working_dir": str(Path(__file__).parent)})
        yield c
    finally:
        orc.shutdown()
        c.shutdown()
