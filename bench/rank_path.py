"""A rank's share of a fast-path call: the CPU its serve thread spends per call in a Ray rank, against the same
call path run hot in this process.

    python -m bench.rank_path [--ranks 4] [--calls 2000] [--rounds 3]

On a group of ``--ranks`` ranks (``bench.fast_path``'s Stepper), ``await g.step(batch)`` (16 rows sharded) and
``await g.noop()`` over the fast path's channel, ``--calls`` each per round. For each rank process, the CPU every
thread spent (``/proc/<pid>/task/*/stat``), per call: the busiest thread is the one serving the channel. Then the
frames the controller wrote to rank 0 for those two calls, captured, are run by a ``Host`` in this process
(``Host._run_frame`` and the reply's pickling, what the serve thread does per call less its socket reads and writes),
``--calls`` times in a row: hot, each call's code and data still in the caches of the core that runs it.

Prints JSON: per call, ``hot_us``, ``cold_us`` (the same path with 32 MiB written between two calls, so that each
call finds the caches full of other data, as a woken rank does: close to ``serve_thread_us``, without Ray) and
``python_calls`` (in this process; the count of Python calls, C functions included, does not move between runs of
the same code), ``serve_thread_us`` and ``rank_process_us`` (in the Ray ranks,
averaged over the ranks; medians over the rounds) and ``serve_over_hot``. On 2 cores shared by the controller and
4 ranks every call wakes 5 processes, so each rank runs its part of a call cold; the ratio says what that costs.
The clock ticks are 10 ms: over 2000 calls a figure moves in steps of 5 µs. Then ``--calls`` more of each with a
thread-CPU timer around each section of the path in every rank (``sections_us``, µs per call averaged over the
ranks: ``run_frame`` is the whole path less the socket and the reply's outer pickle; the others are parts of it).
And the controller's side: on a second group, made with a timer around each of its sections
(``controller_sections_us``: the event-loop thread's CPU per call, ``thread_us``, and the sections' shares of it;
a repeated step's frames come from its frame template, ``template_frames``, of which ``column_read`` reads the
batch's columns); then on a third, the same with every column read through ``numpy()`` instead of from its memory
(``controller_sections_us_numpy_read``: the baseline of that read, in the same run).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pickle
import pstats
import statistics
import time
from typing import Any

import numpy as np
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup, _batch, _channel, _invocation, _template
from orchestra._host import Host

from ._common import emit
from .fast_path import Stepper


def _threads_cpu(pid: int) -> dict[str, int]:
    """CPU ticks (user + system) of every thread of process ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        fields = s[s.rindex(")") + 2:].split()
        out[tid] = int(fields[11]) + int(fields[12])
    return out


class _Capture:
    """The frames a group's channel writes to rank 0, while in use (``Channel._write`` wrapped)."""

    def __enter__(self) -> list[bytes]:
        self.frames: list[bytes] = []
        self._write = _channel.Channel._write
        frames, write = self.frames, self._write

        def capture(channel: Any, rank: int, call_id: str, frame: bytes) -> None:
            if rank == 0:
                frames.append(frame)
            write(channel, rank, call_id, frame)
        _channel.Channel._write = capture
        return self.frames

    def __exit__(self, *exc: Any) -> None:
        _channel.Channel._write = self._write


class _HotRuntime:
    """What a Host asks of its process, for a Host run in this one (no Ray: it stores nothing)."""

    own_process = True

    def task_id(self) -> None:
        return None

    def runtime_cancelled(self) -> bool:
        return False

    def put(self, obj: Any) -> Any:
        raise RuntimeError("bench.rank_path: a small call's result is never stored")

    def node_ip(self) -> str:
        return "127.0.0.1"

    def log_path(self) -> None:
        return None

    def placement(self) -> tuple[list[Any], None]:
        return [], None


COLD_BYTES = 32 << 20  # touched between two cold calls: more than this machine's caches hold


def _hot(frame: bytes, role: str, calls: int) -> tuple[float, float, float]:
    """CPU µs per call of the call path run ``calls`` times in a row here; the same with every cache line of
    ``COLD_BYTES`` written between two calls (cold: what a rank woken by each call on a busy machine pays, measured
    without Ray, so that a change to the path can be compared in one process), median of 3 batches of
    ``calls // 2``; and the Python calls it makes per call (cProfile's count, C functions included: the same in
    every run of the same code)."""
    host = Host("rank_path", 0, 1, 0, {}, runtime=_HotRuntime())
    host.setup({}, {role: (Stepper, (), {})})

    def run(n: int) -> None:
        for _ in range(n):
            call_id, kind, payload, _value = host._run_frame(frame)
            pickle.dumps((call_id, kind, payload), protocol=pickle.HIGHEST_PROTOCOL)

    run(200)
    t0 = time.thread_time()
    run(calls)
    us = (time.thread_time() - t0) / calls * 1e6
    junk = np.ones(COLD_BYTES, dtype=np.uint8)
    batches = []
    for _ in range(3):
        spent = 0.0
        for _ in range(max(calls // 2, 1)):
            junk[::64] += 1  # one write in every 64-byte line
            t0 = time.thread_time()
            run(1)
            spent += time.thread_time() - t0
        batches.append(spent / max(calls // 2, 1) * 1e6)
    prof = cProfile.Profile()
    prof.enable()
    run(100)
    prof.disable()
    return us, statistics.median(batches), pstats.Stats(prof).total_calls / 100


_SECTIONS = ("run_frame", "loads_frame", "resolve", "endpoint", "dumps_frame", "fast_done")


def _install_timers(host: Host) -> bool:
    """In a rank: a thread-CPU timer around each section of a fast call's path (``_SECTIONS``): the call path
    (``Host._run_frame``: everything but the socket reads and writes and the reply's outer pickle), the frame's
    unpickling, the arguments' resolution, the endpoint, the reply's pickling, and the session's bookkeeping. Each
    timer costs about a microsecond of its own."""
    from orchestra import _frame

    acc = host.__dict__.setdefault("_bench_sections", {})

    def timed(name: str, fn: Any) -> Any:
        acc[name] = [0.0, 0]

        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                slot = acc[name]
                slot[0] += time.thread_time() - t0
                slot[1] += 1
        return run

    host._run_frame = timed("run_frame", host._run_frame)
    host._resolve = timed("resolve", host._resolve)
    host._fast_done = timed("fast_done", host._fast_done)
    _frame.loads_frame = timed("loads_frame", _frame.loads_frame)
    _frame.dumps_frame = timed("dumps_frame", _frame.dumps_frame)
    for role in host.roles.values():
        for name in ("step", "noop"):
            setattr(role, name, timed("endpoint", getattr(role, name)))
    return True


def _take_timers(host: Host) -> dict[str, float]:
    """Per call of the calls since the last take: each section's thread CPU, µs (``_install_timers``)."""
    acc = host._bench_sections
    calls = acc["run_frame"][1] or 1
    out = {name: acc[name][0] / calls * 1e6 for name in _SECTIONS}
    for slot in acc.values():
        slot[0], slot[1] = 0.0, 0
    return out


_CONTROLLER_SECTIONS = (
    # (name, owner, attribute): the controller's side of a fast call, in its event-loop thread
    ("split_and_describe", _invocation, "_describe_batch"),  # a shard call's batch cut into parts, described
    ("frames", _invocation, "_encode"),  # every rank's frame pickled (these two: a call made without a template)
    ("template_frames", _template.FrameTemplate, "frames"),  # every rank's frame written from its frame template
    ("column_read", _template, "_column_bytes"),  # (part of template_frames) the batch's columns read as bytes
    ("socket_writes", _channel.Channel, "_write"),  # each rank's frame written to its socket
    ("replies", _channel._Conn, "_on_read"),  # each reply read, unpickled and handed to its call
    ("completions", _invocation.Invocation, "_check_done"),  # the call's bookkeeping as its ranks finish
)


class _ControllerTimers:
    """While in use: a thread-CPU timer around each of ``_CONTROLLER_SECTIONS`` (for a group made meanwhile: a
    socket's reader is bound when its channel opens). Each timer costs about a microsecond of its own."""

    def __enter__(self) -> dict[str, list[float]]:
        self.acc: dict[str, list[float]] = {}
        self.saved = []
        for name, owner, attr in _CONTROLLER_SECTIONS:
            fn = getattr(owner, attr)
            self.saved.append((owner, attr, fn))
            self.acc[name] = [0.0, 0]

            def run(*args: Any, _fn: Any = fn, _slot: list[float] = self.acc[name], **kwargs: Any) -> Any:
                t0 = time.thread_time()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    _slot[0] += time.thread_time() - t0
                    _slot[1] += 1
            setattr(owner, attr, run)
        return self.acc

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, fn in self.saved:
            setattr(owner, attr, fn)


def _no_memory_read(t: Any, limit: int) -> None:
    """``_batch._memory_of`` that never reads a column's memory: every column goes through ``numpy()``, as before
    2026-12-07 (the baseline of ``read_memory=False``)."""
    return None


async def _controller_sections(ranks: int, calls: int, read_memory: bool = True) -> dict[str, dict[str, float]]:
    """Per call, the event-loop thread's CPU and each section's (µs), on a group made with the timers in place;
    ``read_memory=False``: with columns read through ``numpy()`` instead of from their memory (``_no_memory_read``)."""
    saved = _batch._memory_of, _template._memory_of
    if not read_memory:
        _batch._memory_of = _template._memory_of = _no_memory_read
    try:
        return await _timed_controller(ranks, calls)
    finally:
        _batch._memory_of, _template._memory_of = saved


async def _timed_controller(ranks: int, calls: int) -> dict[str, dict[str, float]]:
    out = {}
    with _ControllerTimers() as acc:
        async with WorkerGroup(ResourcePool(process_on_nodes=[ranks], cpus_per_worker=0.01), Stepper,
                               group_name="rank_path_controller") as g:
            batch = Batch.from_dict({"x": torch.arange(16)})
            for name, fn in {"step": lambda: g.step(batch), "noop": g.noop}.items():
                for _ in range(60):
                    await fn()
                assert g._shared.channel is not None and g._shared.channel.open, "the channel did not open"
                for slot in acc.values():
                    slot[0], slot[1] = 0.0, 0
                t0 = time.thread_time()
                for _ in range(calls):
                    await fn()
                total = time.thread_time() - t0
                out[name] = {"thread_us": round(total / calls * 1e6, 1),
                             **{k: round(v[0] / calls * 1e6, 1) for k, v in acc.items()}}
    return out


async def measure(ranks: int, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    tick = os.sysconf("SC_CLK_TCK")
    serve: dict[str, list[float]] = {"step": [], "noop": []}
    process: dict[str, list[float]] = {"step": [], "noop": []}
    sections: dict[str, dict[str, float]] = {}
    async with WorkerGroup(ResourcePool(process_on_nodes=[ranks], cpus_per_worker=0.01), Stepper,
                           group_name="rank_path") as g:
        batch = Batch.from_dict({"x": torch.arange(16)})
        pids = [await h.__ray_call__.remote(lambda _h: os.getpid()) for h in g._shared.hosts]
        cases = {"step": lambda: g.step(batch), "noop": g.noop}
        for _ in range(60):
            await g.step(batch)
        assert g._shared.channel is not None and g._shared.channel.open, "the channel did not open"
        with _Capture() as frames:
            await g.step(batch)
            await g.noop()
        captured = dict(zip(("step", "noop"), frames))
        for _ in range(rounds):
            for name, fn in cases.items():
                before = [_threads_cpu(p) for p in pids]
                for _ in range(calls):
                    await fn()
                after = [_threads_cpu(p) for p in pids]
                busiest, total = [], []
                for b, a in zip(before, after):
                    deltas = [t - b.get(tid, 0) for tid, t in a.items()]
                    busiest.append(max(deltas))
                    total.append(sum(deltas))
                serve[name].append(statistics.fmean(busiest) / tick / calls * 1e6)
                process[name].append(statistics.fmean(total) / tick / calls * 1e6)
        for h in g._shared.hosts:  # then the same calls again, with a timer around each section of the path
            await h.__ray_call__.remote(_install_timers)
        for name, fn in cases.items():
            for h in g._shared.hosts:
                await h.__ray_call__.remote(_take_timers)
            for _ in range(calls):
                await fn()
            taken = [await h.__ray_call__.remote(_take_timers) for h in g._shared.hosts]
            sections[name] = {k: round(statistics.fmean(t[k] for t in taken), 1) for k in _SECTIONS}
    role = pickle.loads(captured["step"])[1]
    out = {}
    for name in cases:
        hot, cold, python_calls = _hot(captured[name], role, calls)
        s = statistics.median(serve[name])
        out[name] = {"hot_us": round(hot, 1), "cold_us": round(cold, 1), "python_calls": round(python_calls, 1),
                     "serve_thread_us": round(s, 1),
                     "rank_process_us": round(statistics.median(process[name]), 1),
                     "serve_over_hot": round(s / hot, 2), "sections_us": sections[name]}
    controller = await _controller_sections(ranks, calls)
    numpy_read = await _controller_sections(ranks, calls, read_memory=False)
    for name in cases:
        out[name]["controller_sections_us"] = controller[name]
        out[name]["controller_sections_us_numpy_read"] = numpy_read[name]
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    orc.init(num_cpus=64)
    try:
        results = await measure(a.ranks, a.calls, a.rounds)
    finally:
        orc.shutdown()
    emit({"bench": "rank_path", "ranks": a.ranks, "calls": a.calls, "rounds": a.rounds, "results": results})


if __name__ == "__main__":
    orc.run(main())
