"""A restart waits until the live nodes fit every pool of the job again, bounded by runner.restart_timeout_s."""

from __future__ import annotations

import pytest

import orchestra as orc
from orchestra import ResourcePool
from pipelines import cluster as cl


def _nodes(*cpus: float, dead: tuple[float, ...] = ()) -> list[dict]:
    return ([{"Alive": True, "Resources": {"CPU": c}} for c in cpus]
            + [{"Alive": False, "Resources": {"CPU": c}} for c in dead])


def test_pools_that_fit_the_live_nodes_have_no_problems(monkeypatch):
    monkeypatch.setattr("ray.nodes", lambda: _nodes(1.0, 1.0))
    assert cl.capacity_problems([ResourcePool([2, 2]), ResourcePool([1])]) == []


def test_a_lost_node_is_a_problem_naming_the_pool_entry_and_the_total(monkeypatch):
    monkeypatch.setattr("ray.nodes", lambda: _nodes(0.5, dead=(1.0,)))
    problems = cl.capacity_problems([ResourcePool([2, 2], name="actor"), ResourcePool([1], name="reward")])
    assert not any("'actor'" in p for p in problems)  # each entry (0.5 CPU) still fits the live node
    assert any("CPU: the pools need 1.25, the live nodes have 0.5" in p for p in problems)
    monkeypatch.setattr("ray.nodes", lambda: _nodes(0.25, 0.25))
    assert any("pool 'actor' entry 0" in p for p in cl.capacity_problems([ResourcePool([2], name="actor")]))


async def test_waiting_ends_when_a_replacement_node_joins(monkeypatch):
    polls = []

    def nodes() -> list[dict]:
        polls.append(1)
        return _nodes(0.5) if len(polls) < 3 else _nodes(0.5, 1.0)  # the third look sees the new node

    monkeypatch.setattr("ray.nodes", nodes)
    await cl.wait_for_capacity([ResourcePool([2, 2])], timeout_s=60, poll_s=0)
    assert len(polls) == 3


async def test_waiting_is_bounded_and_says_what_is_missing(monkeypatch):
    monkeypatch.setattr("ray.nodes", lambda: _nodes(0.25))
    with pytest.raises(orc.PlacementError, match=r"(?s)restart_timeout_s=0.05 s:\n  - .*CPU: the pools need 1, the live nodes have 0.25"):
        await cl.wait_for_capacity([ResourcePool([2, 2])], timeout_s=0.05, poll_s=0.01)
