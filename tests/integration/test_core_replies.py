"""Batched reply completion (``orchestra._replies``): every rank's reply, its own error, fail-fast, long calls."""

from __future__ import annotations

import anyio
import pytest

import orchestra as orc
from orchestra import ResourcePool, WorkerGroup, _replies
from replies_workers import Replier


BATCHES: list[int] = []


@pytest.fixture(scope="module")
async def group(orc_cluster):
    # 4 ranks take the batched path here (the default threshold is 8), and every batch is counted
    min_batch, batch = _replies.MIN_BATCH, _replies._batch
    _replies.MIN_BATCH = 2

    def counted(loop, pairs):
        BATCHES.append(len(pairs))
        batch(loop, pairs)

    _replies._batch = counted
    try:
        async with WorkerGroup(ResourcePool(process_on_nodes=[4], cpus_per_worker=0.1), Replier,
                               group_name="replies") as g:
            yield g
    finally:
        _replies.MIN_BATCH, _replies._batch = min_batch, batch


async def test_every_rank_gets_its_own_reply_in_order(group):
    BATCHES.clear()
    for i in range(20):  # many calls in a row: each batch resolves its own futures, in rank order
        assert await group.rank_and(i) == [(r, i) for r in range(4)]
    assert BATCHES == [4] * 20  # one batch of 4 replies per call


async def test_many_calls_in_flight_at_once_each_get_their_replies(group):
    futs = [group.rank_and(i) for i in range(3 * _replies._THREADS)]  # more calls than reply threads
    assert [await f for f in futs] == [[(r, i) for r in range(4)] for i in range(3 * _replies._THREADS)]


async def test_a_failing_rank_fails_the_call_while_the_others_still_run(group):
    # rank 0 fails at once; ranks 1-3 stop only when the controller cancels them after the failure is seen, so
    # this completes only if one rank's error surfaces without waiting for its siblings
    with anyio.fail_after(120):
        with pytest.raises(orc.WorkerError, match="rank 0 fails on purpose") as ei:
            await group.fail_one_block_others()
    assert ei.value.rank == 0
    assert await group.rank_and(7) == [(r, 7) for r in range(4)]  # the group still works


async def test_replies_later_than_the_batch_window_still_arrive(group):
    assert await group.after(4 * _replies.FAST_WINDOW_S) == [0, 1, 2, 3]
