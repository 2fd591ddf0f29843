"""``_backend._running``: how closing a group tells that a killed rank's process has exited (Ray-free)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from orchestra import _backend


def test_a_running_process_runs_and_an_exited_one_does_not_even_before_it_is_reaped() -> None:
    assert _backend._running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60
        while _backend._running(child.pid):  # exits at once; a zombie until reaped: it counts as exited
            assert time.monotonic() < deadline, "the child never counted as exited"
            time.sleep(0.01)
        assert child.poll() == 0  # (reaped only now: it had exited, not been reaped, when _running said so)
    finally:
        child.wait()
    assert not _backend._running(child.pid)


def test_the_in_process_backend_has_no_process_to_wait_for() -> None:
    from orchestra._local import LocalBackend

    assert LocalBackend().wait_exited([{"rank": 0, "pid": os.getpid(), "node_id": None}], timeout=5) == []


def test_a_process_that_took_a_dead_ranks_pid_is_not_the_rank() -> None:
    me, start = os.getpid(), _backend.process_start(os.getpid())
    assert isinstance(start, int)
    assert _backend._running(me, start)
    assert not _backend._running(me, start + 1)  # same pid, another start time: the rank's process has exited


def test_waiting_covers_this_nodes_ranks_only_and_gives_up_at_the_timeout(monkeypatch) -> None:
    """``RayBackend.wait_exited`` without a cluster: the node id and client mode stubbed, real child processes."""
    import ray

    class Context:
        def get_node_id(self) -> str:
            return "here"

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.setattr(_backend, "_client_mode", lambda: False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ranks = [{"rank": 0, "pid": child.pid, "start": _backend.process_start(child.pid), "node_id": "here"},
                 {"rank": 1, "pid": os.getpid(), "node_id": "here"},  # the controller itself: never waited for
                 {"rank": 2, "pid": child.pid, "node_id": "elsewhere"}]  # not visible from here
        t0 = time.monotonic()
        assert _backend.RayBackend().wait_exited(ranks, timeout=0.3) == [ranks[0]]  # still running at the timeout
        assert time.monotonic() - t0 >= 0.3
        child.kill()
        assert _backend.RayBackend().wait_exited(ranks, timeout=60) == []
    finally:
        child.kill()
        child.wait()
    monkeypatch.setattr(_backend, "_client_mode", lambda: True)  # Ray Client: this machine runs none of them
    assert _backend.RayBackend().wait_exited(ranks, timeout=60) == []
