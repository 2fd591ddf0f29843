"""The orchestra pytest plugin as a user meets it (pytest in a subprocess, ``--orc-backend=local``: no Ray), for what
an adversarial review found it let pass: a stream read with ``async for ...: break`` that fails later, one abandoned
while it still produces, one never drained although its producer finished, an in-process endpoint that runs on into
the next test, and a CPU count that is not a whole number."""

from __future__ import annotations

import pytest

from test_testing_plugin_sessions import run_pytest

pytestmark = pytest.mark.usefixtures("no_ray")

WORKERS = '''
import threading
from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D

EVENTS = []


class Flag(threading.Event):
    _orc_in_process = True  # passed to in-process ranks by reference (never pickled)


RELEASE = Flag()


class S(Worker):
    @endpoint(D.shard())
    def fail_after_first(self, batch, seq):
        yield batch.slice(0, 1)
        with seq(1):
            pass
        raise RuntimeError(f"second part failed on rank {self.rank}")

    @endpoint(D.shard())
    def held_after_first(self, batch, seq):
        yield batch.slice(0, 1)
        with seq(1 + self.rank):  # never entered by the test: the close ends the wait
            pass
        yield batch.slice(1, len(batch))

    @endpoint(D.shard())
    def pieces(self, batch, n=4):
        yield from batch.chunk(n)

    @endpoint(D.broadcast())
    def noop(self):
        return self.rank

    @endpoint(D.broadcast())
    def block(self, started):
        started.set()
        RELEASE.wait(30)  # never polls self.cancelled()
        EVENTS.append(("block", self.rank))
        return "done"
'''

STREAMS = '''
import asyncio
import torch
from orchestra import Batch
from workers import S


def rows(n):
    return Batch.from_dict({"x": torch.arange(n)})


async def test_fails_after_the_part_it_read(make_group, orc_sequencer):
    g = await make_group(S, ranks=1, group_name="broke")
    async for _ in g.fail_after_first(rows(4), orc_sequencer):
        break
    async with orc_sequencer(0):
        pass
    await g.noop()  # after the stream on the rank's compute lane: it has failed by now


async def test_abandoned_while_producing(make_group, orc_sequencer):
    g = await make_group(S, ranks=2, group_name="producing")
    async for _ in g.held_after_first(rows(4), orc_sequencer):
        break


async def test_never_drained(make_group):
    g = await make_group(S, ranks=2, group_name="finished")
    async for _ in g.pieces(rows(8)):
        break
    while g.calls_in_flight():  # until the producer's end is here: it finished
        await asyncio.sleep(0.005)


async def test_drained(make_group):
    g = await make_group(S, ranks=2, group_name="drained")
    assert len([p async for p in g.pieces(rows(8))]) == 8
'''

LINGER = '''
import asyncio
import threading
import workers
from workers import S, Flag


async def test_1_cancels_a_call_that_never_polls(make_group):
    g = await make_group(S, ranks=2, group_name="linger")
    started = Flag()
    fut = g.block(started)
    while not started.is_set():
        await asyncio.sleep(0.005)
    fut.cancel()
    threading.Timer(0.2, workers.RELEASE.set).start()  # returns while the teardown waits for it


async def test_2_sees_nothing_of_test_1():
    threads = [t.name for t in threading.enumerate() if t.name.startswith("orchestra-local:linger")]
    assert threads == [], threads
    assert sorted(workers.EVENTS) == [("block", 0), ("block", 1)]  # ended during test 1's teardown
'''


@pytest.fixture(scope="module")
def review_run(tmp_path_factory) -> tuple[int, str]:
    """One in-process pytest run over the two user files above."""
    return run_pytest(tmp_path_factory.mktemp("review"), {"workers.py": WORKERS, "test_streams.py": STREAMS,
                                                          "test_linger.py": LINGER}, "--orc-backend=local")


def test_a_stream_that_fails_after_a_break_fails_the_test(review_run):
    code, out = review_run
    assert "FAILED test_streams.py::test_fails_after_the_part_it_read" in out, out
    assert "calls failed and nothing awaited them: ['broke.fail_after_first: WorkerError" in out, out


def test_a_stream_abandoned_while_producing_fails_the_test_at_once(review_run):
    code, out = review_run
    assert "FAILED test_streams.py::test_abandoned_while_producing" in out, out
    assert "calls still in flight when the test ended: ['producing.held_after_first']" in out, out


def test_a_stream_never_drained_fails_the_test_although_its_producer_finished(review_run):
    code, out = review_run
    assert "FAILED test_streams.py::test_never_drained" in out, out
    assert "streams not drained when the test ended: ['finished.pieces']" in out, out
    assert "PASSED test_streams.py::test_drained" in out, out


def test_an_in_process_endpoint_does_not_run_into_the_next_test(review_run):
    code, out = review_run
    assert "PASSED test_linger.py::test_1_cancels_a_call_that_never_polls" in out, out
    assert "PASSED test_linger.py::test_2_sees_nothing_of_test_1" in out, out
    assert code == 1 and "3 failed, 3 passed" in out, out


@pytest.mark.parametrize("value", ["2.5", "inf", "0"])
def test_a_cpu_count_that_is_not_a_whole_number_is_refused_at_start_up(tmp_path, value):
    code, out = run_pytest(tmp_path, {"test_x.py": "def test_x():\n    pass\n"}, f"--orc-num-cpus={value}")
    assert code == 4, out
    assert f"--orc-num-cpus must be a whole number >= 1, got {value}" in out, out
