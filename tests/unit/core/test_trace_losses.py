"""What a trace keeps when something goes wrong (in-process backend, no Ray): a dead rank loses only its own spans
and is marked in the trace; a collect never loses what the ranks handed over; spans are not dropped by comparing
clocks of different processes; spans a rank had to drop (its buffer full) are counted, reported and warned about."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import types
from typing import Any

import anyio
import pytest

import orchestra as orc
import orchestra._host as host_module
from orchestra import ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D
from orchestra.testing import kill_rank

pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails


class Traced(Worker):
    @endpoint(D.broadcast())
    def slow(self, s: float = 0.0) -> int:
        time.sleep(s)
        return self.rank

    @endpoint(D.broadcast())
    def die_on(self, rank: int, why: str = "bad") -> int:
        if self.rank == rank:
            self.declare_dead(why)
        return self.rank


def _group(n: int, name: str) -> WorkerGroup:
    return WorkerGroup(ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend="local"), Traced,
                       group_name=name)


def _tracks(tracer: orc.Tracer) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in tracer.events() if e["name"] == "process_name"}


def _spans_by_track(tracer: orc.Tracer) -> dict[str, int]:
    tracks = _tracks(tracer)
    out: dict[str, int] = {}
    for e in tracer.events():
        if e["ph"] == "X" and e["pid"] != 0:
            out[tracks[e["pid"]]] = out.get(tracks[e["pid"]], 0) + 1
    return out


def _marks(tracer: orc.Tracer) -> list[tuple[str, dict[str, Any]]]:
    tracks = _tracks(tracer)
    return [(tracks[e["pid"]], e["args"]) for e in tracer.events() if e["ph"] == "i"]


async def test_a_rank_killed_in_a_tracer_block_loses_only_its_own_spans(tmp_path, caplog):
    """It lost the whole group's trace: the group-level take_events failed on the dead rank, so the live rank's
    spans were never collected ("spans of group 'g' could not be collected", 0 spans)."""
    g = _group(2, "lossy")
    await g.ready()
    try:
        tracer = orc.Tracer(g)
        with pytest.raises(orc.WorkerDiedError):
            async with tracer:
                for _ in range(3):
                    await g.slow()
                await kill_rank(g, 1)
                await g.slow()
        assert _spans_by_track(tracer).get("lossy rank 0", 0) >= 3  # the live rank's spans are all there
        marks = _marks(tracer)
        assert [t for t, _ in marks] == ["lossy rank 1"]  # the dead rank is marked on its track, once
        assert "died" in marks[0][1]["why"]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchestra"):
            path = tracer.save(tmp_path / "trace.json")
        assert "lossy" in caplog.text and "rank 1" in caplog.text and "lost" in caplog.text
        saved = json.loads(path.read_text())
        assert [(x["group"], x["rank"]) for x in saved["otherData"]["lost_ranks"]] == [("lossy", 1)]
    finally:
        await g.aclose()


async def test_a_collect_after_a_declared_death_keeps_every_span_the_ranks_handed_over():
    """collect raised (the group-level answer check saw the declared death) after each rank had emptied its buffer
    into the answers: the spans were gone from the ranks and never reached the trace."""
    g = _group(2, "declared")
    await g.ready()
    try:
        tracer = orc.Tracer(g)
        await tracer.start()
        await g.slow()
        try:
            await g.die_on(1, "cuda ECC error")
        except orc.WorkerDiedError:  # the controller may see the declared death before the call's replies
            pass
        with anyio.fail_after(30):  # until supervision has seen the declaration (a hang, not a threshold)
            while 1 not in g._shared.dead:
                await asyncio.sleep(0.01)
        added = await tracer.collect()
        spans = _spans_by_track(tracer)
        # slow and die_on on the declared rank, which still answered; rank 0's die_on may have been cancelled by
        # the failure before it began (no span then)
        assert spans["declared rank 1"] == 2 and spans["declared rank 0"] in (1, 2) and added == sum(spans.values())
        marks = _marks(tracer)
        assert [t for t, _ in marks] == ["declared rank 1"] and "cuda ECC error" in marks[0][1]["why"]
        left = [r for r in await g._gather("take_events") if not isinstance(r, BaseException)]
        assert all(not spans for _pid, spans in left)  # nothing left behind on the ranks, nothing lost
        await tracer.collect()
        assert len(_marks(tracer)) == 1  # marked once, however often it is collected
        await tracer.stop()  # the declared rank cannot refuse; stop does not raise
    finally:
        await g.aclose()


async def test_a_rank_clock_behind_the_controllers_drops_no_span(monkeypatch):
    """A rank's span start (its own wall clock) was compared with the controller's tracer start: a rank 50 ms
    behind (another node without tight NTP) lost every span that started within 50 ms of the start."""
    skewed = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    skewed.time = lambda: time.time() - 0.050
    monkeypatch.setattr(host_module, "time", skewed)  # only the ranks' side reads the skewed clock
    g = _group(2, "skewed")
    await g.ready()
    try:
        async with orc.Tracer(g) as tracer:
            for _ in range(5):
                await g.slow(0.005)
        assert _spans_by_track(tracer) == {"skewed rank 0": 5, "skewed rank 1": 5}
    finally:
        await g.aclose()


async def test_nested_tracer_on_a_skewed_rank_gets_the_calls_made_while_it_records(monkeypatch):
    skewed = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    skewed.time = lambda: time.time() + 5.0  # ahead: a controller-clock comparison would take earlier spans too
    monkeypatch.setattr(host_module, "time", skewed)
    g = _group(1, "ahead")
    await g.ready()
    try:
        async with orc.Tracer(g) as outer:
            await g.slow()
            async with orc.Tracer(g) as inner:
                await g.slow()
            await g.slow()
        assert _spans_by_track(inner) == {"ahead rank 0": 1}
        assert _spans_by_track(outer) == {"ahead rank 0": 3}
    finally:
        await g.aclose()


async def test_spans_a_rank_dropped_past_its_buffer_are_counted_reported_and_warned(monkeypatch, tmp_path, caplog):
    """Past the per-rank buffer (200 000 spans between collects) the oldest were dropped and nothing said so."""
    monkeypatch.setattr(host_module._Events.__init__, "__defaults__", (5,))
    g = _group(1, "busy")
    await g.ready()
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchestra"):
            async with orc.Tracer(g) as tracer:
                for _ in range(8):
                    await g.slow()
        assert _spans_by_track(tracer) == {"busy rank 0": 5}
        assert "busy" in caplog.text and "rank 0" in caplog.text and "3 spans" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchestra"):
            path = tracer.save(tmp_path / "trace.json")
        assert "3 spans" in caplog.text
        saved = json.loads(path.read_text())
        assert saved["otherData"]["dropped_spans"] == [{"group": "busy", "rank": 0, "count": 3}]
    finally:
        await g.aclose()


async def test_a_clean_trace_saves_without_a_warning(tmp_path, caplog):
    g = _group(2, "clean")
    await g.ready()
    try:
        async with orc.Tracer(g) as tracer:
            await g.slow()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchestra"):
            path = tracer.save(tmp_path / "trace.json")
        assert caplog.text == ""
        saved = json.loads(path.read_text())
        assert saved["otherData"] == {"lost_ranks": [], "dropped_spans": []}
    finally:
        await g.aclose()


async def test_a_group_that_cannot_be_collected_costs_only_its_own_spans():
    """collect went group by group and stopped at the first that raised: the spans of every group after it stayed
    out of the trace (they were taken from their ranks, so they were gone)."""
    a, b = _group(1, "first"), _group(1, "second")
    await a.ready()
    await b.ready()
    try:
        tracer = orc.Tracer(a, b)
        await tracer.start()
        await a.slow()
        await b.slow()
        collect_group = tracer._collect_group

        async def failing_for_a(g):
            if g is a:
                raise RuntimeError("group 'first' could not be collected")
            return await collect_group(g)

        tracer._collect_group = failing_for_a
        with pytest.raises(RuntimeError, match="'first' could not be collected"):
            await tracer.collect()
        assert _spans_by_track(tracer) == {"second rank 0": 1}
        tracer._collect_group = collect_group
        await tracer.stop()
    finally:
        await a.aclose()
        await b.aclose()
