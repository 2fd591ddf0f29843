"""A worker whose call can be held running until the test lets it go or cancels it (in-process backend: the rank's
thread and the test share these events), so a test acts while a call runs without sleeping to guess when it runs."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

import orchestra as orc
from orchestra import Worker, endpoint
from orchestra import dispatch as D

HELD, RELEASE = threading.Event(), threading.Event()  # a call of ``hold`` began / may return


def began() -> None:
    """Block (off the loop: ``anyio.to_thread.run_sync``) until a ``hold`` call began on its rank; a hang is a
    failure, not a threshold."""
    assert HELD.wait(60), "the hold call never began"


def reset() -> None:
    """Before a test's ``hold``: nothing began yet, nothing let go."""
    HELD.clear()
    RELEASE.clear()


class Holding(Worker):
    @endpoint(D.broadcast())
    def hold(self) -> int:
        """Says it began (``HELD``), then runs until its call is cancelled or ``RELEASE`` is set."""
        HELD.set()
        while not self.cancelled() and not RELEASE.is_set():
            time.sleep(0.002)
        return self.rank

    @endpoint(D.broadcast())
    def slow(self, s: float = 0.0) -> int:
        time.sleep(s)
        return self.rank


async def fail_cancel_and_hold(g: Any) -> None:
    """On group ``g`` (a Holding with a ``boom`` endpoint that raises): one call that fails, one ``hold`` cancelled
    while it runs, then one ``hold`` that returns (the rank's lane runs it after the cancelled call ended)."""
    with pytest.raises(orc.WorkerError):
        await g.boom()
    reset()
    fut = g.hold()
    await anyio.to_thread.run_sync(began)
    fut.cancel()
    with pytest.raises(orc.CallCancelledError):
        await fut
    RELEASE.set()
    await g.hold()
