"""What a rank remembers of its fast-path sessions (orchestra._sessions), without Ray: a reader in another group
that asks a rank for a fast call's outcome before its reply reached the controller gets an answer, whatever became of
the call (done, kept for it, never run) and however long ago its session ended."""

from __future__ import annotations

import threading

from orchestra._sessions import Sessions


def _waiting_reader(sessions: Sessions, ask: str) -> tuple[threading.Thread, list]:
    """``Host.retained`` on its own lane: waits in a thread; what it got lands in the list."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(sessions.retained(ask)), daemon=True)
    t.start()
    return t, got


def test_a_reader_asking_before_the_call_finished_gets_its_outcome():
    s = Sessions()
    session = s.session("chan-c1-0")
    assert s.retain("chan-c1-0", "fast-c1-1", "a") == "retaining"
    t, got = _waiting_reader(s, "a")
    s.done(session, "fast-c1-1", 1, lambda: ("ok", b"frame"))
    t.join(30)
    assert got[0].outcome == ("ok", b"frame") and s.waiting() == 0
    assert s.retain("chan-c1-0", "fast-c1-1", "b") == "done"  # a later reader waits for the controller's reply
    assert s.retained("b").decision == "done"


def test_a_session_that_ended_without_a_call_answers_never_ran():
    s = Sessions()
    assert s.retain("chan-c1-0", "fast-c1-3", "a") == "retaining"  # asked before the rank's serve loop started
    t, got = _waiting_reader(s, "a")
    s.ended("chan-c1-0")
    t.join(30)
    assert got[0].outcome == ("never", None)
    assert s.retain("chan-c1-0", "fast-c1-4", "b") == "never" and s.retained("b").outcome is None


def test_calls_named_as_never_run_answer_so_now_and_later_and_only_those():
    """A resent call Ray could not deliver (``Host.forget_calls``): its waiting reader is told, as is a later one;
    a call of the same session after it still runs and is answered as usual."""
    s = Sessions()
    session = s.session("chan-c1-0")
    assert s.retain("chan-c1-0", "fast-c1-1", "a") == "retaining"
    assert s.retain("chan-c1-0", "fast-c1-2", "b") == "retaining"
    ta, got_a = _waiting_reader(s, "a")
    s.never("chan-c1-0", ["fast-c1-1"])
    ta.join(30)
    assert got_a[0].outcome == ("never", None)
    tb, got_b = _waiting_reader(s, "b")
    s.done(session, "fast-c1-2", 2, lambda: ("ok", b"two"))
    tb.join(30)
    assert got_b[0].outcome == ("ok", b"two")
    assert s.retain("chan-c1-0", "fast-c1-1", "c") == "never"  # though a later call of its session is done
    s.retained("c")
    assert s.waiting() == 0


def test_a_session_dropped_long_ago_answers_done_not_a_wait_that_never_ends():
    """Ended sessions are dropped past ``kept``; a reader asking about one later was answered "retaining" (its
    session made anew) and waited forever. It is told "done": the controller has, or failed, every reply of it."""
    s = Sessions(kept=4)
    old = s.session("chan-c1-0")
    s.done(old, "fast-c1-1", 1, lambda: ("ok", b""))
    s.ended("chan-c1-0")
    for n in range(10, 20):
        s.ended(f"chan-c1-{n}")
    assert s.retain("chan-c1-0", "fast-c1-1", "a") == "done"
    assert s.retained("a").decision == "done"
    assert s.retain("chan-c2-0", "fast-c2-1", "b") == "retaining"  # another controller's session: not dropped
    s.ended("chan-c2-0")
    assert s.retained("b").outcome == ("never", None)


def test_a_session_still_open_is_never_dropped_however_many_end_after_it():
    s = Sessions(kept=2)
    open_one = s.session("chan-c1-0")  # its serve loop waits: a reader may be waiting for a call yet to run
    assert s.retain("chan-c1-0", "fast-c1-5", "a") == "retaining"
    for n in range(10, 30):
        s.ended(f"chan-c1-{n}")
    t, got = _waiting_reader(s, "a")
    s.done(open_one, "fast-c1-5", 5, lambda: ("err", ValueError("x")))
    t.join(30)
    assert got[0].outcome[0] == "err"
    assert s.retain("chan-c1-0", "fast-c1-6", "b") == "retaining"
    s.ended("chan-c1-0")
    assert s.retained("b").outcome == ("never", None)
