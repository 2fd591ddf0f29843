"""The fast tier, ``python -m pytest -q -m "not slow"``: every test that needs a Ray cluster is marked ``slow`` here.

A Ray cluster costs seconds to start, and every rank of every group is a fresh worker process that imports torch
(2-4 s each on a quiet 2-core box, 10 s and more on a loaded one), so no test on Ray fits a one-minute tier. The
rule: a test that uses the orchestra plugin's ``orc_cluster`` fixture (every test under ``tests/integration`` through
its autouse fixture, and every ``make_group`` test) or a multi-node cluster (``tests/cluster``) is slow. Tests that
spawn processes of their own (``engines._dist.spawn``) carry ``@pytest.mark.slow`` themselves. Tests on the in-process
backend need no cluster and stay in the fast tier (``tests/contract``: the ``local`` runs; its conftest marks the
``ray`` runs slow).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

_CLUSTER_DIR = Path(__file__).parent / "cluster"
_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        needs_ray = "orc_cluster" in getattr(item, "fixturenames", ()) or _CLUSTER_DIR in Path(item.path).parents
        if needs_ray and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def load_example() -> Callable[[str], ModuleType]:
    """``load_example("name")`` imports ``examples/name.py`` as a module (the examples are scripts, not a package),
    once a session, so a test can call its functions without running its ``main``."""
    loaded: dict[str, ModuleType] = {}

    def load(name: str) -> ModuleType:
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"example_{name}", _EXAMPLES / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            loaded[name] = mod
        return loaded[name]

    return load
