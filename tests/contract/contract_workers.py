"""Workers of the backend contract tests (importable by Ray workers through PYTHONPATH, and in-process)."""

from __future__ import annotations

import time

import numpy as np
import torch

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D
from orchestra.testing import FailOnCue, Sequencer


def _fail_to_load() -> object:
    raise RuntimeError("this object cannot be rebuilt where it is read")


class _LoadFails:
    """Pickles on the rank; unpickling it raises (a class whose __reduce__ rebuilds through a failing function)."""

    def __reduce__(self) -> tuple:
        return (_fail_to_load, ())


class EvenRanks(D.Dispatch):
    """A user's transform: run on the even ranks only."""

    def check(self, plan: D.Plan) -> D.Plan:
        return plan.with_(ranks=tuple(r for r in plan.ranks if r % 2 == 0))


class Echo(FailOnCue, Worker):
    """Row transforms, values, a generator, a cancellable hold and a writer of its own inputs."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.seen = 0  # data calls that ran here
        self.outcomes: list[str] = []

    @endpoint(D.shard(), requires=["x"])
    def scale_x(self, batch: Batch) -> Batch:
        self.seen += 1
        return Batch.from_dict({"y": batch["x"] * self.scale, "rank": torch.full((len(batch),), self.rank)})

    @endpoint(D.shard())
    def echo(self, batch: Batch) -> Batch:
        self.seen += 1
        return batch

    @endpoint(D.shard())
    def rank_one_without_y(self, batch: Batch) -> Batch:
        """Columns x and y, but rank 1's result has no y: the ranks' results do not join."""
        cols = {"x": batch["x"]} if self.rank == 1 else {"x": batch["x"], "y": batch["x"] * 2}
        return Batch.from_dict(cols)

    @endpoint(D.shard())
    def plus_one(self, batch: Batch) -> Batch:
        self.seen += 1
        return Batch.from_dict({"z": batch["x"] + 1})

    @endpoint(D.shard())
    def refuse_row(self, batch: Batch, x: int) -> Batch:
        """Fails on the part that holds row value ``x`` (so a test knows which part, hence which rank, failed)."""
        if x in batch["x"].tolist():
            raise ValueError(f"refused row {x} on rank {self.rank}")
        return Batch.from_dict({"z": batch["x"] + 1})

    @endpoint(D.shard())
    def write_in_place(self, batch: Batch) -> Batch:
        """Writes into its input (allowed: inputs are private) and returns it."""
        batch["x"].add_(1000)
        return batch.select("x")

    @endpoint(D.shard())
    def total(self, batch: Batch) -> int:
        return int(batch["x"].sum())

    @endpoint(D.broadcast())
    def declare_dead_on(self, rank: int, reason: str) -> int:
        """Rank ``rank`` declares itself dead (``Worker.declare_dead``), then every rank returns its rank."""
        if self.rank == rank:
            self.declare_dead(reason)
        return self.rank

    @endpoint(D.scatter() | D.shard())
    def offset_rows(self, batch: Batch, offset: list) -> Batch:
        """Rank i adds entry i of ``offset`` to its shard of the rows."""
        return Batch.from_dict({"x": batch["x"] + offset})

    @endpoint(D.shard())
    def totals(self, batch: Batch):
        """Two plain values per rank: the sum of each half of its rows."""
        for piece in batch.chunk(2):
            yield int(piece["x"].sum())

    @endpoint(D.shard(pad=True))
    def padded(self, batch: Batch) -> Batch:
        self.seen += 1
        return Batch.from_dict({"n": torch.full((len(batch),), len(batch))})

    @endpoint(D.shard())
    def gen(self, batch: Batch, pieces: int = 2):
        for piece in batch.chunk(pieces):
            yield piece

    @endpoint(D.shard(pad=True))
    def padded_short(self, batch: Batch) -> Batch:
        """Wrong on purpose: one row fewer than it was given."""
        return batch.slice(0, len(batch) - 1)

    @endpoint
    def make_value(self) -> dict:
        return {"k": "orig", "lst": [1]}

    @endpoint
    def take_value(self, v: object) -> object:
        return v

    @endpoint(D.broadcast())
    def rows_each(self, n: int) -> Batch:
        """Every rank returns the same ``n`` rows: ``await`` gives one Batch per rank, not one row space."""
        return Batch.from_dict({"x": torch.arange(n)})

    @endpoint(D.broadcast() | D.only_ranks(1))
    def on_rank_one(self, v: object) -> object:
        return v

    @endpoint(D.broadcast() | D.only_ranks(0))
    def on_rank_zero(self) -> int:
        return self.rank

    @endpoint(D.broadcast() | D.metrics("mean"))
    def rank_metrics(self) -> dict:
        return {"a": float(self.rank + 1)}

    @endpoint(D.shard() | EvenRanks())
    def shard_even(self, batch: Batch) -> Batch:
        """Wrong on purpose: the odd ranks' rows would be lost."""
        return batch

    @endpoint(D.broadcast() | D.only_ranks(0) | D.from_rank(1))
    def only0_from1(self) -> int:
        """Wrong on purpose: keeps the value of a rank that does not run."""
        return self.rank

    @endpoint(D.broadcast() | D.from_rank(0))
    def from_zero(self, v: object) -> object:
        """Every rank runs; only rank 0's value is kept (the others' count only for failing)."""
        return v

    @endpoint(D.shard())
    def scribble(self, batch: Batch) -> int:
        """Writes into the nested parts of its input: a meta list and the dicts of an object column."""
        batch.meta["tags"].append(f"rank{self.rank}")
        for row in batch["obj"]:
            row["mark"] = "written"
        return len(batch)

    @endpoint(D.shard())
    def marks(self, batch: Batch) -> list:
        return [list(batch.meta["tags"]), sum(1 for row in batch["obj"] if "mark" in row)]

    @endpoint(D.broadcast())
    def set_scale(self, s: float) -> float:
        self.scale = s
        return s

    @endpoint
    def whoami(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "role": self.role}

    @endpoint
    async def async_add(self, v: int) -> int:
        return v + self.rank

    @endpoint
    def lazy_values(self) -> object:
        return (i for i in range(3))  # a generator object from a plain endpoint (not a generator endpoint)

    @endpoint
    def np_ones(self, n: int) -> object:
        return {"a": np.ones(n)}

    @endpoint
    def np_writable(self, arr: object) -> bool:
        return bool(arr.flags.writeable)

    @endpoint
    def unloadable(self) -> object:
        return _LoadFails()

    @endpoint
    def take(self, obj: object) -> str:
        self.seen += 1
        return type(obj).__name__

    @endpoint
    def seen_calls(self) -> int:
        return self.seen

    @endpoint
    def fail_here(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"refused on rank {rank}")
        return self.rank

    @endpoint(D.shard())
    def fail_shard(self, batch: Batch) -> Batch:
        raise KeyError("no rows today")

    def _hold(self, seq: Sequencer, bound: float, cancelled: str) -> int:
        with seq(self.rank):
            pass
        end = time.monotonic() + bound
        while not self.cancelled():
            if time.monotonic() > end:
                self.outcomes.append("bound")
                return -1
            time.sleep(0.002)
        self.outcomes.append(cancelled)
        return self.rank

    @endpoint
    def hold_until_cancelled(self, seq: Sequencer, bound: float = 120.0) -> int:
        """Pass sequencer position ``rank`` (so the test knows every rank is running), then poll ``cancelled()``
        until the controller cancels the call. ``bound`` only ends a broken test."""
        return self._hold(seq, bound, "cancelled")

    @endpoint
    def hold_rows_until_cancelled(self, batch: Batch, seq: Sequencer, bound: float = 120.0) -> int:
        """:meth:`hold_until_cancelled` with a Batch argument (a large one: the call takes the general path)."""
        return self._hold(seq, bound, f"cancelled with {len(batch)} rows")

    @endpoint(D.shard())
    def hold_part_until_cancelled(self, batch: Batch, seq: Sequencer, bound: float = 120.0) -> Batch:
        """For ``stream()``: part x (the part whose first row is x) records that it started, passes sequencer
        position x, then polls ``cancelled()`` like :meth:`hold_until_cancelled`."""
        x = int(batch["x"][0])
        self.outcomes.append(f"part {x} started")
        with seq(x):
            pass
        end = time.monotonic() + bound
        while not self.cancelled():
            if time.monotonic() > end:
                self.outcomes.append(f"part {x} bound")
                return batch
            time.sleep(0.002)
        self.outcomes.append(f"part {x} cancelled")
        return batch

    @endpoint(D.shard())
    def gate_rows(self, batch: Batch, seq: Sequencer) -> Batch:
        """Returns its rows once sequencer position x + 1 is its turn (x: its first row), so a test decides when."""
        with seq(int(batch["x"][0]) + 1):
            pass
        return batch

    @endpoint(D.shard())
    def mark_rows(self, batch: Batch) -> Batch:
        """Records that its body ran (a side effect a cancelled call must not have)."""
        self.outcomes.append(f"ran on {len(batch)} rows")
        return batch

    @endpoint
    def hold_like_a_collective(self, seq: Sequencer) -> Batch:
        """Every rank passes position ``rank``; then rank 0 blocks without looking at ``cancelled()`` (as a rank
        in a collective whose peer died) until the test passes position ``world_size + 1``; the others return
        (a row: its parts can be iterated)."""
        with seq(self.rank):
            pass
        if self.rank == 0:
            with seq(self.world_size + 2):
                pass
        return Batch.from_dict({"rank": torch.tensor([self.rank])})

    @endpoint
    def take_outcomes(self) -> list[str]:
        out, self.outcomes = self.outcomes, []
        return out


class Meshed(FailOnCue, Worker):
    """DP=1 x TP=2: both ranks read the same rows; rank 0 alone reports."""

    def __init__(self) -> None:
        self.register_mesh("tp", dp_rank=0, dp_size=1, is_collector=self.rank == 0)

    @endpoint(D.shard(mesh="tp"))
    def compute(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})

    @endpoint(D.shard(mesh="tp"))
    def total(self, batch: Batch) -> int:
        return int(batch["x"].sum())

    @endpoint
    def take_value(self, v: object) -> object:
        return v


class ReversedMesh(Worker):
    """Each rank its own DP replica, numbered against rank order: rank r serves replica world_size - 1 - r."""

    def __init__(self) -> None:
        self.register_mesh("dp", dp_rank=self.world_size - 1 - self.rank, dp_size=self.world_size)

    @endpoint(D.shard(mesh="dp"))
    def compute(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})

    @endpoint(D.shard(mesh="dp", pad=True))
    def compute_pad(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})


class Critic(Worker):
    @endpoint
    def whoami(self) -> dict:
        return {"rank": self.rank, "role": self.role}


class BadInit(Worker):
    def __init__(self, bad_rank: int) -> None:
        if self.rank == bad_rank:
            raise RuntimeError(f"rank {self.rank} cannot start")

    @endpoint
    def ping_me(self) -> int:
        return self.rank
