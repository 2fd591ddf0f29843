"""orchestra.testing on a real cluster: the Sequencer orders ranks and the test body, fail_rank and kill_rank
act on one rank, make_group sees calls in flight; and a user's test file run by pytest in a subprocess passes,
while a wrong assertion or a call left running in it fails (the plugin swallows nothing)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from testing_workers import Recorder

import orchestra as orc
from orchestra import Batch
from orchestra.testing import Sequencer, SequencerError, fail_rank, kill_rank

ROOT = Path(__file__).resolve().parents[2]


async def test_sequencer_orders_ranks_and_the_test_body(make_group, orc_sequencer, tmp_path):
    group = await make_group(Recorder)
    log = tmp_path / "log"
    fut = group.append_in_turn(orc_sequencer, [2, 0], str(log))  # rank 1, then the test, then rank 0
    async with orc_sequencer(1):
        with open(log, "a") as f:
            f.write("test\n")
    assert await fut == [0, 1]
    assert log.read_text().splitlines() == ["rank1", "test", "rank0"]


async def test_a_position_that_raised_breaks_the_sequence_for_the_later_ones(orc_sequencer):
    with pytest.raises(ValueError, match="boom"):
        async with orc_sequencer(0):
            raise ValueError("boom")
    with pytest.raises(SequencerError, match="position 0 raised ValueError: boom"):
        async with orc_sequencer(1):
            pass


async def test_a_position_used_twice_is_an_error(orc_sequencer):
    async with orc_sequencer(0):
        pass
    with pytest.raises(SequencerError, match="entered twice"):
        async with orc_sequencer(0):
            pass


async def test_a_position_never_reached_fails_instead_of_hanging(orc_cluster):
    seq = Sequencer(timeout=0.5)
    try:
        with pytest.raises(SequencerError, match="position 3 still waiting .* at position 0"):
            async with seq(3):
                pass
    finally:
        seq.close()


async def test_a_wait_cancelled_before_its_turn_gives_the_position_back(orc_cluster):
    """The test stops waiting for position 1 (cancelled) before position 0 ran: position 1 was never entered, so it
    can be entered later, and position 2 after it (was: the actor's abandoned wait took position 1 and never left
    it, so re-entering it said "entered twice" and position 2 timed out). The in-process Sequencer's side is in
    tests/unit/core/test_testing_helpers_local.py."""
    s = Sequencer()
    try:
        async def enter_one() -> None:
            async with s(1):
                raise AssertionError("position 1 ran although its wait was cancelled")

        waiter = asyncio.create_task(enter_one())
        await asyncio.sleep(0)  # one turn of the loop: the task has sent its wait to the actor and awaits it
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        async with s(0):
            pass
        async with s(1):
            pass
        async with s(2):
            pass
        assert await asyncio.to_thread(s.position) == 3
    finally:
        s.close()


async def test_sequencers_share_one_actor_and_keep_their_own_positions(orc_cluster):
    """Every Sequencer this process makes is a sequence on one actor (an actor each would cost a Ray worker start
    per test); each keeps its own positions, and closing one fails only its own waiting and later positions."""
    a, b = Sequencer(), Sequencer()
    try:
        assert a._actor._actor_id == b._actor._actor_id
        async with a(0):
            pass
        async with b(0):  # b's position 0 is its own: not "entered twice"
            pass

        async def waits_on_b() -> None:
            with pytest.raises(SequencerError, match="the sequencer was closed"):
                async with b(2):  # never its turn: position 1 does not run
                    pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(waits_on_b)
            await anyio.to_thread.run_sync(b.close)  # whether b(2) is waiting yet or not, it fails
        async with a(1):  # a goes on
            pass
        assert a.position() == 2
    finally:
        a.close()
        b.close()


# the group's calls in flight are controller state: the same on both backends (in process: no start-up)
@pytest.mark.orc_backend("local")
async def test_calls_in_flight_names_a_running_call_until_it_finishes(make_group, orc_sequencer):
    group = await make_group(Recorder, ranks=1)
    fut = group.hold(orc_sequencer)
    async with orc_sequencer(1):  # the endpoint has passed position 0: it is running
        assert group.calls_in_flight() == ["Recorder.hold"]
    assert await fut == [True]
    assert group.calls_in_flight() == []


# fail_rank on Ray ranks is covered by the contract suite (tests/contract): here, in process
@pytest.mark.orc_backend("local")
async def test_fail_rank_fails_the_next_call_on_that_rank_only(make_group):
    group = await make_group(Recorder)
    batch = Batch.from_dict({"x": torch.arange(4)})
    await fail_rank(group, 1, "double", "rank 1 fails here")
    with pytest.raises(orc.WorkerError, match="rank 1 fails here") as e:
        await group.double(batch)
    assert (e.value.rank, e.value.endpoint, e.value.exc_type) == (1, "double", "InjectedFailure")
    out = await group.double(batch)  # armed once: the next call runs everywhere
    assert out["y"].tolist() == [0, 2, 4, 6] and out["rank"].tolist() == [0, 0, 1, 1]


async def test_kill_rank_waits_until_the_group_reports_the_death(make_group):
    group = await make_group(Recorder)
    err = await kill_rank(group, 1)
    assert isinstance(err, orc.WorkerDiedError) and err.rank == 1
    assert [h["alive"] for h in group.health()] == [True, False]
    with pytest.raises(orc.WorkerDiedError):  # refused before anything is sent
        group.double(Batch.from_dict({"x": torch.arange(4)}))
    with pytest.raises(RuntimeError, match="rank 1 of .* is already dead"):
        await kill_rank(group, 1)
    err = await kill_rank(group, 0)  # another rank of a group with a dead rank (was: WorkerDiedError for rank 1)
    assert isinstance(err, orc.WorkerDiedError) and err.rank == 0
    assert [h["alive"] for h in group.health()] == [False, False]


def test_orc_cluster_reuses_a_running_cluster_and_leaves_it_running(orc_cluster, tmp_path):
    """A nested pytest session while this one's cluster runs: its orc_cluster is this cluster, and Ray is still up
    after that session ended."""
    import ray

    (tmp_path / "test_inner.py").write_text(
        "import ray\n\n"
        "def test_inner(orc_cluster):\n"
        f"    assert orc_cluster['CPU'] == {orc_cluster['CPU']!r}\n"
        f"    assert ray.get_runtime_context().get_node_id() == {ray.get_runtime_context().get_node_id()!r}\n")
    # the tmp dir has no ini file: set the loop scope pytest-asyncio asks for, as a user's project would
    assert pytest.main(["-q", "-p", "no:cacheprovider", "-o", "asyncio_default_fixture_loop_scope=function",
                        str(tmp_path)]) == pytest.ExitCode.OK
    assert ray.is_initialized()
    assert ray.cluster_resources()["CPU"] == orc_cluster["CPU"]


LEAKY = '''
import asyncio

import pytest
from orchestra import Worker, endpoint
from orchestra.testing import Sequencer


class Waiter(Worker):
    @endpoint
    def wait(self, seq):
        with seq(1):  # position 0 never runs: this call cannot finish
            pass

    @endpoint
    def boom(self):
        raise ValueError("boom")


@pytest.mark.asyncio
async def test_leaves_a_call_running(make_group):
    group = await make_group(Waiter, ranks=1)
    group.wait(Sequencer())


@pytest.mark.asyncio
async def test_leaves_a_failed_call_unawaited(make_group):
    group = await make_group(Waiter, ranks=1)
    fut = group.boom()
    while not fut.done():  # finished (failed), and nothing awaits it
        await asyncio.sleep(0.01)
'''


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ray", "local"])
def test_a_users_test_file_fails_on_a_wrong_assertion_and_on_a_call_left_running(tmp_path, backend):
    """A fresh pytest (its own cluster, strict asyncio mode: no project config) over a copy of tests/plugin_user
    with one assertion made wrong, plus a test that leaves a call running and one that leaves a failed call
    unawaited: the untouched test passes, the three others fail, with the assertion's own message and the calls'
    names — on the Ray backend and on the in-process one."""
    src = ROOT / "tests" / "plugin_user"
    shutil.copy(src / "user_workers.py", tmp_path / "user_workers.py")
    text = (src / "test_user_worker.py").read_text()
    wrong = text.replace("[0, 2, 4, 6, 8]", "[0, 2, 4, 6, 9]")
    assert wrong != text
    (tmp_path / "test_user_worker.py").write_text(wrong)
    (tmp_path / "test_leak.py").write_text(LEAKY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--orc-num-cpus=2",
                           f"--orc-backend={backend}", "-o", "timeout=240", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 failed, 1 passed" in out, out
    assert "assert [0, 2, 4, 6, 8] == [0, 2, 4, 6, 9]" in out, out
    assert "calls still in flight when the test ended: ['Waiter.wait']" in out, out
    assert "calls failed and nothing awaited them: ['Waiter.boom: WorkerError" in out, out


def test_a_users_test_file_passes_in_process_without_ray(tmp_path):
    """The user's file, unchanged, with ``--orc-backend=local``: it passes and no Ray cluster is started."""
    src = ROOT / "tests" / "plugin_user"
    for name in ("user_workers.py", "test_user_worker.py"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "test_no_ray.py").write_text(
        "import pytest\nimport ray\n\n\n@pytest.mark.asyncio\nasync def test_ray_was_never_started(make_group):\n"
        "    assert not ray.is_initialized()\n\n\n"
        "@pytest.mark.orc_backend('ray')\n@pytest.mark.asyncio\nasync def test_needs_processes(make_group):\n"
        "    assert False, 'a test marked orc_backend(ray) must not run in process'\n\n\n"
        "@pytest.mark.orc_backend('ray')\ndef test_needs_processes_without_make_group():\n"
        "    assert False, 'a test marked orc_backend(ray) must not run in process'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--orc-backend=local",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "3 passed, 2 skipped" in out, out


@pytest.mark.orc_backend("local")
async def test_a_test_marked_local_gets_in_process_groups_in_a_ray_session(make_group):
    """``orc_backend('local')``: this test's groups run in this process although the session runs on Ray."""
    import ray

    group = await make_group(Recorder)
    assert ray.is_initialized() and group.pool.backend.name == "local"
    assert {d["pid"] for d in await group.describe()} == {os.getpid()}
    out = await group.double(Batch.from_dict({"x": torch.arange(4)}))
    assert out["y"].tolist() == [0, 2, 4, 6] and out["rank"].tolist() == [0, 0, 1, 1]
