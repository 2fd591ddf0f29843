"""The orchestra pytest plugin as a user meets it: pytest run in a subprocess over a user's test files (no project
config), checking what fails and what is left running. Without Ray: what ``make_group`` reports after a test that
closed its own groups or whose ``on_death`` callback raised, and ``orc_cluster`` on a local session the user
started. With Ray (``slow``: each run starts a small Ray cluster): ``orc_cluster`` leaves a Ray cluster the user
started running, says when it reuses one of another size, and in-process groups of a Ray session
(``orc_backend("local")``) get the session's CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

INI = ("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = session\n"
       "asyncio_default_test_loop_scope = session\n")

WORKERS = '''
from orchestra import Worker, endpoint
from orchestra import dispatch as D


class W(Worker):
    @endpoint(D.broadcast())
    def add(self, n):
        return n + 1

    @endpoint(D.broadcast())
    def boom(self, msg):
        raise ValueError(msg)

    @endpoint(D.broadcast())
    def hold(self, seq):
        with seq(1):  # held until the test enters position 1 (it never does: the group is closed first)
            pass
'''


def run_pytest(tmp_path: Path, files: dict[str, str], *args: str, timeout: float = 300) -> tuple[int, str]:
    """pytest in a fresh process over ``files`` (written to ``tmp_path`` with an ini file): (exit code, output)."""
    (tmp_path / "pytest.ini").write_text(INI)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *args,
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


HIDDEN = '''
from workers import W


async def test_closes_its_group_after_a_failure_nobody_awaited(make_group):
    g = await make_group(W, ranks=1, group_name="closed_async")
    g.boom("nobody saw me")
    assert await g.add(1) == [2]  # sent after boom, to the same rank: boom has failed by now
    await g.aclose()


async def test_shuts_its_group_down_after_a_failure_nobody_awaited(make_group):
    g = await make_group(W, ranks=1, group_name="closed_sync")
    g.boom("nor me")
    assert await g.add(1) == [2]
    g.shutdown()


async def test_closes_its_group_while_a_call_runs(make_group, orc_sequencer):
    g = await make_group(W, ranks=1, group_name="ended")
    g.hold(orc_sequencer)  # ended by the close, the test's own explicit act: not a failure
    await g.aclose()
'''


def test_make_group_reports_failures_nobody_awaited_in_groups_the_test_closed_itself(local_user_run):
    """A failed call nobody awaited fails the test although the test closed (or shut down) the group itself (was:
    such tests passed); a call still running when the test closes its group is ended by that close and fails
    nothing."""
    code, out = local_user_run
    assert code == 1, out
    assert "3 failed, 1 passed" in out, out  # with test_on_death.py's one failure
    assert "PASSED test_hidden.py::test_closes_its_group_while_a_call_runs" in out, out
    assert "FAILED test_hidden.py::test_closes_its_group_after_a_failure_nobody_awaited" in out, out
    assert "FAILED test_hidden.py::test_shuts_its_group_down_after_a_failure_nobody_awaited" in out, out
    assert "calls failed and nothing awaited them: ['closed_async.boom: WorkerError" in out, out
    assert "calls failed and nothing awaited them: ['closed_sync.boom: WorkerError" in out, out


ON_DEATH = '''
from orchestra.testing import kill_rank
from workers import W


async def test_on_death_callback_fails(make_group):
    g = await make_group(W, ranks=1, group_name="watched")

    def my_callback(err):
        assert err.rank == 5, "my callback's assertion failed"

    g.on_death(my_callback)
    await kill_rank(g, 0)
'''


@pytest.fixture(scope="module")
def local_user_run(tmp_path_factory) -> tuple[int, str]:
    """One in-process pytest run over both user files above (one interpreter start for the two tests below)."""
    return run_pytest(tmp_path_factory.mktemp("user"), {"workers.py": WORKERS, "test_hidden.py": HIDDEN,
                                                        "test_on_death.py": ON_DEATH}, "--orc-backend=local")


def test_make_group_fails_a_test_whose_on_death_callback_raised(local_user_run):
    """An ``on_death`` callback that raised fails the test, naming the callback, the death and the error (was: only
    logged, and the test passed)."""
    code, out = local_user_run
    assert code == 1, out
    assert "FAILED test_on_death.py::test_on_death_callback_fails" in out, out
    assert "on_death callbacks of its groups raised" in out, out
    assert ("  - test_on_death_callback_fails.<locals>.my_callback (told rank 0 of 'watched' died) raised "
            "AssertionError: my callback's assertion failed") in out, out


FORWARDED = '''
import torch
from held_replies import replies_held
from orchestra import Batch, endpoint
from orchestra import dispatch as D
from workers import W


class Rows(W):
    @endpoint(D.shard())
    def make(self, batch):
        return batch

    @endpoint(D.broadcast())
    def count(self, batch):
        return len(batch)


async def test_reads_a_call_whose_replies_come_after_its_reader(make_group, monkeypatch):
    gate, _ = replies_held(monkeypatch, "make")  # set as the body's last statement: the replies come after it
    maker = await make_group(Rows, ranks=2, group_name="maker")
    reader = await make_group(Rows, ranks=1, group_name="reader")
    assert await reader.count(maker.make(Batch.from_dict({"x": torch.arange(4)}))) == [4]
    assert maker.calls_in_flight() == ["maker.make"]  # it ran: its rows were read; its replies are not here yet
    gate.set()


async def test_leaves_a_call_nobody_read(make_group, orc_sequencer):
    g = await make_group(Rows, ranks=1, group_name="left")
    g.hold(orc_sequencer)
'''


def test_make_group_waits_for_the_replies_of_a_call_another_call_read_and_reports_one_nobody_read(tmp_path):
    """A call whose result was read by another call (forwarded, never awaited itself, as docs/testing.md's
    ``mean_advantage_step`` does) has run; its replies may reach the controller after its reader's (Ray delivers the
    replies of different actors in any order): the plugin waits for them before it counts the calls in flight
    (was: "calls still in flight" failed such a test in the CI run of stop 40). A call nobody awaited nor read is reported."""
    helper = (Path(__file__).parent / "held_replies.py").read_text()
    files = {"workers.py": WORKERS, "held_replies.py": helper, "test_forwarded.py": FORWARDED}
    code, out = run_pytest(tmp_path, files, "--orc-backend=local")
    assert code == 1, out
    assert "PASSED test_forwarded.py::test_reads_a_call_whose_replies_come_after_its_reader" in out, out
    assert "FAILED test_forwarded.py::test_leaves_a_call_nobody_read" in out, out
    assert "calls still in flight when the test ended: ['left.hold']" in out, out
    assert "1 failed, 1 passed" in out, out


LOCAL_SESSION = '''
import pytest
import orchestra as orc
from orchestra import _backend


@pytest.fixture(scope="session", autouse=True)
def my_session():
    orc.init(backend="local", num_cpus=1)
    yield
    assert _backend.current().name == "local", "orc_cluster ended the local session the user started"
    print("USER SESSION STILL UP")
    orc.shutdown()
'''


def test_orc_cluster_reuses_a_local_session_the_user_started_says_so_and_leaves_it(tmp_path):
    """``--orc-backend=local`` with a local session the user started (1 CPU) and ``--orc-num-cpus=2``: orc_cluster
    yields the user's session, warns naming both CPU counts, and does not end it."""
    test = "def test_res(orc_cluster):\n    assert orc_cluster == {'CPU': 1.0}\n"
    code, out = run_pytest(tmp_path, {"conftest.py": LOCAL_SESSION, "test_res.py": test}, "--orc-backend=local",
                           "--orc-num-cpus=2", "-s")
    assert code == 0, out
    assert "USER SESSION STILL UP" in out, out
    assert "1 CPU" in out and "--orc-num-cpus=2" in out and "orc_cluster: reusing" in out, out


RAY_SESSION = '''
import pytest
import ray
import orchestra as orc


@pytest.fixture(scope="session", autouse=True)
def my_ray_cluster():
    orc.init(num_cpus=1)  # the user's own Ray cluster for the whole session
    yield
    assert ray.is_initialized(), "orc_cluster shut down the Ray cluster the user started"
    print("USER RAY STILL UP")
    orc.shutdown()
'''


@pytest.mark.slow
def test_orc_cluster_on_the_local_backend_leaves_a_ray_cluster_the_user_started_running(tmp_path):
    test = ("import ray\n\n"
            "def test_uses_local(orc_cluster):\n    assert orc_cluster == {'CPU': 2.0}\n\n"
            "def test_ray_still_up_for_me():\n    assert ray.get(ray.put(1)) == 1\n")
    code, out = run_pytest(tmp_path, {"conftest.py": RAY_SESSION, "test_a.py": test}, "--orc-backend=local",
                           "--orc-num-cpus=2", "-s")
    assert code == 0, out
    assert "2 passed" in out and "USER RAY STILL UP" in out, out


@pytest.mark.slow
def test_orc_cluster_on_ray_says_when_it_reuses_a_cluster_of_another_size(tmp_path):
    """The user's Ray cluster has 1 CPU, ``--orc-num-cpus=2``: orc_cluster uses it, warns naming both, leaves it
    running; a test marked ``orc_backend("local")`` gets in-process groups with the session's 1 CPU."""
    test = ('import pytest\nfrom workers import W\n\n'
            'def test_res(orc_cluster):\n    assert orc_cluster["CPU"] == 1.0\n\n'
            '@pytest.mark.orc_backend("local")\n'
            'async def test_local(make_group):\n'
            '    g = await make_group(W, ranks=1, cpus_per_worker=1)\n'
            '    assert g.pool.backend.name == "local" and g.pool.backend.resources()["CPU"] == 1.0\n'
            '    assert await g.add(1) == [2]\n')
    code, out = run_pytest(tmp_path, {"conftest.py": RAY_SESSION, "workers.py": WORKERS, "test_r.py": test},
                           "--orc-num-cpus=2", "-s")
    assert code == 0, out
    assert "USER RAY STILL UP" in out, out
    assert "1 CPU" in out and "--orc-num-cpus=2" in out and "orc_cluster: reusing" in out, out


@pytest.mark.slow
def test_a_test_marked_local_in_a_ray_session_gets_the_sessions_cpus(tmp_path):
    """``orc_backend("local")`` in a Ray session started by orc_cluster with ``--orc-num-cpus=N`` (N differs from
    this machine's CPU count): the in-process groups reserve from N CPUs, as the session's Ray groups do (was: the
    machine's CPU count)."""
    n = (os.cpu_count() or 1) + 1
    test = ('import pytest\nfrom workers import W\n\n'
            '@pytest.mark.orc_backend("local")\n'
            'async def test_local(make_group, orc_cluster):\n'
            f'    assert orc_cluster["CPU"] == {float(n)!r}\n'
            f'    g = await make_group(W, ranks=1, cpus_per_worker={n})\n'
            f'    assert g.pool.backend.name == "local" and g.pool.backend.resources()["CPU"] == {float(n)!r}\n'
            '    assert await g.add(1) == [2]\n')
    code, out = run_pytest(tmp_path, {"workers.py": WORKERS, "test_m.py": test}, f"--orc-num-cpus={n}")
    assert code == 0, out
    assert "1 passed" in out, out
