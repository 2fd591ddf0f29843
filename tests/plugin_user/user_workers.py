"""A user's own Worker, as it would sit next to their tests (imported by the Ray workers through the path pytest
puts the tests' directory on)."""

from __future__ import annotations

import torch

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D


class Accumulator(Worker):
    """Keeps a running total per rank and doubles a column of the rows it is given."""

    def __init__(self, start: int = 0) -> None:
        self.total = start

    @endpoint(D.shard(), requires=["x"])
    def double(self, batch: Batch) -> Batch:
        """``y = 2 x`` for this rank's rows, and which rank computed each row."""
        return Batch.from_dict({"y": batch["x"] * 2, "rank": torch.full((len(batch),), self.rank)})

    @endpoint(D.broadcast())
    def add(self, n: int) -> int:
        """Add ``n`` to this rank's total; returns the new total."""
        self.total += n
        return self.total

    @endpoint(D.broadcast() | D.rank_zero())
    def total_on_rank_zero(self) -> int:
        return self.total
