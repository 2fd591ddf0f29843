"""One local Ray cluster for the whole integration session (4 logical CPUs on loopback)."""

from __future__ import annotations

import pytest

import orchestra as orc


@pytest.fixture(scope="session", autouse=True)
def ray_cluster():
    orc.init(num_cpus=4)
    yield
    orc.shutdown()
