"""Workers for the fast-path tests (importable by Ray worker processes)."""

from __future__ import annotations

import os
import time

import torch

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D


class Recorder(Worker):
    """Records every call it runs, in order, so a test can check each rank saw the group's calls in call order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    @endpoint
    def note(self, tag: str) -> tuple[int, str]:
        self.log.append(tag)
        return self.rank, tag

    @endpoint
    def history(self) -> list[str]:
        return list(self.log)

    @endpoint
    def policy(self) -> int:
        """The scheduling policy of the thread running this call (``os.SCHED_*``)."""
        return os.sched_getscheduler(0)

    @endpoint(D.shard())
    def double(self, b: Batch) -> Batch:
        self.log.append("double")
        return Batch.from_dict({"x": b["x"] * 2})

    @endpoint(D.shard(pad=True))
    def padded(self, b: Batch) -> Batch:
        return Batch.from_dict({"x": b["x"] + 100 * self.rank})

    @endpoint(D.broadcast())
    def make(self, n: int) -> Batch:
        self.log.append("make")
        return Batch.from_dict({"x": torch.arange(n)})

    @endpoint(D.broadcast())
    def rows(self, b: Batch | list[Batch]) -> int:
        """The sum of column x: of a Batch, or of every Batch of a list (a forwarded broadcast future arrives as
        the list its await gives)."""
        self.log.append("rows")
        return sum(int(x["x"].sum()) for x in (b if isinstance(b, list) else [b]))

    @endpoint(D.rank_zero())
    def big(self, n: int) -> Batch:
        return Batch.from_dict({"x": torch.arange(n, dtype=torch.float64)})

    @endpoint
    def big_value(self, n: int) -> list[float]:
        return [float(i) for i in range(n)]

    @endpoint
    def value(self) -> dict:
        return {"k": "orig", "lst": [1]}

    @endpoint
    def live_state(self, big: bool) -> dict:
        """This rank's state itself, not a copy: with a 2 MiB array (too large for a frame), or with an ObjectRef
        (only Ray may carry one); either way the fast path keeps the reply on the rank until the controller takes
        it (``Host.take_result``)."""
        import numpy as np
        import ray

        if not hasattr(self, "state"):
            self.state = {"step": 0, "arr": np.zeros(1 << 18), "ref": ray.put("held")}
        return {"step": self.state["step"], "arr": self.state["arr"]} if big else self.state

    @endpoint(D.broadcast() | D.only_ranks(0))
    def wait_for_file(self, path: str, bound: float = 60.0) -> str:
        """Rank 0 runs until ``path`` exists (a later call on rank 1 makes it), it is cancelled, or ``bound`` passes."""
        end = time.monotonic() + bound
        while not os.path.exists(path):
            if self.cancelled() or time.monotonic() > end:
                return "gave up"
            time.sleep(0.002)
        return "found"

    @endpoint(D.broadcast() | D.only_ranks(0))
    def on_rank_zero(self, v):  # noqa: ANN001, ANN201 - any value
        return v

    @endpoint(D.broadcast() | D.only_ranks(1))
    def make_file(self, path: str) -> str:
        with open(path, "w"):
            pass
        return "made"

    @endpoint
    def kept_here(self) -> int:
        """How many fast-path results this rank's host keeps for the controller or a reader to take (a test's look
        inside: ``Host._kept`` and the readers' entries ``Host.sessions`` holds)."""
        import gc

        return sum(len(o._kept) + o.sessions.waiting() for o in gc.get_objects()
                   if type(o).__name__ == "Host" and hasattr(o, "_kept"))

    @endpoint
    def bump_state(self) -> int:
        """Write the state in place, as a training step writes its weights."""
        self.state["step"] += 1
        self.state["arr"] += 1
        if hasattr(self, "rows_state"):
            self.rows_state["step"] += 1
        return self.state["step"]

    @endpoint
    def live_rows(self) -> Batch:
        """This rank's Batch itself, not a copy: under INLINE_BYTES by its ``nbytes`` (an object column counts 8
        bytes a row), so its rows ride inline in the reply, but 1.6 MB of text pickled: too large for a frame, so
        the fast path keeps the reply on the rank until the controller takes it."""
        if not hasattr(self, "rows_state"):
            self.rows_state = Batch.from_dict({"step": torch.zeros(4, dtype=torch.long),
                                               "text": ["a" * 400_000 for _ in range(4)]})
        self.rows_state["step"][:] = self.state["step"] if hasattr(self, "state") else 0
        return self.rows_state

    @endpoint
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.rank

    @endpoint
    def spin(self, seconds: float) -> str:
        """Run until cancelled (or ``seconds`` pass: a bound on a broken test)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.cancelled():
                self.log.append("spin cancelled")
                return "cancelled"
            time.sleep(0.001)
        self.log.append("spin ran out")
        return "ran out"

    @endpoint
    def hold(self, seq, positions: list[int]) -> int:  # noqa: ANN001 - a Sequencer
        """Wait for this rank's position of ``seq`` (``positions[rank]``): holds the rank until the test says."""
        with seq(positions[self.rank]):
            return self.rank

    @endpoint
    def stubborn(self, seconds: float) -> str:
        """Run for ``seconds`` whatever happens (cancellation is not looked at)."""
        time.sleep(seconds)
        return "done"

    @endpoint
    def echo(self, x):  # noqa: ANN001, ANN201 - any value
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def unpicklable(self):  # noqa: ANN201
        import threading

        return threading.Lock()

    @endpoint
    def worker_only_class(self):  # noqa: ANN201
        """An instance of a class made on the rank, which the controller cannot import by name."""
        import types

        mod = types.ModuleType("made_on_the_rank")
        exec("class Local:\n    pass\n", mod.__dict__)
        import sys

        sys.modules["made_on_the_rank"] = mod
        return mod.Local()

    @endpoint
    def fail_big(self, rank: int, n: int) -> int:
        if self.rank == rank:
            raise ValueError("y" * n)
        return self.rank

    @endpoint
    def kind(self, cfg) -> str:  # noqa: ANN001
        return type(cfg).__name__ + ":" + str(cfg.lr)

    @endpoint
    def refuse_connects(self, rank: int) -> bool:
        """On ``rank`` (-1: none), make this process's next Unix-socket connect fail, as for a rank that cannot reach
        the controller's socket: its next fast-path loop then ends before it joins. One connect only (the patch
        removes itself); any other rank, or ``rank=-1``, removes a patch still in place."""
        import socket

        if self.rank == rank:
            inherited = socket.socket.connect

            def refuse(sock, address):  # noqa: ANN001, ANN202
                if sock.family != socket.AF_UNIX:
                    return inherited(sock, address)
                del socket.socket.connect  # one-shot: the inherited connect again
                raise ConnectionRefusedError(f"rank {self.rank} refuses to connect to {address!r} (test)")

            socket.socket.connect = refuse
        elif "connect" in socket.socket.__dict__:
            del socket.socket.connect  # the inherited connect again
        return True
