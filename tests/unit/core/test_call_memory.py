"""What a finished call keeps alive (in-process backend). A call holds its inputs — the futures it read, the
caller's arguments — only until every rank finished well: a loop that feeds each result to the next call (``x =
g.f(x)``) kept every earlier call and its rows alive for as long as the last future was held (a reviewer's loop of
60 steps held 514 MB), so a long training loop grew until it ran out of memory, silently."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

from held_replies import replies_held

pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails


def pool(n: int) -> ResourcePool:
    return ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend="local")


def rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n), "h": torch.zeros(n, 256)})


_GO = threading.Event()  # lets a held call's rank 1 finish


class _KeepInputRows(D.Dispatch):
    """A user's transform whose collect reads the call's data arguments (docs/dispatch.md lets a transform use
    ``plan.data_args()``): the rows its inputs had, counted again when the call's value is made."""

    def collect(self, plan, results):
        return [sum(len(a) if isinstance(a, Batch) else a.rows_if_known() for a in plan.data_args()), results]


class _Steps(Worker):
    @endpoint(D.shard() | _KeepInputRows())
    def counted(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def held(self, batch: Batch) -> Batch:
        if self.rank == 1:
            assert _GO.wait(timeout=60)
        return batch

    @endpoint(D.shard())
    def add(self, batch: Batch, other: Batch | None = None) -> Batch:
        return Batch.from_dict({"x": batch["x"] + 1, "h": batch["h"]})

    @endpoint(D.shard())
    def late(self, batch: Batch) -> Batch:  # its replies reach the controller late (see held_replies.py)
        return batch

    @endpoint(D.shard())
    def fail(self, batch: Batch) -> Batch:
        raise RuntimeError(f"step failed on rank {self.rank}")

    @endpoint(D.broadcast())
    def count(self, batch: Batch) -> int:
        return len(batch)


@pytest.fixture
async def groups():
    gs = {n: WorkerGroup(pool(n), _Steps, group_name=f"steps{n}") for n in (2, 3)}
    for g in gs.values():
        await g.ready()
    yield gs
    for g in gs.values():
        await g.aclose()


def _watch(fut: orc.DataFuture) -> weakref.ref:
    """A weak reference to the call behind ``fut`` (its slots hold the rows its ranks returned)."""
    return weakref.ref(fut._inv)


async def _seen(refs: list[weakref.ref]) -> None:
    """Until each of those calls has seen every output it received: the ranks' replies may all be here (another
    call the ranks ran after them returned) with the calls' own callbacks still queued on the loop (2 runs in 14
    on a loaded machine). A wait on an output runs after the callbacks registered on it before, the call's among
    them; a rank's end tells its call at once. The calls themselves are not awaited: an await checks their inputs
    and lets them go on its own, which would hide what this checks."""
    outs = [o for r in refs if r() is not None for s in r().slots for o in (s.done, *s.outputs)]
    if outs:
        await asyncio.wait(outs)


def _gone(refs: list[weakref.ref]) -> list[bool]:
    gc.collect()
    return [r() is None for r in refs]


@pytest.mark.parametrize("between", ["await it", "await every 10th", "await nothing", "await another call"])
async def test_a_loop_feeding_each_result_to_the_next_call_keeps_only_the_last(groups, between):
    """``x = g.add(x)`` 30 times, with the chain awaited each step, every 10th step, only at the end, or never
    while the loop runs: it awaits another call each step (which the ranks run after the chain's), and each call's
    check of the columns it read rank by rank waited for an await of the chain, holding every input until then."""
    g = groups[2]
    x = g.add(rows(64))
    early = [_watch(x)]
    for i in range(30):
        x = g.add(x)
        if i < 5:
            early.append(_watch(x))
        if between == "await it" or (between == "await every 10th" and i % 10 == 0):
            await x
        elif between == "await another call":
            assert await g.count(rows(4)) == [4, 4]
    if between == "await another call":  # the chain itself was never awaited
        await _seen(early)
        assert _gone(early) == [True] * len(early)
    assert (await x)["x"].tolist()[:3] == [31, 32, 33]
    assert _gone(early) == [True] * len(early)


async def test_a_chain_sent_before_its_first_call_finished_keeps_only_the_last(groups):
    """The chain's calls are sent while its first call still runs on rank 1, so each reads its input rank by rank
    before that input's headers were all here: each call's check of those reads held its inputs (and the inputs
    computed from them) until an await of the chain, which never came while the loop ran."""
    g = groups[2]
    _GO.clear()
    x = g.held(rows(8))
    early = [_watch(x)]
    for _ in range(10):
        x = g.add(x)
        early.append(_watch(x))
    _GO.set()
    assert await g.count(rows(4)) == [4, 4]  # each rank runs it after the chain
    await _seen(early)
    assert _gone(early[:-1]) == [True] * (len(early) - 1)
    assert (await x)["x"].tolist() == list(range(10, 18))


async def test_a_chain_across_groups_and_keyword_arguments_keeps_only_the_last(groups):
    g2, g3 = groups[2], groups[3]
    x = g2.add(rows(12))
    early = [_watch(x)]
    for i in range(6):
        x = g3.add(x) if i % 2 else g2.add(rows(12), other=x)
        early.append(_watch(x))
    read = g3.add(x)
    last = g2.count(read)
    assert await last == [12, 12]
    # a reader may finish before the replies of the call it read reach the controller (g2's ranks read g3's rows
    # rank to rank): until they do, that call still runs here, and holds its input (1 run in 30 saw it)
    await read.wait()
    del x, read
    await _seen(early)  # and the calls before it may not have seen their own replies yet (1 run in 56 under load)
    assert _gone(early) == [True] * len(early)


async def test_a_failed_call_still_names_its_failed_upstream(groups):
    """A call whose rank read a failed upstream reports the upstream's own error: it keeps its inputs, since
    the error is found through them."""
    g = groups[2]
    bad = g.fail(rows(4))
    after = g.add(bad)
    del bad
    with pytest.raises(orc.WorkerError, match="step failed on rank"):
        await after


async def test_a_users_collect_still_reads_the_data_arguments_of_a_finished_call(groups):
    """A finished call's plan lost its data arguments, and a user's collect that counts its input rows got 0 —
    or the right count, when the await ran before the call's last reply callback (63 in 100 awaits of a future
    input got 0, found by a review). A call whose transforms include a collect of the user's keeps its data
    arguments: such a future cannot be read by another call, so it holds its own inputs only, not a chain."""
    g = groups[2]
    for _ in range(20):
        n, _ = await g.counted(rows(6))
        assert n == 6
        up = g.add(rows(6))
        n, _ = await g.counted(up)
        assert n == 6
        await up
        n, _ = await g.counted(up)  # a finished input
        assert n == 6


async def test_a_reader_that_finished_before_its_upstreams_replies_lets_it_go_when_they_come(groups, monkeypatch):
    """The reader reads its input rank by rank, sent before that input's replies were here, and finishes first: its
    check of the columns it read cannot be settled then, and holds the input. When the input's replies come, the
    input's good verdict settles the finished reader's check, which lets the input go (no await of the reader)."""
    g = groups[2]
    gate, delivering = replies_held(monkeypatch, "late")
    up = g.late(rows(8))
    reader = g.add(up)
    assert await g.count(rows(4)) == [4, 4]  # the ranks ran both before it; the reader's replies are here
    watched = _watch(up)
    assert not _gone([watched])[0]  # held by the reader's pending check
    gate.set()
    await asyncio.gather(*delivering)
    await up
    del up
    assert _gone([watched]) == [True]
    assert (await reader)["x"].tolist() == list(range(1, 9))
