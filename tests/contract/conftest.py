"""The backend contract: every test in this directory runs on both backends — ``ray`` (a local Ray cluster, one
process per rank) and ``local`` (every rank in this process) — through the ``backend`` fixture, so the two cannot
drift. The ``ray`` runs need the session's Ray cluster and are marked ``slow``; the ``local`` runs need no cluster
and are part of the fast tier. With ``--orc-backend=local`` (no Ray in the session) the ``ray`` runs are skipped.

``make_group`` is the orchestra plugin's fixture (same leak checks) with the pool's backend set to the test's; tests
whose subject is not a group's own life share ``bed``: Echo groups of 2 and 3 ranks and a 2-rank Meshed group per
backend, started once (a Ray group costs seconds to start). A test that changes a bed group's state puts it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from orchestra.testing import _plugin

BACKENDS = ("ray", "local")
_HERE = Path(__file__).parent


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """``"ray"`` or ``"local"``: where this test's groups run."""
    if request.param == "ray":
        if _plugin.backend(request.config) == "local":
            pytest.skip("--orc-backend=local: this session starts no Ray cluster")
        request.getfixturevalue("orc_cluster")
    return request.param


class _Factory(_plugin.GroupFactory):
    def __init__(self, loop: asyncio.AbstractEventLoop, backend: str) -> None:
        super().__init__(loop)
        self.backend = backend

    async def __call__(self, cls: type, *init_args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", self.backend)
        return await super().__call__(cls, *init_args, **kwargs)


@pytest_asyncio.fixture
async def make_group(backend: str) -> AsyncIterator[_plugin.GroupFactory]:
    """The plugin's ``make_group`` on this test's backend."""
    loop = asyncio.get_running_loop()
    before = {t for t in asyncio.all_tasks(loop) if t.get_name().startswith("orchestra:")}
    factory = _Factory(loop, backend)
    yield factory
    problems = await _plugin.close_and_check(factory, before)
    if problems:
        pytest.fail("make_group: left behind after the test:\n  - " + "\n  - ".join(problems), pytrace=False)


@pytest_asyncio.fixture(scope="session")
async def bed(backend: str) -> AsyncIterator[dict[str, Any]]:
    """``{"e2": Echo x2, "e3": Echo x3, "mesh": Meshed x2}`` on this backend (scale 1.0), ready."""
    from contract_workers import Echo, Meshed

    from orchestra import ResourcePool, WorkerGroup

    def pool(n: int) -> ResourcePool:
        return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend=backend)

    groups = {"e2": WorkerGroup(pool(2), Echo, group_name="e2"), "e3": WorkerGroup(pool(3), Echo, group_name="e3"),
              "mesh": WorkerGroup(pool(2), Meshed, group_name="mesh")}
    try:
        await asyncio.gather(*[g.ready() for g in groups.values()])
        yield groups
    finally:
        for g in groups.values():
            await g.aclose()


@pytest.fixture
def seq(backend: str) -> Iterator[Any]:
    """A Sequencer on this test's backend."""
    from orchestra.testing import Sequencer

    s = Sequencer(backend=backend)
    try:
        yield s
    finally:
        s.close()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if _HERE in Path(item.path).parents and params.get("backend") == "ray":
            item.add_marker(pytest.mark.slow)
