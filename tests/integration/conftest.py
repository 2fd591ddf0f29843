"""One local Ray cluster for the whole integration session: the orchestra pytest plugin's ``orc_cluster`` (4 logical
CPUs on loopback by default; ``--orc-num-cpus`` changes it), used by every test in this directory.

Starting a rank costs a Ray worker process that imports torch (seconds each on a loaded 2-core box), so the groups
that only serve as a fixed test bed are started once and shared by the modules that use them:
``scorers`` (Scorer groups of 2, 3 and 4 ranks). They reserve almost no CPU (so the rest of the session can still place its pools) and are shut down right after the last test that uses
them, not at the end of the session. Tests that change a shared group's state put it back (scale 1.0 unless a module
fixture sets its own); tests that need a group of their own (deaths, init failures, leak checks) still make one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from orchestra import WorkerGroup

SHARED_CPUS_PER_WORKER = 0.01
_SHARED: dict[str, list[WorkerGroup]] = {}  # fixture name -> its groups, while they run
_LAST_USER: dict[str, str] = {}  # fixture name -> nodeid of the last collected test that uses it


@pytest.fixture(scope="session", autouse=True)
def ray_cluster(orc_cluster: dict[str, float]) -> dict[str, float]:
    """Every integration test runs on the plugin's session cluster (started once, shut down at the end)."""
    return orc_cluster


@pytest.fixture(scope="session")
async def scorers(orc_cluster: dict[str, float]) -> AsyncIterator[dict[int, WorkerGroup]]:
    """``{2: s2, 3: s3, 4: s4}``: ready Scorer groups (scale 1.0), named ``s2``/``s3``/``s4``."""
    import asyncio

    from orc_test_workers import Scorer

    from orchestra import ResourcePool, WorkerGroup

    gs = {n: WorkerGroup(ResourcePool(process_on_nodes=[n], cpus_per_worker=SHARED_CPUS_PER_WORKER), Scorer, 1.0,
                         group_name=f"s{n}") for n in (2, 3, 4)}
    _SHARED["scorers"] = list(gs.values())
    try:
        await asyncio.gather(*[g.ready() for g in gs.values()])
        yield gs
    finally:
        _shutdown("scorers")


def _shutdown(name: str) -> None:
    for g in _SHARED.pop(name, []):
        g.shutdown()


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # after deselection and reordering: the order the tests will run in
        for name in ("scorers",):
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Shut a shared fixture's groups down once its last test has run (its value is never used again)."""
    for name, nodeid in _LAST_USER.items():
        if item.nodeid == nodeid:
            _shutdown(name)
