"""Placement across real (process) nodes and elastic recovery when a node is lost and its capacity returns."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import pytest
import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orchestra import _channel
from pipelines.config import load_config
from pipelines.runner import Runner
from cluster_workers import Echo, Where


async def test_node_entries_of_a_pool_land_on_distinct_nodes(cluster, caplog):
    pool = ResourcePool(process_on_nodes=[2, 2], name="spread")
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        async with WorkerGroup(pool, Where) as g:
            where = await g.describe()
            assert await g.rank_of() == [0, 1, 2, 3]  # the Worker class came to the nodes with the runtime_env
    nodes = [d["node_id"] for d in where]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3]  # an entry packs on one node
    assert nodes[0] != nodes[2]  # entries on distinct nodes
    assert not [r for r in caplog.records if "share a node" in r.getMessage()]


async def test_node_entries_share_a_node_with_a_warning_when_there_is_no_other(cluster, caplog):
    pool = ResourcePool(process_on_nodes=[1, 1, 1], name="crowded")  # three entries, two nodes
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        async with WorkerGroup(pool, Where) as g:
            nodes = {d["node_id"] for d in await g.describe()}
    assert len(nodes) == 2
    assert any("crowded" in r.getMessage() and "share a node" in r.getMessage() for r in caplog.records)


async def test_repeated_calls_take_the_fast_path_to_ranks_on_other_nodes_over_tcp(cluster):
    """Ranks on other nodes than the controller's (here every rank: the head places nothing) join the group's
    fast-path channel over TCP, on the address Ray uses for the controller's node; results and the order of calls
    across both paths are the general path's."""
    async with WorkerGroup(ResourcePool(process_on_nodes=[1, 1], name="tcp"), Echo) as g:
        nodes = await g.node()
        assert len(set(nodes)) == 2 and ray.get_runtime_context().get_node_id() not in nodes
        tags = [f"c{i}" for i in range(_channel.threshold() + 3)]
        for t in tags:
            assert await g.note(t) == [(0, t), (1, t)]
        ch = g._shared.channel
        assert ch is not None and ch.open and ch.joined and ch._path is None  # no Unix socket: no rank is local
        assert ch.tcp_address[0] == ray.util.get_node_ip_address()
        fast = g._shared.fast_calls
        assert fast >= 4
        out = await g.double(Batch.from_dict({"x": torch.arange(5)}))
        assert out["x"].tolist() == [0, 2, 4, 6, 8]
        g.fast_path = False  # released: the next call goes through Ray, after the calls already written
        assert await g.note("ray") == [(0, "ray"), (1, "ray")]
        g.fast_path = True
        more = [f"d{i}" for i in range(_channel.threshold() + 1)]
        for t in more:
            await g.note(t)
        assert g._shared.fast_calls > fast + 1 and g._shared.channel is not None
        assert await g.history() == [[*tags, "double", "ray", *more]] * 2


TINY = ["data.prompts_per_step=8", "rollout.n=4", "actor.micro_batch_size=32", "actor.warmup_steps=0",
        "runner.micro_batches_per_step=1", "resources.actor_workers=2", "resources.rollout_workers=2",
        "task.params={format_bonus: 0.5}",
        "runner.checkpoint_every=1", "runner.restart_timeout_s=120"]


@pytest.mark.slow  # ~50 s: two tiny training starts on process nodes
async def test_a_lost_node_restarts_the_run_once_capacity_returns(cluster, tmp_path):
    out = tmp_path / "run"
    runner = Runner(load_config(None, [*TINY, "runner.total_steps=3", f"runner.output_dir={out}"]), progress=False)

    async def lose_the_actors_node() -> None:
        with anyio.fail_after(300):
            # wait for step 0's checkpoint to be committed (``latest`` is written last), not just its metrics
            while runner.cluster is None or not (out / "checkpoints" / "latest").exists():
                await anyio.sleep(0.05)
            node = (await runner.cluster.actor.describe())[0]["node_id"]
        victim = next(n for n in cluster.worker_nodes if n.node_id == node)
        cluster.remove_node(victim, allow_graceful=False)
        cluster.add_node(num_cpus=1)  # the capacity comes back (a replacement node)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lose_the_actors_node)
        hist = await runner.run()
    assert [h["step"] for h in hist] == [0, 1, 2]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"event"' in line]
    assert len(events) == 1 and events[0]["event"] == "restart" and "died" in events[0]["reason"]
    assert events[0]["checkpoint"] is not None
    cluster.wait_for_nodes()  # the replacement node is up for any test that shares this cluster after this one
