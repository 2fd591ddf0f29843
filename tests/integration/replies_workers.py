"""Workers for the reply-completion tests (imported by Ray worker processes)."""

from __future__ import annotations

import time

from orchestra import Worker, endpoint
from orchestra import dispatch as D


class Replier(Worker):
    @endpoint(D.broadcast())
    def rank_and(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @endpoint(D.broadcast())
    def fail_one_block_others(self) -> int:
        """Rank 0 fails at once; every other rank runs until the controller cancels the call."""
        if self.rank == 0:
            raise ValueError("rank 0 fails on purpose")
        while not self.cancelled():
            time.sleep(0.005)
        return self.rank

    @endpoint(D.broadcast())
    def after(self, seconds: float) -> int:
        """Replies after ``seconds`` (longer than the batched window: the per-ref fallback delivers it)."""
        time.sleep(seconds)
        return self.rank
