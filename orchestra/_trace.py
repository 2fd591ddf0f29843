"""Tracer: a timeline of what every rank did, as Chrome trace JSON (open it in https://ui.perfetto.dev).

Each call on each rank is a span on that rank's track; each part a consumer fetched from a producer is a flow
arrow from the producer's span to the consumer's, labelled with its bytes. Controller-side phases are spans on a
"controller" track.

Recording is on only between ``await tracer.start()`` and the end of the run (or of an ``async with Tracer(...)``
block); ``await tracer.collect()`` pulls the spans before ``save``. A trace saved without recording ever started is
refused rather than written empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from ._errors import OrchestraError

__all__ = ["Tracer"]


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
        """Turn span recording on in every traced group."""
        for g in self._groups:
            await g.set_tracing(True)
        self._started = True

    async def __aenter__(self) -> Tracer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Collect what the block's calls recorded and turn recording off; after a failure, leave the groups alone
        (a dead rank cannot answer) and let the block's own error through."""
        if exc_type is not None:
            return
        await self.collect()
        for g in self._groups:
            await g.set_tracing(False)

    async def collect(self) -> int:
        """Pull the spans recorded since the last collect from every rank; returns how many were added."""
        added = 0
        for g in self._groups:
            name = g._shared.name
            for rank, (_pid, spans) in enumerate(await g.take_events()):
                pid = self._track(name, rank)
                for sp in sorted(spans, key=lambda s: s["start"]):
                    self._add_span(pid, sp)
                    added += 1
        return added

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
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Record a controller-side span (e.g. one pipeline step or stage) around a block."""
        t0 = time.time()
        try:
            yield
        finally:
            self.add_span(name, t0, time.time(), **args)

    def add_span(self, name: str, start: float, end: float, **args: Any) -> None:
        """Record a controller-side span with explicit wall-clock times (seconds)."""
        self._events.append({"name": name, "cat": "controller", "ph": "X", "pid": 0, "tid": 0, "ts": _us(start),
                             "dur": max(1, _us(end) - _us(start)), "args": args})

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
