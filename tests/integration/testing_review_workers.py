"""Workers of tests/integration/test_testing_review_ray.py (a module of its own: Ray ranks import it by name); its
``Reports`` is the in-process tests' too (tests/unit/core/test_testing_review_local.py)."""

from __future__ import annotations

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D
from orchestra.testing import Sequencer


class Reports(Worker):
    """What the leak reports are tested on (here and in tests/unit/core/test_testing_review_local.py): a stream that
    fails after its first part, a failing call, a call that reads another's result, a call that does nothing."""

    @endpoint(D.shard())
    def fail_after_first(self, batch: Batch, seq: Sequencer):
        yield batch.slice(0, 1)
        with seq(1):  # the test lets it go on once it stopped reading
            pass
        raise RuntimeError(f"second part failed on rank {self.rank}")

    @endpoint(D.broadcast())
    def boom(self) -> None:
        raise ValueError(f"boom on rank {self.rank}")

    @endpoint(D.broadcast())
    def take(self, x: object) -> str:
        return type(x).__name__

    @endpoint(D.broadcast())
    def noop(self) -> int:
        return self.rank


class Turns(Reports):
    @endpoint(D.broadcast())
    def wait_turn(self, seq: Sequencer, pos: int, started: Sequencer) -> int:
        with started(0):  # tells the test this call runs (the test waits for position 1 of ``started``)
            pass
        with seq(pos):
            raise AssertionError("the block of a cancelled call ran")
        return pos

    @endpoint(D.broadcast())
    async def await_turn(self, seq: Sequencer, pos: int, started: Sequencer) -> int:
        async with started(0):
            pass
        async with seq(pos):
            raise AssertionError("the block of a cancelled call ran")
        return pos
