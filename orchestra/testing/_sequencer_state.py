"""The state behind a ``Sequencer`` (see ``orchestra.testing._helpers``): one protocol, two ways to wait.

``SequencerState`` is one sequence on a Ray actor (asyncio), ``SequencerHost`` that actor: every Sequencer of one
driver is a sequence on one host, since an actor per Sequencer would cost a Ray worker process start (a second or
more of CPU on 2 cores) for each. ``ThreadSequencerState`` is the in-process backend's object (threads). In a module
of its own that imports nothing but asyncio and threading: the actor's process imports the module its class is
defined in, and the helpers' module imports the core and torch (about 4 s of CPU on 2 cores).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

__all__ = ["SequencerHost", "SequencerState", "ThreadSequencerState"]

OK = ("ok", "")
POLL_S = 0.02  # how often a wait inside an endpoint asks whether its call was cancelled


class _Protocol:
    """The sequence itself: the next position to run, the positions entered, and why it broke (if it did). Every
    method here runs under the subclass's lock.

    Each wait carries a ticket (a string its caller makes). A wait that ends without entering (its caller was
    cancelled, or it timed out) gives its position back (``_give_back``): the position was never entered, so a
    later wait may take it, and the abandoned wait, if it is still waiting, returns without taking its turn."""

    def __init__(self) -> None:
        self.next = 0
        self.entered: set[int] = set()  # positions taken by a wait: waiting, running or exited
        self.tickets: dict[int, str] = {}  # position -> the ticket of the wait that took it
        self.given_up: set[str] = set()  # tickets given back before their wait arrived (a give-back may overtake it)
        self.inside: set[int] = set()  # positions whose block runs now (entered, not exited)
        # tickets of waits that arrived for a position another wait holds (waiting, or inside its block): they wait
        # for it to give the position back (a cancelled call's wait may notice its cancellation only once let in:
        # on Ray the rank learns of it a moment after the caller) or to exit (then it was entered twice)
        self.queued: dict[str, int] = {}
        self.broken: str | None = None

    def _arrive(self, pos: int, ticket: str) -> tuple[str, str] | None:
        if ticket in self.given_up:
            self.given_up.discard(ticket)
            return self._withdrawn(pos)
        if pos in self.entered:
            if pos < self.next:
                return self._twice(pos)
            self.queued[ticket] = pos  # its holder has not exited: it may give it back (``_turn``)
            return None
        self._take(pos, ticket)
        return None

    def _take(self, pos: int, ticket: str) -> None:
        self.entered.add(pos)
        self.tickets[pos] = ticket

    @staticmethod
    def _twice(pos: int) -> tuple[str, str]:
        return "error", f"position {pos} was entered twice; each position is used once"

    def _turn(self, pos: int, ticket: str) -> Callable[[], bool]:
        def ready() -> bool:
            if self.broken is not None:
                return True
            if ticket in self.queued:
                if pos in self.tickets:  # its holder: exited (``_entered`` says twice), or not yet
                    return pos < self.next
                del self.queued[ticket]  # given back: this wait takes it
                self._take(pos, ticket)
            return self.tickets.get(pos) != ticket or self.next == pos
        return ready

    @staticmethod
    def _withdrawn(pos: int) -> tuple[str, str]:
        return "error", f"position {pos}: this wait was given up (cancelled) before its turn; it did not enter"

    def _timed_out(self, pos: int, ticket: str, timeout: float) -> tuple[str, str]:
        if ticket in self.queued:
            self._give_back(pos, ticket)
            return "error", (f"position {pos} still waiting after {timeout:g} s: another wait holds position {pos} "
                             f"and has not exited nor given it back (each position is used once)")
        out = "error", (f"position {pos} still waiting after {timeout:g} s: the sequence is at position "
                        f"{self.next}, and {self._holding_up()}")
        self._give_back(pos, ticket)  # it did not enter: the position is free again
        return out

    def _holding_up(self) -> str:
        """What keeps the sequence at ``next``: a position that never arrived, or one whose block has not exited."""
        n = self.next
        waiting = sorted(p for p in self.entered if p > n and p not in self.inside)
        if n in self.inside:
            why = f"position {n} entered and has not exited (its block still runs, or blocks)"
        elif n not in self.tickets:
            why = (f"position {n} has not arrived (no wait for it started): is the code that enters it running, "
                   f"and after this wait?")
        else:
            why = f"position {n} is waiting to be let in"
        return f"{why}; waiting: {waiting}"

    def _entered(self, pos: int, ticket: str) -> tuple[str, str]:
        if self.queued.pop(ticket, None) is not None:  # its holder entered the position
            return self._twice(pos)
        if self.tickets.get(pos) != ticket:  # given back while it waited
            return self._withdrawn(pos)
        if self.broken is not None:
            return "error", f"the sequence is broken: {self.broken}"
        self.inside.add(pos)
        return OK

    def _cancelled(self, pos: int, ticket: str) -> tuple[str, str]:
        """The call whose endpoint waited was cancelled: its wait gives the position back."""
        self._give_back(pos, ticket)
        return "cancelled", (f"cancelled while it waited for Sequencer position {pos}; the position was given back "
                             f"and the block did not run")

    def _give_back(self, pos: int, ticket: str) -> None:
        """The wait with ``ticket`` for ``pos`` ended without its block running: free the position (the caller
        notifies the waiters). A give-back that arrives before its wait is remembered, so that wait returns at once."""
        if self.queued.pop(ticket, None) is not None:  # it waited for another wait's position: nothing to free
            return
        if self.tickets.get(pos) == ticket:
            if pos >= self.next:  # not exited: never entered as far as the sequence goes
                del self.tickets[pos]
                self.entered.discard(pos)
                self.inside.discard(pos)  # (let in, but its block did not run: its call was cancelled)
        else:
            self.given_up.add(ticket)

    def _leave(self, pos: int, error: str | None) -> tuple[str, str]:
        if self.broken is not None:
            return "error", f"the sequence is broken: {self.broken}"
        if pos != self.next:
            return "error", f"position {pos} exited while the sequence is at position {self.next}"
        self.inside.discard(pos)
        if error is not None:
            self.broken = f"position {pos} raised {error}"
        else:
            self.next += 1
        return OK


class SequencerState(_Protocol):
    """One Sequencer's sequence on its ``SequencerHost`` (the host's event loop runs every method)."""

    def __init__(self) -> None:
        super().__init__()
        self.cond: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self.cond is None:  # made on the actor's event loop, on first use
            self.cond = asyncio.Condition()
        return self.cond

    async def enter(self, pos: int, timeout: float, ticket: str,
                    given_back: tuple[tuple[int, str], ...] = ()) -> tuple[str, str]:
        """Wait until every position before ``pos`` has exited; ("ok", "") or ("error", why). ``given_back``: the
        caller's earlier waits given up since its last call, given back first (their own give-back calls may come
        later: calls to an async actor run in no guaranteed order)."""
        cond = self._cond()
        async with cond:
            for p, t in given_back:
                self._give_back(p, t)
            if given_back:
                cond.notify_all()
            refused = self._arrive(pos, ticket)
            if refused:
                return refused
            try:
                await asyncio.wait_for(cond.wait_for(self._turn(pos, ticket)), timeout)
            except asyncio.TimeoutError:
                out = self._timed_out(pos, ticket, timeout)
                cond.notify_all()  # a wait queued behind this one's position may take it now
                return out
            return self._entered(pos, ticket)

    async def give_back(self, pos: int, ticket: str) -> None:
        """The wait with ``ticket`` was given up before its block ran: ``pos`` is free again."""
        cond = self._cond()
        async with cond:
            self._give_back(pos, ticket)
            cond.notify_all()

    async def exit(self, pos: int, error: str | None) -> tuple[str, str]:
        """Leave ``pos`` (the current position): the next one may enter, or, on ``error``, every waiter fails."""
        cond = self._cond()
        async with cond:
            out = self._leave(pos, error)
            cond.notify_all()
            return out

    def position(self) -> int:
        return self.next

    async def close(self) -> None:
        """Break the sequence: every waiting and later position fails with "the sequencer was closed"."""
        cond = self._cond()
        async with cond:
            if self.broken is None:
                self.broken = "the sequencer was closed"
            cond.notify_all()


class SequencerHost:
    """The Ray actor that holds every sequence of the Sequencers one driver makes, by Sequencer id (a closed one is
    kept, broken: a few hundred bytes each)."""

    def __init__(self) -> None:
        self._seqs: dict[str, SequencerState] = {}

    def _seq(self, sid: str) -> SequencerState:
        seq = self._seqs.get(sid)
        if seq is None:
            seq = self._seqs[sid] = SequencerState()
        return seq

    async def enter(self, sid: str, pos: int, timeout: float, ticket: str,
                    given_back: tuple[tuple[int, str], ...] = ()) -> tuple[str, str]:
        """``SequencerState.enter`` on sequence ``sid``."""
        return await self._seq(sid).enter(pos, timeout, ticket, given_back)

    async def give_back(self, sid: str, pos: int, ticket: str) -> None:
        """``SequencerState.give_back`` on sequence ``sid``."""
        await self._seq(sid).give_back(pos, ticket)

    async def exit(self, sid: str, pos: int, error: str | None) -> tuple[str, str]:
        """``SequencerState.exit`` on sequence ``sid``."""
        return await self._seq(sid).exit(pos, error)

    def position(self, sid: str) -> int:
        return self._seq(sid).position()

    async def close(self, sid: str) -> None:
        """Break sequence ``sid``: its waiting and later positions fail."""
        await self._seq(sid).close()


class ThreadSequencerState(_Protocol):
    """The in-process backend's Sequencer state, for threads and event loops. Passed to in-process ranks by
    reference (never copied), as a Ray actor handle would be. A blocking wait (``wait``) waits on a condition; an
    async one (``await_turn``) on a future of its own loop, woken by every change: no thread per waiter, so any
    number of async waits may wait at once."""

    _orc_in_process = True

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self._wakes: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []  # async waits, woken by _changed

    def _changed(self) -> None:
        """Under the lock: wake every wait (blocking and async) to look at the sequence again."""
        self.cond.notify_all()
        wakes, self._wakes = self._wakes, []
        for loop, fut in wakes:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # its loop is closed: nobody waits there any more
                pass

    def arrive(self, pos: int, ticket: str) -> tuple[str, str] | None:
        """Take ``pos`` for the wait ``ticket`` (None), or why not ("error", why). Never blocks."""
        with self.cond:
            return self._arrive(pos, ticket)

    def wait(self, pos: int, ticket: str, timeout: float,
             cancelled: Callable[[], bool] | None = None) -> tuple[str, str]:
        """Block until the turn of ``pos`` (taken by ``arrive``); ("ok", "") or ("error", why), or ("cancelled",
        why) once ``cancelled()`` (polled every ``POLL_S``) says the call waiting here was cancelled."""
        deadline = time.monotonic() + timeout
        turn = self._turn(pos, ticket)
        with self.cond:
            while True:
                if cancelled is not None and cancelled():  # first: a cancelled call never runs its block
                    out = self._cancelled(pos, ticket)
                    self._changed()
                    return out
                if turn():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    out = self._timed_out(pos, ticket, timeout)
                    self._changed()
                    return out
                self.cond.wait(left if cancelled is None else min(left, POLL_S))
            return self._entered(pos, ticket)

    async def await_turn(self, pos: int, ticket: str, timeout: float,
                         cancelled: Callable[[], bool] | None = None) -> tuple[str, str]:
        """``wait`` for an event loop: awaits a future woken by every change of the sequence (no thread)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        turn = self._turn(pos, ticket)
        while True:
            with self.cond:
                if cancelled is not None and cancelled():  # first: a cancelled call never runs its block
                    out = self._cancelled(pos, ticket)
                    self._changed()
                    return out
                if turn():
                    return self._entered(pos, ticket)
                left = deadline - loop.time()
                if left <= 0:
                    out = self._timed_out(pos, ticket, timeout)
                    self._changed()
                    return out
                woken = loop.create_future()
                self._wakes.append((loop, woken))
            await asyncio.wait([woken], timeout=left if cancelled is None else min(left, POLL_S))

    def enter(self, pos: int, timeout: float, ticket: str,
              cancelled: Callable[[], bool] | None = None) -> tuple[str, str]:
        """``arrive`` then ``wait``."""
        return self.arrive(pos, ticket) or self.wait(pos, ticket, timeout, cancelled)

    def give_back(self, pos: int, ticket: str) -> None:
        """The wait ``ticket`` was given up before its block ran: ``pos`` is free again, the wait returns."""
        with self.cond:
            self._give_back(pos, ticket)
            self._changed()

    def exit(self, pos: int, error: str | None) -> tuple[str, str]:
        with self.cond:
            out = self._leave(pos, error)
            self._changed()
            return out

    def position(self) -> int:
        with self.cond:
            return self.next

    def close(self) -> None:
        with self.cond:
            if self.broken is None:
                self.broken = "the sequencer was closed"
            self._changed()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
