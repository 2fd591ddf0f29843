"""The fast path for repeated small calls (orchestra._channel) vs the general path and raw Ray, on the same machine.

    python -m bench.fast_path [--ranks 4] [--iters 300] [--rounds 3] [--remote]

Three groups of the same Worker, ``--ranks`` ranks each: one whose repeated calls take the fast path (a persistent
socket per rank), one with the fast path off (its raw handles were taken: the general path, one Ray actor task per
rank), and raw Ray on that second group's actors: a synchronous ``ray.get`` of N bare actor calls (``Host.noop``,
given each rank's arguments), which is what verl's blocking controller does (~1.05x of it here).

Calls: ``await g.noop()`` (broadcast, no argument), ``await g.step(batch)`` (16 rows sharded over the ranks,
each rank returns a dict of two floats, collected into a list) — a training loop's repeated call — and ``await
g.read(g.make())`` (``chain``: a DataFuture argument; each rank makes a 4-row Batch, and every rank reads all of
them). The chain's raw baselines run on N plain Ray actors of the same two methods (``_Bare``): ``raw_sync``, two
blocking ``ray.get`` rounds, the second given the Batches the first returned (a blocking controller's chain);
``raw_nested``, the second round sent before the first is fetched, each reader fetching the first round's replies
itself (what orchestra's general path does for a reader it sends at once: the Ray-level floor of that design);
``rawnone_sync``, the baseline before 2026-12-04 (the first round returned None, on ``Host.noop``, so it skipped
making and returning the Batches; kept to compare with earlier runs). ``chains_to_open``: how many
chains a loop of nothing else makes before its channel opens (None: not within 100). The three are
interleaved in ``--rounds`` rounds; medians over every sample. ``*_cpu_ms``: the controller's CPU ms per call (all
its threads); ``*_rank_cpu_ms``: each rank process's CPU ms per call (``/proc/<pid>/stat``, averaged over the
ranks). ``open_ms``: the call that opens a channel (after a call that released it), median of 20.
``step_*_templated``: how many of the step samples' calls had their frames written into a frame template
(orchestra._template) rather than pickled: every one, once a group has seen two steps.
Target (issue "core speed"): the fast step on 4 ranks <= 0.5 ms median, >= 3x faster than verl (~raw sync).

``--remote``: the ranks run on another Ray node than the controller's (a ``ray.cluster_utils.Cluster`` of a head
that places nothing and one worker node, both processes on this machine), so the fast path's ranks join over TCP
(on the address Ray uses for the controller's node) instead of a Unix socket; the socket floor's processes stay
local (Unix sockets). On one machine this measures TCP loopback and the cross-node call path, not a network.

``*_socket_floor``: the same calls made the least a controller on an asyncio loop can do them — N plain processes
(``multiprocessing``), one Unix socket each, one pickled frame each way per rank, the step's own work on the rank, and
nothing else (no validation, stats, call order, cancellation, deadlines or errors). On a machine with fewer cores
than ranks + 1 this floor is set by scheduling (every call wakes N + 1 processes); ``*_fast_over_socket_floor_ms``
is what the fast path adds to it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import struct
import time

import ray
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

from ._common import emit


class Stepper(Worker):
    @endpoint(D.broadcast())
    def noop(self) -> None:
        return None

    @endpoint(D.shard())
    def step(self, batch: Batch) -> dict:
        return {"loss": float(batch["x"].float().mean()), "rows": float(len(batch))}

    @endpoint(D.broadcast())
    def make(self) -> Batch:
        return Batch.from_dict({"x": torch.arange(4)})

    @endpoint(D.broadcast())
    def read(self, b: Batch) -> int:
        return len(b)


@ray.remote(num_cpus=0.01)
class _Bare:
    """A plain Ray actor with the chain's two methods, for its raw baselines."""

    def make(self) -> Batch:
        return Batch.from_dict({"x": torch.arange(4)})

    def read(self, b: list) -> int:
        return len(b)

    def read_nested(self, box: list) -> int:
        return len(ray.get(box[0]))  # the refs of the first round's replies, fetched by the reader itself

    def pid(self) -> int:
        return os.getpid()


def _raw_chain(bare: list) -> list:
    """A blocking controller's chain: every rank's first call, fetched, then the second call given what they made (a
    broadcast reader gets the list of every rank's 4-row Batch)."""
    made = ray.get([a.make.remote() for a in bare])
    return ray.get([a.read.remote(made) for a in bare])


def _raw_nested_chain(bare: list) -> list:
    """The chain sent at once: the readers get the first round's reply refs (nested, so each fetches them itself)
    before those replies are in; the controller fetches the first round too, as an async controller does."""
    made = [a.make.remote() for a in bare]
    out = [a.read_nested.remote([made]) for a in bare]
    ray.get(made)
    return ray.get(out)


def _rawnone_chain(actors: list, made: list[Batch]) -> list:
    """The chain's baseline before 2026-12-04: its first round returned None (``Host.noop``), not the Batches."""
    ray.get([a.noop.remote() for a in actors])
    return ray.get([a.noop.remote(made) for a in actors])


_LEN = struct.Struct("!I")


def _floor_rank(sock: socket.socket) -> None:
    """One rank of the floor: read a frame, run the step's work on it, write the reply; until the socket ends."""
    import torch as _torch

    while True:
        head = sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            return
        body = sock.recv(_LEN.unpack(head)[0], socket.MSG_WAITALL)
        arr = pickle.loads(body)
        if arr is None:
            out = pickle.dumps(None)
        else:
            x = _torch.from_numpy(arr)
            out = pickle.dumps({"loss": float(x.float().mean()), "rows": float(len(x))})
        sock.sendall(_LEN.pack(len(out)) + out)


class _Floor:
    """The least a controller on an asyncio loop can do for one call to N processes over Unix sockets: one
    pickled frame each way per rank and the step's own work; no validation, stats, ordering, cancellation,
    deadlines or errors. What the fast path's per-call overhead is measured against."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        pairs = [socket.socketpair() for _ in range(n)]
        self.procs = [ctx.Process(target=_floor_rank, args=(b,), daemon=True) for _, b in pairs]
        for p in self.procs:
            p.start()
        for _, b in pairs:
            b.close()
        self.socks = [a for a, _ in pairs]
        self.loop = asyncio.get_running_loop()
        self.bufs = [bytearray() for _ in range(n)]
        self.waiting: list[asyncio.Future | None] = [None] * n
        for i, sk in enumerate(self.socks):
            sk.setblocking(False)
            self.loop.add_reader(sk.fileno(), self._read, i)

    def _read(self, i: int) -> None:
        data = self.socks[i].recv(1 << 16)
        if not data:  # the rank's process went away: stop watching its socket, fail a call waiting on it
            self.loop.remove_reader(self.socks[i].fileno())
            f = self.waiting[i]
            if f is not None and not f.done():
                f.set_exception(ConnectionError(f"floor rank {i} closed its socket"))
            return
        buf = self.bufs[i]
        buf += data
        while len(buf) >= 4:
            (k,) = _LEN.unpack_from(buf)
            if len(buf) < 4 + k:
                break
            value = pickle.loads(bytes(buf[4:4 + k]))
            del buf[:4 + k]
            self.waiting[i].set_result(value)

    async def call(self, payloads: list) -> list:
        futs = []
        for i, arr in enumerate(payloads):
            f = self.waiting[i] = self.loop.create_future()
            frame = pickle.dumps(arr, protocol=pickle.HIGHEST_PROTOCOL)
            self.socks[i].send(_LEN.pack(len(frame)) + frame)
            futs.append(f)
        return await asyncio.gather(*futs)

    async def noop(self) -> list:
        return await self.call([None] * len(self.socks))

    async def step(self, batch: Batch) -> list:
        # tensor_split: the same balanced pieces as the call's shard (larger ones first)
        return await self.call([t.numpy() for t in torch.tensor_split(batch["x"], len(self.socks))])

    def close(self) -> None:
        for sk in self.socks:
            self.loop.remove_reader(sk.fileno())  # False (no error) for one already removed at its end
            sk.close()
        for p in self.procs:
            p.join(timeout=30)


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (``/proc/<pid>/stat``)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def _sample(fn, iters: int, is_async: bool, wall: list[float], cpu: list[float], pids: list[int],
                  rank_cpu: list[float]) -> None:
    c0, r0 = time.process_time(), _cpu_s(pids)
    for _ in range(iters):
        t0 = time.perf_counter()
        if is_async:
            await fn()
        else:
            fn()
        wall.append((time.perf_counter() - t0) * 1e3)
    cpu.append((time.process_time() - c0) / iters * 1e3)
    rank_cpu.append((_cpu_s(pids) - r0) / iters / len(pids) * 1e3)


async def measure(n: int, iters: int, rounds: int, remote: bool = False) -> dict:
    pool_a = ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01)
    pool_b = ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01)
    async with WorkerGroup(pool_a, Stepper, group_name="fast") as fast, \
            WorkerGroup(pool_b, Stepper, group_name="general") as general:
        actors = general.actors  # raw handles: this group's fast path is off (never set back on here)
        batch = Batch.from_dict({"x": torch.arange(16)})
        shards = batch.chunk(n)
        made = [Batch.from_dict({"x": torch.arange(4)}) for _ in range(n)]  # what make() gives read() on each rank
        bare = [_Bare.remote() for _ in range(n)]
        bare_pids = ray.get([a.pid.remote() for a in bare])
        assert _raw_chain(bare) == _raw_nested_chain(bare) == [n] * n
        for _ in range(10):  # warm up both paths (the fast group opens its channel here)
            await fast.step(batch)
            await general.step(batch)
        assert fast._shared.channel is not None and general._shared.channel is None
        here = ray.get_runtime_context().get_node_id()
        off_node = [d["node_id"] != here for d in await fast.describe()]
        assert all(off_node) if remote else not any(off_node)
        assert (fast._shared.channel.tcp_address is not None) == remote  # ranks off the node join over TCP
        floor = _Floor(n)
        for _ in range(10):
            assert (await floor.step(batch)) == [{"loss": float(s["x"].float().mean()), "rows": float(len(s))}
                                                 for s in shards]

        cases = {
            "noop_fast": (lambda: fast.noop(), True),
            "noop_general": (lambda: general.noop(), True),
            "noop_raw_sync": (lambda: ray.get([a.noop.remote() for a in actors]), False),
            "step_fast": (lambda: fast.step(batch), True),
            "step_general": (lambda: general.step(batch), True),
            "step_raw_sync": (lambda: ray.get([a.noop.remote(s) for a, s in zip(actors, shards)]), False),
            "chain_fast": (lambda: fast.read(fast.make()), True),
            "chain_general": (lambda: general.read(general.make()), True),
            "chain_raw_sync": (lambda: _raw_chain(bare), False),
            "chain_raw_nested": (lambda: _raw_nested_chain(bare), False),
            "chain_rawnone_sync": (lambda: _rawnone_chain(actors, made), False),
            "noop_socket_floor": (lambda: floor.noop(), True),
            "step_socket_floor": (lambda: floor.step(batch), True),
        }
        pids = {"fast": [d["pid"] for d in await fast.describe()],
                "general": [d["pid"] for d in await general.describe()],
                "raw_sync": [d["pid"] for d in await general.describe()],
                "chain_raw_sync": bare_pids, "raw_nested": bare_pids,
                "rawnone_sync": [d["pid"] for d in await general.describe()],
                "socket_floor": [p.pid for p in floor.procs]}
        assert await fast.read(fast.make()) == [4] * n and fast._shared.channel is not None  # a chain stays on it
        wall: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        rank_cpu: dict[str, list[float]] = {k: [] for k in cases}
        calls_before = fast._shared.fast_calls
        templated_before = (fast._shared.templates.used, general._shared.templates.used)
        for _ in range(rounds):
            for k, (fn, is_async) in cases.items():
                await _sample(fn, iters, is_async, wall[k], cpu[k], pids.get(k) or pids[k.split("_", 1)[1]],
                              rank_cpu[k])
        fast_calls = fast._shared.fast_calls - calls_before
        templated = (fast._shared.templates.used - templated_before[0],
                     general._shared.templates.used - templated_before[1])
        floor.close()

        opens = []
        for _ in range(20):
            fast.fast_path = False  # releases the channel (as any call that needs Ray does)
            fast.fast_path = True
            for _ in range(3):  # ORCHESTRA_FAST_PATH_AFTER - 1 eligible calls go through Ray
                await fast.step(batch)
            t0 = time.perf_counter()
            await fast.step(batch)  # this one opens a channel
            opens.append((time.perf_counter() - t0) * 1e3)
            assert fast._shared.channel is not None

        fast.fast_path = False  # a loop of nothing but chains, from a released channel: how many until it opens
        fast.fast_path = True
        chains_to_open = 0
        while fast._shared.channel is None and chains_to_open < 100:
            await fast.read(fast.make())
            chains_to_open += 1
        opened = fast._shared.channel is not None

    out: dict = {"ranks": n, "ranks_on_another_node": remote, "fast_path_socket": "tcp" if remote else "unix",
                 "iters_per_round": iters, "rounds": rounds,
                 "fast_calls_in_fast_cases": fast_calls, "expected_fast_calls": 4 * iters * rounds,
                 "step_fast_templated": templated[0], "step_general_templated": templated[1],
                 "chains_to_open": chains_to_open if opened else None}
    for k in cases:
        out[f"{k}_ms"] = round(statistics.median(wall[k]), 4)
        out[f"{k}_cpu_ms"] = round(statistics.median(cpu[k]), 4)
        out[f"{k}_rank_cpu_ms"] = round(statistics.median(rank_cpu[k]), 4)
    out["chain_general_over_raw_sync"] = round(out["chain_general_ms"] / out["chain_raw_sync_ms"], 2)
    out["chain_general_over_raw_nested"] = round(out["chain_general_ms"] / out["chain_raw_nested_ms"], 2)
    for c in ("noop", "step", "chain"):
        out[f"{c}_fast_vs_raw_sync"] = round(out[f"{c}_raw_sync_ms"] / out[f"{c}_fast_ms"], 2)
        out[f"{c}_fast_vs_general"] = round(out[f"{c}_general_ms"] / out[f"{c}_fast_ms"], 2)
        if c != "chain":
            out[f"{c}_fast_over_socket_floor_ms"] = round(out[f"{c}_fast_ms"] - out[f"{c}_socket_floor_ms"], 4)
    out["open_ms"] = round(statistics.median(opens), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--remote", action="store_true",
                    help="run the ranks on another Ray node than the controller's (ray.cluster_utils.Cluster: a head "
                         "that places nothing and one worker node, both on this machine): the fast path's ranks "
                         "then join over TCP")
    a = ap.parse_args()
    if a.remote:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        cluster.add_node(num_cpus=64)
        cluster.wait_for_nodes()
        try:
            with orc.init(address=cluster.address):
                res = asyncio.run(measure(a.ranks, a.iters, a.rounds, remote=True))
        finally:
            cluster.shutdown()
    else:
        with orc.init(num_cpus=64):
            res = asyncio.run(measure(a.ranks, a.iters, a.rounds))
    res["target_step_fast_ms"] = 0.5
    res["target_met"] = res["step_fast_ms"] <= 0.5
    emit(res)


if __name__ == "__main__":
    main()
