"""One local Ray cluster for the whole integration session: the orchestra pytest plugin's ``orc_cluster`` (4 logical
CPUs on loopback by default; ``--orc-num-cpus`` changes it), used by every test in this directory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def ray_cluster(orc_cluster: dict[str, float]) -> dict[str, float]:
    """Every integration test runs on the plugin's session cluster (started once, shut down at the end)."""
    return orc_cluster
