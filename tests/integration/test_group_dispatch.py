"""Every dispatch transform on a real local Ray cluster."""

from __future__ import annotations

import pytest
import torch

import orchestra as orc
from orchestra import Batch


@pytest.fixture(scope="module")
async def g4(scorers):
    """The session's 4-rank Scorer group (conftest), at scale 2.0 for this module."""
    g = scorers[4]
    assert await g.set_scale(2.0) == [2.0] * 4
    yield g
    await g.set_scale(1.0)


def xs(n: int, **extra) -> Batch:
    return Batch.from_dict({"x": torch.arange(n), **extra}, meta={"step": 7})


async def test_shard_balanced_uneven(g4):
    out = await g4.score(xs(10))
    assert torch.equal(out["score"], torch.arange(10).double() * 2)
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]  # 10 over 4 -> 3, 3, 2, 2
    assert out.meta == {}


async def test_shard_keeps_non_tensor_columns_and_meta(g4):
    b = xs(6, name=[f"r{i}" for i in range(6)])
    out = await g4.echo(b)
    assert list(out["name"]) == [f"r{i}" for i in range(6)]
    assert out.meta == {"step": 7}
    assert torch.equal(out["x"], b["x"])


async def test_shard_pad_strips_padding(g4):
    out = await g4.padded(xs(10))
    assert torch.equal(out["x2"], torch.arange(10) * 2)
    assert set(out["n"].tolist()) == {3}  # every rank saw an equal shard of 3 rows (12 padded)
    out = await g4.padded_pipe(xs(5))
    assert torch.equal(out["x2"], torch.arange(5) * 2)
    assert set(out["n"].tolist()) == {2}


async def test_shard_allow_empty(g4):
    out = await g4.maybe_empty(xs(2))
    assert out["x"].tolist() == [0, 1]


async def test_broadcast_scatter_rank_zero_metrics(g4):
    assert await g4.set_scale(3.0) == [3.0] * 4
    assert await g4.get_scale() == [3.0] * 4
    assert await g4.take([10, 11, 12, 13], tag="t") == ["t10@0", "t11@1", "t12@2", "t13@3"]
    assert await g4.save("ckpt") == "ckpt:0"
    m = await g4.report()
    assert m == {"loss": 1.5, "tokens": 25.0}
    assert await g4.count(xs(10)) == {"rows": 10.0}
    await g4.set_scale(2.0)


async def test_function_broadcast_with_sharded_data(g4):
    out = await g4.apply(lambda t: t * t, xs(9))
    assert torch.equal(out["out"], torch.arange(9) ** 2)


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


async def test_async_endpoint(g4):
    assert await g4.async_value(3) == [30, 31, 32, 33]


async def test_calls_run_in_program_order(g4):
    futs = []
    for i in range(20):
        futs.append(g4.set_scale(float(i)))
        futs.append(g4.get_scale())
    values = [await f for f in futs]
    for i in range(20):
        assert values[2 * i + 1] == [float(i)] * 4
    await g4.set_scale(2.0)


async def test_describe(g4):
    d = await g4.describe()
    assert [r["rank"] for r in d] == [0, 1, 2, 3]
    assert len({r["pid"] for r in d}) == 4
    for r in d:
        assert {"node_ip", "pid", "bundle_index", "device", "gpu_ids", "meshes", "local_rank"} <= set(r)
        assert r["device"] == "cpu"
    assert [r["bundle_index"] for r in d] == [0, 1, 2, 3]


async def test_control_calls_answer_while_computing(g4, sequencer):
    # rank r passes position r, then waits for position 5 + r: its compute lane is busy until the test lets it on
    busy = g4.hold(sequencer, [[r, 5 + r] for r in range(4)])
    async with sequencer(4):  # every rank is inside `hold` now
        assert await g4.ping() == [0, 1, 2, 3]  # answered by the control lanes, with the compute lanes busy
    assert await busy == [0, 1, 2, 3]


async def test_endpoints_may_write_into_their_inputs(g4):
    b = xs(8)
    out = await g4.mutate(b)
    assert torch.equal(out["x"], torch.arange(8) + 1000)
    assert torch.equal(b["x"], torch.arange(8))


async def test_mesh_dispatch_replicates_to_tp_ranks_and_collects_from_collectors(mesh4):
    g = mesh4
    await g.reset_stats()
    out = await g.compute(xs(10))
    assert torch.equal(out["x"], torch.arange(10))
    assert out["dp"].tolist() == [0] * 5 + [1] * 5
    assert out["rank"].tolist() == [0] * 5 + [2] * 5  # collectors only
    stats = await g.stats()
    # both TP ranks of a replica got the same 5 rows
    assert [s["compute"]["rows_used"] for s in stats] == [5, 5, 5, 5]
    out = await g.compute_padded(xs(3))
    assert torch.equal(out["x"], torch.arange(3)) and set(out["n"].tolist()) == {2}
    d = await g.describe()
    assert d[1]["meshes"]["MeshWorker"]["actor"] == {"dp_rank": 0, "dp_size": 2, "is_collector": False}
    with pytest.raises(orc.DispatchError, match="never called self.register_mesh"):
        await g.unregistered(xs(4))
    # the mesh is cached: a second call sends at once
    assert g.cached_mesh("actor") is not None
