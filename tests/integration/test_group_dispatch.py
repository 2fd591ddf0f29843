"""Dispatch on a real local Ray cluster: what only a group of Ray worker processes shows — each rank's process
environment and placement, call order over Ray actors, the control lanes answering while the compute lane is busy.

The dispatch transforms themselves (shard, pad, scatter, rank_zero, metrics, meshes, async endpoints, functions as
arguments) are checked in-process by tests/unit/core/test_group_semantics_local.py, and on both backends by
tests/contract."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
async def g4(scorers):
    """The session's 4-rank Scorer group (conftest; scale 1.0)."""
    return scorers[4]


async def test_rank_env_and_identity(g4):
    infos = await g4.rank_info()
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert {i["world"] for i in infos} == {4}
    for i in infos:
        env = i["env"]
        assert env["RANK"] == str(i["rank"]) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(i["local_rank"])
        assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
    assert len({i["env"]["MASTER_PORT"] for i in infos}) == 1


async def test_calls_run_in_program_order(g4):
    futs = []
    for i in range(20):
        futs.append(g4.set_scale(float(i)))
        futs.append(g4.get_scale())
    values = [await f for f in futs]
    for i in range(20):
        assert values[2 * i + 1] == [float(i)] * 4
    await g4.set_scale(1.0)


async def test_describe(g4):
    d = await g4.describe()
    assert [r["rank"] for r in d] == [0, 1, 2, 3]
    assert len({r["pid"] for r in d}) == 4
    for r in d:
        assert {"node_ip", "pid", "bundle_index", "device", "gpu_ids", "meshes", "local_rank"} <= set(r)
        assert r["device"] == "cpu"
    assert [r["bundle_index"] for r in d] == [0, 1, 2, 3]


async def test_control_calls_answer_while_computing(g4, orc_sequencer):
    # rank r passes position r, then waits for position 5 + r: its compute lane is busy until the test lets it on
    busy = g4.hold(orc_sequencer, [[r, 5 + r] for r in range(4)])
    async with orc_sequencer(4):  # every rank is inside `hold` now
        assert await g4.ping() == [0, 1, 2, 3]  # answered by the control lanes, with the compute lanes busy
    assert await busy == [0, 1, 2, 3]
