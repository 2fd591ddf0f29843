"""The Ray actor behind a ``Sequencer`` (see ``orchestra.testing._helpers``).

In a module of its own that imports nothing but asyncio: the actor's process imports the module its class is
defined in, and the helpers' module imports the core and torch (about 4 s of CPU per Sequencer on 2 cores).
"""

from __future__ import annotations

import asyncio

__all__ = ["SequencerState"]


class SequencerState:
    """The Ray actor behind a Sequencer: the next position to run, and why the sequence broke (if it did)."""

    def __init__(self) -> None:
        self.next = 0
        self.entered: set[int] = set()
        self.broken: str | None = None
        self.cond: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self.cond is None:  # made on the actor's event loop, on first use
            self.cond = asyncio.Condition()
        return self.cond

    async def enter(self, pos: int, timeout: float) -> tuple[str, str]:
        """Wait until every position before ``pos`` has exited; ("ok", "") or ("error", why)."""
        cond = self._cond()
        async with cond:
            if pos in self.entered:
                return "error", f"position {pos} was entered twice; each position is used once"
            self.entered.add(pos)
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self.broken is not None or self.next == pos), timeout)
            except asyncio.TimeoutError:
                return "error", (f"position {pos} still waiting after {timeout:g} s: the sequence is at position "
                                 f"{self.next} (entered so far: {sorted(self.entered)}); did position {self.next} "
                                 f"never run or never exit?")
            if self.broken is not None:
                return "error", f"the sequence is broken: {self.broken}"
            return "ok", ""

    async def exit(self, pos: int, error: str | None) -> tuple[str, str]:
        """Leave ``pos`` (the current position): the next one may enter, or, on ``error``, every waiter fails."""
        cond = self._cond()
        async with cond:
            if self.broken is not None:
                return "error", f"the sequence is broken: {self.broken}"
            if pos != self.next:
                return "error", f"position {pos} exited while the sequence is at position {self.next}"
            if error is not None:
                self.broken = f"position {pos} raised {error}"
            else:
                self.next += 1
            cond.notify_all()
            return "ok", ""

    def position(self) -> int:
        return self.next
