"""The fast path's serve thread runs SCHED_BATCH while it holds its channel (orchestra._channel.batch_scheduled)."""

from __future__ import annotations

import os
import threading

import pytest

from orchestra import _channel

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="scheduling policies are Linux's")


def _in_thread(fn):
    """Run ``fn`` in a thread of its own (a policy is per thread: the test's own thread is left alone)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_the_policy_is_batch_inside_and_the_threads_own_again_after():
    def run():
        before = os.sched_getscheduler(0)
        with _channel.batch_scheduled():
            inside = os.sched_getscheduler(0)
        return before, inside, os.sched_getscheduler(0)

    before, inside, after = _in_thread(run)
    assert inside == os.SCHED_BATCH
    assert after == before


def test_the_policy_comes_back_when_the_loop_ends_with_an_error():
    def run():
        before = os.sched_getscheduler(0)
        with pytest.raises(OSError, match="the controller left"):
            with _channel.batch_scheduled():
                raise OSError("the controller left")
        return before, os.sched_getscheduler(0)

    before, after = _in_thread(run)
    assert after == before


def test_where_the_policy_cannot_be_set_the_loop_runs_as_it_was(monkeypatch):
    def refuse(*args):
        raise PermissionError("not here")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)

    def run():
        before = os.sched_getscheduler(0)
        with _channel.batch_scheduled():
            return before, os.sched_getscheduler(0)

    before, inside = _in_thread(run)
    assert inside == before


def test_where_the_policy_cannot_be_set_an_error_of_the_loop_carries_no_context_of_it(monkeypatch):
    """The loop ran inside the handler of the refusal, so its own error (a reset socket) came with "During handling
    of the above exception, another exception occurred" and the PermissionError in the rank's report."""
    def refuse(*args):
        raise PermissionError("not here")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)

    def run():
        try:
            with _channel.batch_scheduled():
                raise ConnectionResetError("the controller left")
        except ConnectionResetError as e:
            return e.__context__

    assert _in_thread(run) is None
