"""What a rank remembers of its fast-path sessions (``orchestra._channel``): how far each got, which of its calls
will never run, and the outcomes that readers in other groups asked for before the calls finished (``Host.retain``,
``Host.retained``). Ray-free and thread-safe: the compute lane finishes calls while the control and forward lanes ask.

A session is one channel's life on this rank, named by the channel's key (``chan-<controller>-<number>``); its calls
are named ``fast-<controller>-<number>``, numbered in the order their controller made them."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["KEPT", "Retained", "Session", "Sessions"]

KEPT = 64  # ended sessions remembered beyond those still open; older ones are answered from their numbers alone


def _origin(name: str) -> tuple[str, int]:
    """(the controller that made it, its number there) of a session key or call id."""
    head, number = name.rsplit("-", 1)
    return head.split("-", 1)[1], int(number)


class Session:
    """How far one session got on this rank: the number of the last call done, whether its loop ended, and the
    numbers of calls the controller said will never run here."""

    __slots__ = ("last", "ended", "never")

    def __init__(self) -> None:
        self.last = -1
        self.ended = False
        self.never: set[int] = set()


class Retained:
    """A fast-path call's outcome kept for one reader that asked before the call finished (``Host.retain``)."""

    __slots__ = ("call_id", "path", "decision", "outcome")

    def __init__(self) -> None:
        self.call_id: str | None = None
        self.path: str | None = None
        self.decision: str | None = None  # retain's answer: "retaining", "done" or "never"
        # ("ok", frame), ("kept", snapshot), ("err", error) or ("never", None)
        self.outcome: tuple[str, Any] | None = None


class Sessions:
    """A rank's fast-path sessions and the readers waiting on their calls. An ended session is dropped once
    ``kept`` newer ones ended after it; a reader asking about it later is told "done" (its calls' replies all
    reached the controller or were failed there, so the reader waits for the controller's reply). A session still
    open is never dropped: a reader asking about it may be waiting for a call that has yet to run."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # (``done`` takes the lock itself: two Python calls less)
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._dropped: dict[str, int] = {}  # controller -> the highest number of a session of it dropped here
        self._retaining: dict[str, Retained] = {}

    def session(self, path: str) -> Session:
        """Session ``path``, made when first named (by its serve loop, a call resent through Ray, or a reader)."""
        with self._cond:
            return self._session(path)

    def _session(self, path: str) -> Session:
        s = self._sessions.get(path)
        if s is None:
            s = self._sessions[path] = Session()
        return s

    def _was_dropped(self, path: str) -> bool:
        origin, number = _origin(path)
        return path not in self._sessions and number <= self._dropped.get(origin, -1)

    def done(self, session: Session, call_id: str, number: int, outcome: Callable[[], tuple[str, Any]]) -> None:
        """Call ``call_id`` (number ``number``) of ``session`` finished: note how far the session got, and hand
        ``outcome()`` (made only if a reader asked) to the readers waiting for it."""
        with self._lock:  # (the condition's own: every call's path, so without the Condition's Python __enter__)
            session.last = number
            if not self._retaining:  # the usual case: no reader asked
                return
            slots = [s for s in self._retaining.values()  # one already told "never" keeps that answer
                     if s.call_id == call_id and s.decision == "retaining" and s.outcome is None]
            if not slots:
                return
            got = outcome()
            for slot in slots:
                slot.outcome = got
            self._cond.notify_all()

    def ended(self, path: str) -> None:
        """Session ``path``'s loop returned, or the controller said its calls will not run: a reader still waiting
        for one of them waits for a call that never ran. Older ended sessions are dropped past ``kept``."""
        with self._cond:
            if self._was_dropped(path):
                return
            self._session(path).ended = True
            self._settle(lambda slot: slot.path == path)
            self._drop_old()

    def never(self, path: str, call_ids: list[str]) -> None:
        """These calls of session ``path`` are not to be waited for here (Ray could not deliver their call, so the
        controller failed them; one may still have run): a reader waiting for one is told so, as is one that asks
        later, and fails as the controller's reply did."""
        ids = set(call_ids)
        with self._cond:
            if self._was_dropped(path):
                return
            self._session(path).never.update(_origin(c)[1] for c in ids)
            self._settle(lambda slot: slot.path == path and slot.call_id in ids)

    def _settle(self, which: Callable[[Retained], bool]) -> None:
        for slot in self._retaining.values():
            if which(slot) and slot.decision == "retaining" and slot.outcome is None:
                slot.outcome = ("never", None)
        self._cond.notify_all()

    def _drop_old(self) -> None:
        ended = [p for p, s in self._sessions.items() if s.ended]
        for path in ended[:max(len(ended) - self._kept, 0)]:
            del self._sessions[path]
            origin, number = _origin(path)
            self._dropped[origin] = max(self._dropped.get(origin, -1), number)

    def retain(self, path: str, call_id: str, ask: str) -> str:
        """See ``Host.retain``: "done", "never" or "retaining", decided under the lock a finishing call takes."""
        number = _origin(call_id)[1]
        with self._cond:
            slot = self._retaining.get(ask)
            if slot is None:
                slot = self._retaining[ask] = Retained()
            slot.call_id, slot.path = call_id, path
            if self._was_dropped(path):
                slot.decision = "done"
            else:
                s = self._session(path)
                slot.decision = ("never" if number in s.never else "done" if number <= s.last
                                 else "never" if s.ended else "retaining")
            self._cond.notify_all()
            return slot.decision

    def retained(self, ask: str) -> Retained:
        """Wait until ``retain`` decided for reader ``ask`` (it may come second) and, if it kept the outcome, until
        the call finished; the entry ends here."""
        with self._cond:
            slot = self._retaining.get(ask)
            if slot is None:
                slot = self._retaining[ask] = Retained()
            self._cond.wait_for(lambda: slot.decision is not None and
                                (slot.decision != "retaining" or slot.outcome is not None))
            del self._retaining[ask]
            return slot

    def waiting(self) -> int:
        """How many readers' entries are held (for tests: none once every reader got its answer)."""
        with self._cond:
            return len(self._retaining)
