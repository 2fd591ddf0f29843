"""Workers for the tests of orchestra.testing (importable by the Ray workers through PYTHONPATH)."""

from __future__ import annotations

import torch

from orchestra import Batch, endpoint
from orchestra import dispatch as D
from orchestra.testing import FailOnCue, Sequencer


class Recorder(FailOnCue):
    """Writes to a shared file in the order a Sequencer says; fails on cue (``fail_rank``)."""

    @endpoint(D.broadcast())
    def append_in_turn(self, seq: Sequencer, positions: list[int], path: str) -> int:
        """Append ``rank<r>`` to ``path`` at sequencer position ``positions[rank]``."""
        with seq(positions[self.rank]):
            with open(path, "a") as f:
                f.write(f"rank{self.rank}\n")
        return self.rank

    @endpoint(D.broadcast())
    def hold(self, seq: Sequencer) -> bool:
        """Runs through positions 0 and 2: the caller acts at position 1, while this call is surely running."""
        with seq(0):
            pass
        with seq(2):
            pass
        return True

    @endpoint(D.shard())
    def double(self, batch: Batch) -> Batch:
        return Batch.from_dict({"y": batch["x"] * 2, "rank": torch.full((len(batch),), self.rank)})
