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
