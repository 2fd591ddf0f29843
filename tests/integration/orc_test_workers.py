"""Worker classes used by the integration tests (importable by the Ray workers through PYTHONPATH)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import torch

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D
from orchestra.testing import Sequencer


def _pass(seq: Sequencer, positions: list[int]) -> None:
    """Pass the Sequencer positions in order (each waits until every lower position has exited)."""
    for p in positions:
        with seq(p):
            pass


class Pinger:
    """A bare Ray actor class (``ray.remote(Pinger)``) whose handle the tests pass to ranks."""

    def ping(self) -> str:
        return "pong"


class Secret:
    """A value a user registers with ``ray.util.register_serializer`` to travel redacted."""

    def __init__(self, text: str) -> None:
        self.text = text


def redact(s: Secret) -> str:
    return "redacted"


def unredact(text: str) -> Secret:
    return Secret(text)


class Counted:
    """A value that counts how often this process pickled it (``Counted.pickled``)."""

    pickled = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        Counted.pickled += 1
        return Counted, (self.value,)


def _allreduce_rows(batch: Batch) -> Batch:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.tensor([len(batch)])
    dist.all_reduce(t)
    return Batch.from_dict({"total": t.repeat(len(batch))})


class Scorer(Worker):
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.calls: list[str] = []
        self.outcomes: list[str] = []  # how each ``hold_until_cancelled`` call ended (``take_outcomes``)
        self.seen = 0  # ``count_rows`` calls that ran here (``seen_calls``)

    @endpoint(D.shard(), requires=["x"])
    def score(self, batch: Batch) -> Batch:
        return Batch.from_dict({"score": batch["x"].double() * self.scale,
                                "rank": torch.full((len(batch),), self.rank)})

    @endpoint(D.shard())
    def echo(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def plus_one(self, batch: Batch) -> Batch:
        return Batch.from_dict({"y": batch["x"] + 1})

    @endpoint(D.shard(pad=True))
    def padded(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x2": batch["x"] * 2, "n": torch.full((len(batch),), len(batch))})

    @endpoint(D.shard(pad=True))
    def padded_echo(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def samples(self, batch: Batch, n: int) -> Batch:
        """Each row ``n`` times, side by side (as a rollout of ``n`` samples a prompt returns them)."""
        return batch.repeat(n)

    @endpoint(D.shard())
    def uneven_samples(self, batch: Batch) -> Batch:
        """Odd ranks return each row twice, even ranks once: the ranks disagree on how many rows a row makes."""
        return batch.repeat(1 + self.rank % 2)

    @endpoint(D.shard() | D.pad())
    def padded_pipe(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x2": batch["x"] * 2, "n": torch.full((len(batch),), len(batch))})

    @endpoint(D.shard(allow_empty=True))
    def maybe_empty(self, batch: Batch) -> Batch:
        return batch.select("x")

    @endpoint(D.broadcast())
    def set_scale(self, s: float) -> float:
        self.scale = s
        self.calls.append(f"set{s}")
        return s

    @endpoint(D.broadcast())
    def get_scale(self) -> float:
        return self.scale

    @endpoint(D.broadcast())
    def first_x(self, batch: Batch, write_on: int = -1) -> float:
        """Column x's first value; rank ``write_on`` first writes -1 there (careless: into its input)."""
        if self.rank == write_on:
            batch["x"][0] = -1.0
        return float(batch["x"][0])

    @endpoint(D.broadcast())
    def first_x_inside(self, held: Any, write_on: int = -1) -> float:
        """``first_x`` of the Batch inside a list (its first entry) or a dict (its "b")."""
        return self.first_x(held[0] if isinstance(held, list) else held["b"], write_on)

    @endpoint(D.shard() | D.stream())
    def first_x_per_part(self, batch: Batch, other: Batch) -> Batch:
        """Per streamed part: ``other``'s first x as this call found it, then -1 written there (careless)."""
        seen = float(other["x"][0])
        other["x"][0] = -1.0
        return Batch.from_dict({"seen": torch.full((len(batch),), seen)})

    @endpoint(D.broadcast())
    def tag_of(self, tag: Counted) -> int:
        return tag.value

    @endpoint(D.broadcast())
    def text_of(self, secret: Secret) -> str:
        return secret.text

    @endpoint(D.broadcast())
    def keep_handle(self, handle: Any) -> int:
        self.kept_handle = handle
        return self.rank

    @endpoint(D.broadcast())
    def call_kept_handle(self) -> str:
        import ray

        try:
            return ray.get(self.kept_handle.ping.remote(), timeout=60)
        finally:
            self.kept_handle = None

    @endpoint(D.shard())
    def tagged(self, batch: Batch, tag: Counted) -> Batch:
        return Batch.from_dict({"x": batch["x"], "tag": torch.full((len(batch),), tag.value)})

    @endpoint(D.broadcast())
    def rank_info(self) -> dict:
        return {"rank": self.rank, "world": self.world_size, "local_rank": self.local_rank,
                "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                      "MASTER_PORT")}}

    @endpoint(D.scatter())
    def take(self, x: int, tag: str = "") -> str:
        return f"{tag}{x}@{self.rank}"

    @endpoint(D.broadcast() | D.rank_zero())
    def save(self, path: str) -> str:
        return f"{path}:{self.rank}"

    @endpoint(D.broadcast() | D.metrics())
    def report(self, tag_rank: int | None = None) -> dict:
        """``tag_rank``: that rank also returns a value that is not a number (metrics() refuses it)."""
        out: dict = {"loss": float(self.rank), "tokens": 10.0 * (self.rank + 1)}
        return out | {"tag": f"rank{self.rank}"} if self.rank == tag_rank else out

    @endpoint(D.shard() | D.metrics("sum"))
    def count(self, batch: Batch, tag_rank: int | None = None) -> dict:
        return {"rows": len(batch)} | ({"first": batch["x"][:2]} if self.rank == tag_rank else {})

    @endpoint(D.shard())
    def apply(self, fn, batch: Batch) -> Batch:
        return Batch.from_dict({"out": fn(batch["x"])})

    @endpoint(D.shard())
    def gen(self, batch: Batch, pieces: int = 2):
        for piece in batch.chunk(pieces):
            yield Batch.from_dict({"x": piece["x"] + 100})

    @endpoint(D.shard())
    async def agen(self, batch: Batch):
        for piece in batch.chunk(2):
            await asyncio.sleep(0.01)
            yield Batch.from_dict({"x": piece["x"] + 200})

    @endpoint(D.shard() | D.stream())
    def per_part(self, batch: Batch) -> Batch:
        return Batch.from_dict({"y": batch["x"] * 2, "t": torch.full((len(batch),), time.time(), dtype=torch.float64)})

    @endpoint(D.shard() | D.stream())
    def log_part(self, batch: Batch) -> Batch:
        self.calls.append(f"part{int(batch['x'][0])}")
        return batch.select("x")

    @endpoint(D.broadcast())
    async def async_value(self, v: int) -> int:
        await asyncio.sleep(0.01)
        return v * 10 + self.rank

    @endpoint(D.broadcast())
    def fail_on(self, rank: int, seq: Sequencer, positions: list[list[int]]) -> int:
        """Every rank passes its Sequencer ``positions[rank]``; then rank ``rank`` raises, and the others return
        (so a rank is still running until the caller lets it through its positions)."""
        _pass(seq, positions[self.rank])
        if self.rank == rank:
            raise ValueError(f"boom on {self.rank}")
        return self.rank

    @endpoint(D.broadcast())
    def sleep(self, seconds: float) -> int:
        end = time.time() + seconds
        while time.time() < end and not self.cancelled():
            time.sleep(0.01)
        return self.rank

    @endpoint(D.broadcast())
    def hold(self, seq: Sequencer, positions: list[list[int]]) -> int:
        """Passes Sequencer ``positions[rank]`` in order: the call runs (its compute lane busy) between them."""
        _pass(seq, positions[self.rank])
        return self.rank

    @endpoint(D.broadcast())
    def hold_until_cancelled(self, seq: Sequencer | None = None, bound: float = 120.0) -> int:
        """Blocks until the controller cancels this call, then records ``"cancelled"`` (``take_outcomes``). With
        ``seq``, rank r first passes position r: the caller at position ``world_size`` knows every rank runs it.
        ``bound`` only ends a broken test: the call then records ``"not cancelled"``."""
        if seq is not None:
            _pass(seq, [self.rank])
        end = time.monotonic() + bound
        while not self.cancelled():
            if time.monotonic() > end:
                self.outcomes.append("not cancelled")
                return self.rank
            time.sleep(0.005)
        self.outcomes.append("cancelled")
        return self.rank

    @endpoint(D.broadcast())
    def take_outcomes(self) -> list[str]:
        """How the ``hold_until_cancelled`` calls that ran on this rank ended, since the last take."""
        out, self.outcomes = self.outcomes, []
        return out

    @endpoint(D.shard())
    def gen_in_turn(self, batch: Batch, seq: Sequencer, positions: list[int], pieces: int = 2):
        """Like ``gen``, but only the first piece is yielded at once: the others come after passing Sequencer
        position ``positions[rank]``, so the call is still producing until the caller lets it through."""
        for i, piece in enumerate(batch.chunk(pieces)):
            if i == 1:
                _pass(seq, [positions[self.rank]])
            yield Batch.from_dict({"x": piece["x"] + 100})

    @endpoint(D.broadcast())
    def die_on(self, rank: int, seq: Sequencer, positions: list[list[int]]) -> int:
        """Every rank passes its Sequencer ``positions[rank]``; then rank ``rank`` ends its process."""
        _pass(seq, positions[self.rank])
        if self.rank == rank:
            os._exit(1)
        return self.rank

    @endpoint(D.broadcast())
    def abort_on(self, rank: int) -> int:
        """Rank ``rank`` aborts its process (SIGABRT, as a native library's failed heap check or ``std::terminate``
        does); the others answer their rank."""
        if self.rank == rank:
            os.abort()
        return self.rank

    @endpoint(D.broadcast())
    def pid(self) -> int:
        return os.getpid()

    @endpoint(D.broadcast())
    def calls_seen(self) -> list:
        return list(self.calls)

    @endpoint(D.shard())
    def write_in_place(self, batch: Batch) -> Batch:
        return Batch.from_dict({"sum": batch["x"].sum().reshape(1).repeat(len(batch))})

    # -- for the Ray tests of test_core_integrity, test_core_lifecycle and test_core_replies, which run on the shared
    # Scorer groups (conftest ``scorers``) instead of starting groups of their own
    @endpoint(D.broadcast())
    def echo_all(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def total(self, batch: Batch) -> Batch:
        return Batch.from_dict({"t": batch["x"].sum().reshape(1).repeat(len(batch))})

    @endpoint(D.shard())
    def count_rows(self, batch: Batch) -> int:
        self.seen += 1
        return len(batch)

    @endpoint(D.broadcast())
    def seen_calls(self) -> int:
        return self.seen

    @endpoint(D.shard())
    def allreduce_rows(self, batch: Batch) -> Batch:
        """Every rank's row count, summed by a gloo all-reduce over the group's processes."""
        return _allreduce_rows(batch)

    @endpoint(D.shard())
    def gen_fail(self, batch: Batch):
        yield batch
        raise ValueError(f"generator failed on rank {self.rank}")

    @endpoint(D.broadcast())
    def rank_and(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @endpoint(D.broadcast())
    def rows_in_dict(self, n: int) -> dict:
        """A plain value holding a Batch of ``n`` float64 rows 0..n-1 (over 1 MiB from 131 073 rows)."""
        return {"b": Batch.from_dict({"x": torch.arange(n, dtype=torch.float64)}), "rank": self.rank}

    @endpoint(D.broadcast())
    def rows_and_ref_in_dict(self, n: int) -> dict:
        """``rows_in_dict``'s value, also holding an ObjectRef (which only Ray may carry)."""
        import ray
        return {"b": Batch.from_dict({"x": torch.arange(n, dtype=torch.float64)}), "rank": self.rank,
                "ref": ray.put(self.rank)}

    @endpoint(D.broadcast())
    def rows_in_dicts(self, n: int, k: int = 2):
        """A stream of ``k`` plain values, each holding a Batch of ``n`` float64 rows 0..n-1."""
        for _ in range(k):
            yield {"b": Batch.from_dict({"x": torch.arange(n, dtype=torch.float64)}), "rank": self.rank}

    @endpoint(D.broadcast())
    def scribble(self, values: list) -> list[float]:
        """Each rank's value from ``rows_in_dict`` as this rank got it: the sums it saw, then -1 written into it."""
        seen = [float(v["b"]["x"].sum()) for v in values]
        for v in values:
            v["b"]["x"][:] = -1
        return seen

    @endpoint(D.broadcast())
    def tensor_of(self, n: int) -> torch.Tensor:
        """A new tensor of ``n`` bytes (a plain value: it travels in the reply, and the controller can weakref it)."""
        return torch.full((n,), self.rank, dtype=torch.uint8)

    @endpoint(D.broadcast())
    def rows_with(self, what: str) -> Batch:
        """4 rows whose object column holds ``what`` the reply cannot carry: "lock" (cannot be pickled) or
        "rank_class" (an instance of a class made on the rank, which the controller cannot import by name)."""
        if what == "lock":
            objs = [threading.Lock() for _ in range(4)]
        else:
            import sys
            import types

            mod = types.ModuleType("made_on_the_rank")
            exec("class Local:\n    pass\n", mod.__dict__)
            sys.modules["made_on_the_rank"] = mod
            objs = [mod.Local() for _ in range(4)]
        return Batch.from_dict({"x": torch.arange(4), "obj": objs})

    @endpoint(D.broadcast())
    def fail_one_block_others(self) -> int:
        """Rank 0 fails at once; every other rank runs until the controller cancels the call."""
        if self.rank == 0:
            raise ValueError("rank 0 fails on purpose")
        while not self.cancelled():
            time.sleep(0.005)
        return self.rank


class MeshWorker(Worker):
    """Pretends to be DP=2 x TP=2: ranks (0,1) are replica 0, (2,3) replica 1; the first of each collects."""

    def __init__(self) -> None:
        self.register_mesh("actor", dp_rank=self.rank // 2, dp_size=2, is_collector=self.rank % 2 == 0)

    @endpoint(D.shard(mesh="actor"))
    def compute(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x": batch["x"], "dp": torch.full((len(batch),), self.rank // 2),
                                "rank": torch.full((len(batch),), self.rank)})

    @endpoint(D.shard(mesh="actor"))
    def tagged_rows(self, batch: Batch, tag: Counted) -> int:
        return len(batch) + 0 * tag.value

    @endpoint(D.shard(mesh="actor") | D.pad())
    def compute_padded(self, batch: Batch) -> Batch:
        return Batch.from_dict({"x": batch["x"], "n": torch.full((len(batch),), len(batch))})

    @endpoint(D.shard(mesh="nope"))
    def unregistered(self, batch: Batch) -> Batch:
        return batch


class Critic(Worker):
    def __init__(self, bias: float = 0.0) -> None:
        self.bias = bias

    @endpoint(D.shard())
    def values(self, batch: Batch) -> Batch:
        return Batch.from_dict({"v": batch["x"].double() + self.bias})

    @endpoint(D.broadcast())
    def pid(self) -> int:
        return os.getpid()


class Actor(Worker):
    def __init__(self, lr: float = 0.1) -> None:
        self.lr = lr

    @endpoint(D.broadcast())
    def pid(self) -> int:
        return os.getpid()

    @endpoint(D.broadcast())
    def get_lr(self) -> float:
        return self.lr


class BadInit(Worker):
    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("cannot build model on rank 1")


class Hazard(Worker):
    """Endpoints that do what careless user code does: write into inputs, change row counts, run collectives."""

    def __init__(self) -> None:
        self.seen = 0

    @endpoint(D.shard())
    def echo(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.broadcast())
    def echo_all(self, batch: Batch) -> Batch:
        return batch

    @endpoint(D.shard())
    def add1(self, batch: Batch) -> Batch:
        return Batch.from_dict({"a": batch["x"] + 1})

    @endpoint(D.shard(pad=True))
    def score(self, batch: Batch) -> Batch:
        return Batch.from_dict({"s": batch["x"] * 2})

    @endpoint(D.shard())
    def mutate(self, batch: Batch) -> Batch:
        batch["x"].add_(1000)  # careless: writes into its input
        return Batch.from_dict({"n": torch.full((len(batch),), len(batch))})

    @endpoint(D.shard())
    def total(self, batch: Batch) -> Batch:
        return Batch.from_dict({"t": batch["x"].sum().reshape(1).repeat(len(batch))})

    @endpoint(D.shard())
    def expand(self, batch: Batch, n: int) -> Batch:
        return batch.repeat(n)

    @endpoint(D.shard())
    def count(self, batch: Batch) -> int:
        self.seen += 1
        return len(batch)

    @endpoint(D.broadcast())
    def seen_calls(self) -> int:
        return self.seen

    @endpoint(D.shard())
    def allreduce_rows(self, batch: Batch) -> Batch:
        return _allreduce_rows(batch)

    @endpoint(D.shard())
    def gen_fail(self, batch: Batch):
        yield batch
        raise ValueError(f"generator failed on rank {self.rank}")

    @endpoint(D.broadcast())
    def sleep(self, seconds: float) -> int:
        end = time.time() + seconds
        while time.time() < end and not self.cancelled():
            time.sleep(0.01)
        return self.rank

    @endpoint(D.shard())
    def slow_gen(self, batch: Batch, pieces: int = 4, delay: float = 0.2):
        for piece in batch.chunk(pieces):
            end = time.time() + delay
            while time.time() < end and not self.cancelled():
                time.sleep(0.01)
            yield Batch.from_dict({"x": piece["x"]})

    @endpoint(D.shard())
    def gen_in_turn(self, batch: Batch, seq: Sequencer, positions: list[int], pieces: int = 4):
        """Yields its first piece at once and the others only after passing Sequencer position
        ``positions[rank]``: the stream is still being produced until the caller lets it through."""
        for i, piece in enumerate(batch.chunk(pieces)):
            if i == 1:
                _pass(seq, [positions[self.rank]])
            yield Batch.from_dict({"x": piece["x"]})

    @endpoint(D.shard() | D.stream())
    def per_part(self, batch: Batch) -> Batch:
        return Batch.from_dict({"y": batch["x"] * 2})

    @endpoint(D.broadcast())
    def mark(self, tag: str) -> str:
        self.seen += 1
        return tag
