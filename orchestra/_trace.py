"""Tracer: a timeline of what every rank did, as Chrome trace JSON (open it in https://ui.perfetto.dev).

Each call on each rank is a span on that rank's track; each part a consumer fetched from a producer is a flow
arrow from the producer's span to the consumer's, labelled with its bytes. Controller-side phases are spans on a
"controller" track.

Recording is on only between ``await tracer.start()`` and ``await tracer.stop()`` (or the end of the run, or of an
``async with Tracer(...)`` block); ``await tracer.collect()`` pulls the spans before ``save``. A trace saved without
recording ever started is refused rather than written empty. Several tracers may record the same group (nested
blocks): the ranks record while any of them does, and each gets every span that started while it recorded (by the
rank's own clock: clocks of different processes are never compared; the timestamps are each host's wall clock).

A failed or cancelled call is a span too (args ``error`` / ``cancelled``). Collecting asks each rank on its own: a
dead rank costs only its own spans since the last collect, and is marked in the trace; spans a rank dropped past its
buffer are counted. Both go to ``otherData`` in the saved file and are logged as warnings.
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


class _Inbox:
    """What a tracer has not collected yet from one group: spans per rank, the ranks lost (why), the spans dropped."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, dict[str, Any]]] = []  # (rank, span)
        # rank -> (why it is lost: dead, declared dead, no answer; whether the spans it had were taken all the same)
        self.lost: dict[int, tuple[str, bool]] = {}
        self.dropped: dict[int, int] = {}  # rank -> spans it dropped (its buffer was full)


class _Hub:
    """The tracers recording one group (its colocated views share it): the ranks record while any tracer is active;
    spans taken from the ranks go to every active tracer that was recording when the span started, by the rank's own
    clock (each rank tells the time it had when it started recording for a tracer: clocks of different processes
    are never compared)."""

    def __init__(self) -> None:
        # id(tracer) -> (tracer, per rank: the rank's own wall clock when it started recording for that tracer)
        self.active: dict[int, tuple[Tracer, list[float]]] = {}
        self.inbox: dict[int, _Inbox] = {}  # id(tracer) -> what it has not collected yet

    async def enter(self, tracer: Tracer, group: Any) -> None:
        if id(tracer) in self.active:
            return
        marks = await group._control("set_tracing", True)  # on every rank; each answers its own clock's time
        self.active[id(tracer)] = (tracer, [float(m) for m in marks])
        self.inbox.setdefault(id(tracer), _Inbox())

    async def drain(self, group: Any) -> None:
        """Take what each rank recorded, rank by rank (a rank that cannot answer costs only its own spans), and hand
        each span to the tracers that were recording when it started. A rank that is dead, declared dead or does
        not answer is noted as lost in every active tracer; spans a rank dropped are counted."""
        try:
            answers = await group._gather("take_events", True)
        except Exception as e:  # noqa: BLE001 - the group cannot answer at all (closed, start-up failed)
            answers = e
        # the tracers active now (one may have started or stopped while the ranks answered)
        boxes = [(self.inbox[key], marks) for key, (_t, marks) in self.active.items()]
        if isinstance(answers, Exception):
            why = f"the group did not answer: {_first_line(answers)}"
            for box, marks in boxes:
                for rank in range(len(marks)):
                    box.lost.setdefault(rank, (why, False))
            return
        dead = group._shared.dead
        for rank, got in enumerate(answers):
            if rank in dead:  # a rank declared dead still answers (its spans are kept); a dead one does not
                why = f"rank died: {_first_line(dead[rank])}"
            elif isinstance(got, BaseException):
                why = f"rank did not answer: {_first_line(got)}"
            else:
                why = None
            if why is not None:
                for box, _marks in boxes:
                    box.lost.setdefault(rank, (why, not isinstance(got, BaseException)))
            if isinstance(got, BaseException):
                continue
            for box, marks in boxes:
                since = marks[rank]
                box.spans.extend((rank, sp) for sp in got["spans"] if sp["start"] >= since)
                if got["dropped"]:
                    box.dropped[rank] = box.dropped.get(rank, 0) + got["dropped"]

    def take(self, tracer: Tracer) -> _Inbox:
        got, self.inbox[id(tracer)] = self.inbox.get(id(tracer), _Inbox()), _Inbox()
        return got

    async def leave(self, tracer: Tracer, group: Any) -> None:
        """Stop recording for ``tracer``; once no tracer records, the ranks stop recording (a rank that cannot be
        told, dead or gone, records nothing anyway: logged, not raised)."""
        if self.active.pop(id(tracer), None) is None:
            return
        self.inbox.pop(id(tracer), None)
        if self.active:
            return
        try:
            answers = await group._gather("set_tracing", False)
        except Exception as e:  # noqa: BLE001 - a closed group records nothing
            log.debug("Tracer: recording not turned off in group %r: %s", group._shared.name, _first_line(e))
            return
        for rank, got in enumerate(answers):
            if isinstance(got, BaseException) and rank not in group._shared.dead:
                log.warning("Tracer: recording could not be turned off on group %r rank %d (%s); it records on "
                            "until the group closes, each span kept until a tracer takes it", group._shared.name,
                            rank, _first_line(got))


_HUBS: weakref.WeakKeyDictionary[Any, _Hub] = weakref.WeakKeyDictionary()


def _hub(group: Any) -> _Hub:
    return _HUBS.setdefault(group._shared, _Hub())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


class Tracer:
    """Collects spans from worker groups and the controller; ``save`` writes Chrome trace JSON.

    ``async with Tracer(*groups) as tracer:`` records the calls made in the block and collects them at its end;
    or ``await tracer.start()`` before the calls and ``await tracer.collect()`` before ``save``.

    What a trace could not hold is marked in it and warned about (logger ``orchestra``) at the collect that saw it
    and again at ``save``: a rank that died (its spans since the last collect are lost; the other ranks' are kept)
    or was declared dead (an instant event on its track, and ``otherData["lost_ranks"]``), spans a rank dropped past
    its buffer between two collects (``otherData["dropped_spans"]``)."""

    def __init__(self, *groups: Any) -> None:
        self._groups: list[Any] = []
        seen = set()
        for g in groups:
            if id(g._shared) not in seen:  # colocated views share their actors: trace them once
                seen.add(id(g._shared))
                self._groups.append(g)
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[tuple[int, int], int] = {}  # (id of the group's actors, rank) -> pid
        self._labels: dict[int, str] = {}  # id of a group's actors -> its label ("name", or "name#2" for the 2nd)
        self._named: dict[str, int] = {}  # group name -> how many groups of that name have a label
        self._lanes: dict[str | None, list[list[tuple[int, int]]]] = {}  # controller track -> its lanes' spans
        self._tids: dict[tuple[str | None, int], int] = {(None, 0): 0}
        self._produced: dict[str, tuple[int, float]] = {}  # part -> (pid, end) of the span that produced it
        self._waiting: dict[str, list[tuple[int, int, int]]] = {}  # part -> (pid, start, bytes) of its readers
        self._lost: dict[tuple[int, int], dict[str, Any]] = {}  # (group id, rank) -> {"group", "rank", "why"}
        self._dropped: dict[tuple[int, int], dict[str, Any]] = {}  # (group id, rank) -> {"group", "rank", "count"}
        self._flow = 0
        self._started = False
        self._meta("controller", 0)

    def _label(self, g: Any) -> str:
        key = id(g._shared)
        label = self._labels.get(key)
        if label is None:
            name = g._shared.name
            n = self._named[name] = self._named.get(name, 0) + 1
            label = self._labels[key] = name if n == 1 else f"{name}#{n}"
        return label

    def _track(self, g: Any, rank: int) -> int:
        key = (id(g._shared), rank)
        pid = self._tracks.get(key)
        if pid is None:
            pid = self._tracks[key] = len(self._tracks) + 1
            self._meta(f"{self._label(g)} rank {rank}", pid)
        return pid

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
        block is what one looks at), but then an error of the collect is logged, and the block's own error goes
        on. A rank that cannot answer (dead) costs only its own spans, either way."""
        if exc_type is None:
            await self.collect()
            await self.stop()
            return
        try:
            await self.collect()
        except Exception as e:  # noqa: BLE001 - the block's own error is the one raised; this one is logged
            log.warning("Tracer: spans of groups %s could not be collected after the block failed: %s",
                        [g._shared.name for g in self._groups], e)
        for g in self._groups:
            try:
                await _hub(g).leave(self, g)
            except Exception as e:  # noqa: BLE001 - as above
                log.warning("Tracer: recording could not be turned off in group %r after the block failed: %s",
                            g._shared.name, e)

    async def collect(self) -> int:
        """Pull the spans recorded since the last collect from every rank that answers; returns how many were
        added. A rank that is dead (or declared dead) is marked in the trace and warned about; the other ranks'
        spans are kept. Arrows between spans are drawn once every group's spans are in (or later, when a part's
        producer comes in a later collect)."""
        got: list[tuple[int, dict[str, Any]]] = []
        failed: BaseException | None = None
        for g in self._groups:  # a group that cannot be collected costs its own spans only: the others are added
            try:
                got.extend(await self._collect_group(g))
            except Exception as e:  # noqa: BLE001 - raised below, once the other groups' spans are in
                failed = failed or e
        got.sort(key=lambda ps: ps[1]["start"])
        for pid, sp in got:
            self._add_span(pid, sp)
        for pid, sp in got:
            self._link(pid, sp)
        if failed is not None:
            raise failed
        return len(got)

    async def _collect_group(self, g: Any) -> list[tuple[int, dict[str, Any]]]:
        """(track, span) of what this tracer has not collected yet from ``g``; notes its lost ranks and drops."""
        hub = _hub(g)
        if id(self) in hub.active:
            await hub.drain(g)
        box = hub.take(self)
        new = [(rank, why, kept) for rank, (why, kept) in sorted(box.lost.items())
               if (id(g._shared), rank) not in self._lost]
        for rank, why, kept in new:
            self._note_lost(g, rank, why, kept)
        whys = {why for _r, why, _k in new}
        if len(new) > 1 and len(whys) == 1 and not new[0][2]:  # the whole group at once (closed): one warning
            log.warning("Tracer: group %r ranks %s: %s; the spans they recorded since the last collect are lost (if "
                        "any); the trace marks each ('rank lost' on its track)", self._label(g),
                        [r for r, _w, _k in new], whys.pop())
        else:
            for rank, why, kept in new:
                self._warn_lost(self._label(g), rank, why, kept)
        for rank, n in sorted(box.dropped.items()):
            self._note_dropped(g, rank, n)
        return [(self._track(g, rank), sp) for rank, sp in box.spans]

    def _note_lost(self, g: Any, rank: int, why: str, kept: bool) -> None:
        """Mark ``rank`` of ``g`` lost in the trace (an instant event on its track), once. ``kept``: it still handed
        over the spans it had (a rank declared dead answers)."""
        key = (id(g._shared), rank)
        if key in self._lost:
            return
        label = self._label(g)
        self._lost[key] = {"group": label, "rank": rank, "why": why, "spans_kept": kept}
        self._events.append({"name": "rank lost", "cat": "lost", "ph": "i", "s": "p", "pid": self._track(g, rank),
                             "tid": 0, "ts": _us(time.time()), "args": {"why": why, "spans_kept": kept}})

    @staticmethod
    def _warn_lost(label: str, rank: int, why: str, kept: bool) -> None:
        if kept:
            log.warning("Tracer: group %r rank %d: %s; its spans so far are in the trace, it records no more; the "
                        "trace marks it ('rank lost' on its track)", label, rank, why)
        else:
            log.warning("Tracer: group %r rank %d: %s; the spans it recorded since the last collect are lost (if "
                        "any), the other ranks' are kept; the trace marks it ('rank lost' on its track). To lose "
                        "less of a rank that may die, await tracer.collect() more often", label, rank, why)

    def _note_dropped(self, g: Any, rank: int, n: int) -> None:
        key = (id(g._shared), rank)
        label = self._label(g)
        entry = self._dropped.setdefault(key, {"group": label, "rank": rank, "count": 0})
        entry["count"] += n
        log.warning("Tracer: group %r rank %d dropped %d spans (the oldest) since the last collect: it keeps at most "
                    "200000 between two collects; await tracer.collect() more often to keep them all", label, rank, n)

    def _add_span(self, pid: int, sp: dict[str, Any]) -> None:
        start, end = _us(sp["start"]), _us(sp["end"])
        role = sp["role"]
        name = sp["endpoint"] if role == "" else f"{role}.{sp['endpoint']}"
        bytes_in = sum(b for _, b in sp["fetched"])
        bytes_out = sum(b for _, b, _ in sp["produced"])
        rows_out = sum(r for _, _, r in sp["produced"])
        args: dict[str, Any] = {"parts_in": len(sp["fetched"]), "bytes_in": bytes_in,
                                "parts_out": len(sp["produced"]), "bytes_out": bytes_out, "rows_out": rows_out}
        if "error" in sp:
            args["error"] = sp["error"]
        if sp.get("cancelled"):
            args["cancelled"] = True
        self._events.append({"name": name, "cat": role, "ph": "X", "pid": pid, "tid": 0, "ts": start,
                             "dur": max(1, end - start), "args": args})
        for part, _nbytes, _rows in sp["produced"]:
            self._produced[part] = (pid, end)
            for reader in self._waiting.pop(part, ()):
                self._arrow(part, reader)

    def _link(self, pid: int, sp: dict[str, Any]) -> None:
        """An arrow from each part's producer to this span (its reader); a producer not collected yet gets it
        when it is."""
        start = _us(sp["start"])
        for part, nbytes in sp["fetched"]:
            if part in self._produced:
                self._arrow(part, (pid, start, nbytes))
            else:
                self._waiting.setdefault(part, []).append((pid, start, nbytes))

    def _arrow(self, part: str, reader: tuple[int, int, int]) -> None:
        src_pid, src_end = self._produced[part]
        pid, start, nbytes = reader
        self._flow += 1
        label = f"part {_size(nbytes)}"
        self._events.append({"name": label, "cat": "part", "ph": "s", "id": self._flow, "pid": src_pid,
                             "tid": 0, "ts": src_end - 1, "args": {"bytes": nbytes}})
        self._events.append({"name": label, "cat": "part", "ph": "f", "bp": "e", "id": self._flow, "pid": pid,
                             "tid": 0, "ts": start + 1, "args": {"bytes": nbytes}})

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
        lost, dropped = list(self._lost.values()), list(self._dropped.values())
        p.write_text(json.dumps({"traceEvents": self._events, "displayTimeUnit": "ms",
                                 "otherData": {"lost_ranks": lost, "dropped_spans": dropped}}))
        if lost or dropped:
            what = [f"group {x['group']!r} rank {x['rank']} was lost ({x['why']}"
                    f"{'' if x['spans_kept'] else '; its spans since the collect before are missing'})" for x in lost]
            what += [f"group {x['group']!r} rank {x['rank']} dropped {x['count']} spans" for x in dropped]
            log.warning("Tracer: trace saved to %s is incomplete: %s (see otherData in the file)", p, "; ".join(what))
        return p


def _us(t: float) -> int:
    return int(t * 1e6)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
