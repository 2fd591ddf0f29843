"""``engines._dist.spawn`` forks ranks from a fork server that imported torch and the engines once, instead of
starting an interpreter per rank. A rank sees the caller's environment as it was at the call, and nothing else of
the caller; once the environment (other than what pytest changes per test) or ``sys.path`` differs from the one
the server started with, ranks start as fresh interpreters, so that what the preloaded modules read when they were
imported is never stale."""

from __future__ import annotations

import logging
import os
import sys

import pytest
from engines_testutils import dies_without_a_word, process_report_worker

import engines._dist as dist_mod
from engines._dist import spawn

pytestmark = pytest.mark.timeout(300)

_NAMES = ["ORC_SPAWN_PROBE", "PYTEST_CURRENT_TEST"]


def _server_started_here(monkeypatch) -> None:
    """Pretend the fork server started with this process's environment and sys.path as they are now."""
    env = {k: v for k, v in os.environ.items() if k not in dist_mod.VOLATILE_ENV}
    monkeypatch.setattr(dist_mod, "_server_key", [(env, list(sys.path))])


def test_the_fork_server_is_used_while_the_environment_and_path_are_the_ones_it_started_with(monkeypatch, caplog):
    monkeypatch.delenv("ORC_SPAWN_PROBE", raising=False)
    _server_started_here(monkeypatch)
    assert dist_mod._start_method() == "forkserver"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # pytest changes it per test; no import reads it
    assert dist_mod._start_method() == "forkserver"
    caplog.set_level(logging.INFO, logger="orchestra")
    with monkeypatch.context() as m:
        m.setenv("ORC_SPAWN_PROBE", "changed")
        assert dist_mod._start_method() == "spawn"
    assert "spawn: ORC_SPAWN_PROBE changed since the fork server started" in caplog.text
    assert dist_mod._start_method() == "forkserver"  # undone: the server again
    with monkeypatch.context() as m:
        m.setattr(sys, "path", [*sys.path, "/somewhere/else"])
        assert dist_mod._start_method() == "spawn"
    assert "spawn: sys.path changed since the fork server started" in caplog.text


def test_ranks_start_fresh_where_cuda_is_available(monkeypatch):
    """Importing the engines may initialize CUDA's driver in the fork server; a process forked after that cannot use
    CUDA, so with CUDA every rank starts as a fresh interpreter."""
    _server_started_here(monkeypatch)
    monkeypatch.setattr(dist_mod.torch.cuda, "is_available", lambda: True)
    assert dist_mod._start_method() == "spawn"


def test_a_fork_server_something_else_started_gives_fresh_interpreters(monkeypatch, caplog):
    """Its environment and preloads are unknown here, so nothing is forked from it."""
    monkeypatch.setattr(dist_mod, "_server_key", [])
    monkeypatch.setattr(dist_mod, "_server_running_elsewhere", lambda: True)
    caplog.set_level(logging.INFO, logger="orchestra")
    assert dist_mod._start_method() == "spawn"
    assert dist_mod._server_key == [None]
    assert "a fork server this module did not start already runs" in caplog.text
    assert dist_mod._start_method() == "spawn"


@pytest.mark.slow  # forks ranks (and starts the fork server if no earlier test did)
def test_forked_ranks_see_the_callers_environment_at_the_call_and_none_of_its_state(monkeypatch):
    monkeypatch.setattr(dist_mod, "parent_only", "set in the parent", raising=False)  # must not reach a rank
    monkeypatch.delenv("ORC_SPAWN_PROBE", raising=False)
    method = dist_mod._start_method()  # forkserver unless the environment changed since the server started
    ranks = spawn(process_report_worker, 2, _NAMES)  # (e.g. Ray started after it: RAY_CLIENT_MODE is then set)
    assert [r["rank"] for r in ranks] == ["0", "1"]
    # the rank started the way spawn decided; a forked rank with a stale value of the variable pytest sets per test
    # would show that it kept the server's environment
    assert [r["start_method"] for r in ranks] == [method] * 2
    assert [r["env:PYTEST_CURRENT_TEST"] for r in ranks] == [os.environ["PYTEST_CURRENT_TEST"]] * 2
    assert [r["parent_only"] for r in ranks] == ["", ""]
    # each rank's global generators are seeded afresh, as in a new interpreter: no two ranks, or calls, draw alike
    again = spawn(process_report_worker, 2, _NAMES)
    per_generator = list(zip(*(r["draws"].split() for r in ranks + again)))  # (torch, numpy, Python) draws
    assert [len(set(d)) for d in per_generator] == [4, 4, 4], per_generator


@pytest.mark.slow  # forks a rank
def test_a_rank_that_dies_without_a_report_is_named_with_how_it_ended():
    with pytest.raises(RuntimeError, match=r"spawned rank failed:\n.*no rank reported an error \(one died: .*exit code 3"):
        spawn(dies_without_a_word, 1)


@pytest.mark.slow  # fresh interpreters
def test_a_changed_environment_gives_fresh_ranks_that_see_it(monkeypatch):
    monkeypatch.setattr(dist_mod, "parent_only", "set in the parent", raising=False)
    monkeypatch.setenv("ORC_SPAWN_PROBE", "changed")
    ranks = spawn(process_report_worker, 1, _NAMES)
    assert [(r["start_method"], r["env:ORC_SPAWN_PROBE"], r["parent_only"]) for r in ranks] == [("spawn", "changed", "")]
