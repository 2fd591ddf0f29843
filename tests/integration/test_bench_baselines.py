"""The data-plane benchmarks run, both sides: orchestra's call and the raw-Ray baseline it is measured against.

``bench.transport`` and ``bench.forwarding`` called orchestra's generated actor methods as their raw baselines; when
a rank's reply became a frame, both failed at their first raw call, and the issue's transport and forwarding numbers
could no longer be measured, with nothing in the test suite to say so. Their baselines are now bare Ray calls on the
same actors (``__ray_call__``); these tests run each bench's measurement once, small.
"""

from __future__ import annotations

from orchestra import ResourcePool, WorkerGroup

CPUS = 0.01


async def test_the_transport_bench_measures_orchestra_and_raw_ray() -> None:
    from bench import transport

    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=CPUS), transport.Echo,
                           group_name="bench_transport") as g:
        res = await transport.measure(g, 1, iters=1, warmup=0)  # checks ours' rows, and that raw echoes Batches
    for case in ("orchestra", "orchestra_zero_copy", "raw_ray", "raw_ray_concat"):
        assert res[case]["median_ms"] > 0, case
    assert res["controller_per_call"]["bytes_put"] >= res["bytes"]  # the controller put the shards, once each


async def test_the_forwarding_bench_measures_orchestra_and_a_naive_raw_chain() -> None:
    from bench import forwarding

    async with WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=CPUS), forwarding.Stage,
                           group_name="bench_fwd_a") as a, \
            WorkerGroup(ResourcePool(process_on_nodes=[1], cpus_per_worker=CPUS), forwarding.Stage,
                        group_name="bench_fwd_b") as b:
        for samples in (0, 2):  # echo, and the rollout shape (each input row returned twice)
            res = await forwarding.chain(a, b, 1, iters=1, warmup=0, samples=samples)  # checks the raw chain's rows
            assert res["orchestra"]["median_ms"] > 0 and res["raw_ray_naive"]["median_ms"] > 0
            assert res["controller_bytes_materialized"] == 0
            assert max(res["fetched_over_shard_per_rank"]) <= 1.25, res["fetched_over_shard_per_rank"]
