"""Tracer: a timeline of what every rank did, as Chrome trace JSON (open it in https://ui.perfetto.dev).

Each call on each rank is a span on that rank's track; each part a consumer fetched from a producer is a flow
arrow from the producer's span to the consumer's, labelled with its bytes. Controller-side phases are spans on a
"controller" track.

Recording is on only between ``await tracer.start()`` and ``await tracer.stop()`` (or the end of the run, or of an
``async with Tracer(...)`` block); ``await tracer.collect()`` pulls the spans before ``save``. A trace saved without
recording ever started is refused rather than written empty. Several tracers may record the same group (nested
blocks): the ranks record while any of them does, and each gets every span that started while it recorded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from ._errors import OrchestraError

__all__ = ["Tracer"]

log = logging.getLogger("orchestra")


class _Hub:
    """The tracers recording one group (its colocated views share it): the ranks record while any tracer is active;
    spans taken from the ranks go to every active tracer that was recording when the span started."""

    def __init__(self) -> None:
        self.active: dict[int, tuple[Tracer, float]] = {}  # id(tracer) -> (tracer, when it started recording)
        self.inbox: dict[int, list[tuple[int, dict[str, Any]]]] = {}  # id(tracer) -> (rank, span) not yet collected

    async def enter(self, tracer: Tracer, group: Any) -> None:
        if id(tracer) in self.active:
            return
        if not self.active:
            await group.set_tracing(True)
        self.active[id(tracer)] = (tracer, time.time())
        self.inbox.setdefault(id(tracer), [])

    async def drain(self, group: Any) -> None:
        """Take what the ranks recorded and hand each span to the tracers that were recording when it started."""
        for rank, (_pid, spans) in enumerate(await group.take_events()):
            for sp in spans:
                for key, (_t, since) in self.active.items():
                    if sp["start"] >= since:
                        self.inbox[key].append((rank, sp))

    def take(self, tracer: Tracer) -> list[tuple[int, dict[str, Any]]]:
        got, self.inbox[id(tracer)] = self.inbox.get(id(tracer), []), []
        return got

    async def leave(self, tracer: Tracer, group: Any) -> None:
        if self.active.pop(id(tracer), None) is None:
            return
        self.inbox.pop(id(tracer), None)
        if not self.active:
            await group.set_tracing(False)


_HUBS: weakref.WeakKeyDictionary[Any, _Hub] = weakref.WeakKeyDictionary()


def _hub(group: Any) -> _Hub:
    return _HUBS.setdefault(group._shared, _Hub())


class Tracer:
    """Collects spans from worker groups and the controller; ``save`` writes Chrome trace JSON.

    ``async with Tracer(*groups) as tracer:`` records the calls made in the block and collects them at its end;
    or ``await tracer.start()`` before the calls and ``await tracer.collect()`` before ``save``."""

    def __init__(self, *groups: Any) -> None:
        self._groups: list[Any] = []
        seen = set()
        for g in groups:
            if id(g._shared) not in seen:  # colocated views share their actors: trace them once
                seen.add(id(g._shared))
                self._groups.append(g)
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[tuple[str, int], int] = {}
        self._lanes: dict[str | None, list[list[tuple[int, int]]]] = {}  # controller track -> its lanes' spans
        self._tids: dict[tuple[str | None, int], int] = {(None, 0): 0}
        self._produced: dict[str, tuple[int, float]] = {}
        self._flow = 0
        self._started = False
        self._meta("controller", 0)

    def _track(self, group: str, rank: int) -> int:
        key = (group, rank)
        if key not in self._tracks:
            self._meta(f"{group} rank {rank}", len(self._tracks) + 1)
        return self._tracks.setdefault(key, len(self._tracks) + 1)

    def _meta(self, name: str, pid: int) -> None:
        self._events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        self._events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                             "args": {"sort_index": pid}})

    async def start(self) -> None:
        """Turn span recording on in every traced group (it stays on while any tracer of the group records)."""
        for g in self._groups:
            await _hub(g).enter(self, g)
        self._started = True

    async def stop(self) -> None:
        """Stop recording for this tracer; a group's ranks stop recording once no tracer of it records. Call
        ``collect()`` first to keep what was recorded."""
        for g in self._groups:
            await _hub(g).leave(self, g)

    async def __aenter__(self) -> Tracer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Collect what the block's calls recorded and stop recording. After a failure too (the trace of a failed
        block is what one looks at), but then a group that cannot answer (a dead rank, a closed group) is logged
        and skipped, and the block's own error goes on."""
        if exc_type is None:
            await self.collect()
            await self.stop()
            return
        for g in self._groups:
            try:
                await self._collect_group(g)
            except Exception as e:  # noqa: BLE001 - the block's own error is the one raised; this one is logged
                log.warning("Tracer: spans of group %r could not be collected after the block failed: %s",
                            g._shared.name, e)
            try:
                await _hub(g).leave(self, g)
            except Exception as e:  # noqa: BLE001 - as above
                log.warning("Tracer: recording could not be turned off in group %r after the block failed: %s",
                            g._shared.name, e)

    async def collect(self) -> int:
        """Pull the spans recorded since the last collect from every rank; returns how many were added."""
        added = 0
        for g in self._groups:
            added += await self._collect_group(g)
        return added

    async def _collect_group(self, g: Any) -> int:
        hub = _hub(g)
        if id(self) in hub.active:
            await hub.drain(g)
        name = g._shared.name
        got = hub.take(self)
        for rank, sp in sorted(got, key=lambda rs: rs[1]["start"]):
            self._add_span(self._track(name, rank), sp)
        return len(got)

    def _add_span(self, pid: int, sp: dict[str, Any]) -> None:
        start, end = _us(sp["start"]), _us(sp["end"])
        role = sp["role"]
        name = sp["endpoint"] if role == "" else f"{role}.{sp['endpoint']}"
        bytes_in = sum(b for _, b in sp["fetched"])
        bytes_out = sum(b for _, b, _ in sp["produced"])
        rows_out = sum(r for _, _, r in sp["produced"])
        self._events.append({"name": name, "cat": role, "ph": "X", "pid": pid, "tid": 0, "ts": start,
                             "dur": max(1, end - start),
                             "args": {"parts_in": len(sp["fetched"]), "bytes_in": bytes_in,
                                      "parts_out": len(sp["produced"]), "bytes_out": bytes_out, "rows_out": rows_out}})
        for part, nbytes in sp["fetched"]:
            src = self._produced.get(part)
            if src is None:
                continue
            self._flow += 1
            label = f"part {_size(nbytes)}"
            self._events.append({"name": label, "cat": "part", "ph": "s", "id": self._flow, "pid": src[0],
                                 "tid": 0, "ts": src[1] - 1, "args": {"bytes": nbytes}})
            self._events.append({"name": label, "cat": "part", "ph": "f", "bp": "e", "id": self._flow, "pid": pid,
                                 "tid": 0, "ts": start + 1, "args": {"bytes": nbytes}})
        for part, _nbytes, _rows in sp["produced"]:
            self._produced[part] = (pid, end)

    @contextlib.contextmanager
    def span(self, name: str, track: str | None = None, **args: Any) -> Iterator[None]:
        """Record a controller-side span (e.g. one pipeline step or stage) around a block (``track``: as for
        ``add_span``)."""
        t0 = time.time()
        try:
            yield
        finally:
            self.add_span(name, t0, time.time(), track=track, **args)

    def add_span(self, name: str, start: float, end: float, track: str | None = None, **args: Any) -> None:
        """Record a controller-side span with explicit wall-clock times (seconds). ``track`` names the controller
        lane it goes on (None: the main one): spans that may overlap (concurrent stages) belong on tracks of their
        own, since the spans of one lane must nest. A span that would overlap another of its track without nesting
        goes to a further lane of that track."""
        ts, dur = _us(start), max(1, _us(end) - _us(start))
        lanes = self._lanes.setdefault(track, [])
        for i, lane in enumerate(lanes):
            if all(e <= ts or ts + dur <= s0 or (s0 <= ts and ts + dur <= e) or (ts <= s0 and e <= ts + dur)
                   for s0, e in lane):
                break
        else:
            i = len(lanes)
            lanes.append([])
        lanes[i].append((ts, ts + dur))
        tid = self._tids.get((track, i))
        if tid is None:
            tid = self._tids[(track, i)] = len(self._tids)
            label = "controller" if track is None else track
            self._events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                                 "args": {"name": label if i == 0 else f"{label} ({i + 1})"}})
        self._events.append({"name": name, "cat": "controller", "ph": "X", "pid": 0, "tid": tid, "ts": ts,
                             "dur": dur, "args": args})

    def events(self) -> list[dict[str, Any]]:
        """The trace events collected so far."""
        return list(self._events)

    def save(self, path: str | os.PathLike) -> Path:
        """Write Chrome trace JSON (``{"traceEvents": [...]}``) to ``path``. Refused if groups were given but
        recording was never started: that trace would hold none of their calls."""
        if self._groups and not self._started:
            names = [g._shared.name for g in self._groups]
            raise OrchestraError(f"Tracer.save({str(path)!r}): span recording was never started in groups {names}, "
                                 f"so the trace would hold none of their calls: await tracer.start() before the "
                                 f"calls and await tracer.collect() before save(), or make them inside "
                                 f"'async with Tracer(...) as tracer:'")
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"traceEvents": self._events, "displayTimeUnit": "ms"}))
        return p


def _us(t: float) -> int:
    return int(t * 1e6)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
