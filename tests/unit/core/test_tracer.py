"""Tracer on the in-process backend (no Ray): a trace saved without recording ever started is refused, not written
empty; ``async with Tracer(...)`` records, collects and stops; spans name the calls, ranks and bytes that ran."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup

_INTEGRATION = Path(__file__).resolve().parents[2] / "integration"
if str(_INTEGRATION) not in sys.path:
    sys.path.insert(0, str(_INTEGRATION))
from orc_test_workers import Scorer  # noqa: E402


def _group() -> WorkerGroup:
    return WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01, backend="local"), Scorer,
                       group_name="traced")


async def test_saving_a_trace_whose_recording_never_started_is_refused(tmp_path):
    """The trap: ``Tracer(g)``, calls, ``save()`` used to write a trace with no span and say nothing."""
    async with _group() as g:
        tracer = orc.Tracer(g)
        await g.score(Batch.from_dict({"x": torch.arange(4)}))
        with pytest.raises(orc.OrchestraError, match=r"never started.*await tracer.start\(\)"):
            tracer.save(tmp_path / "trace.json")
        assert not (tmp_path / "trace.json").exists()


async def test_a_tracer_context_records_the_calls_made_in_it(tmp_path):
    async with _group() as g:
        async with orc.Tracer(g) as tracer:
            await g.score(Batch.from_dict({"x": torch.arange(4)}))
        await g.score(Batch.from_dict({"x": torch.arange(4)}))  # after the block: not recorded
        path = tracer.save(tmp_path / "trace.json")
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    tracks = {e["pid"]: e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
              if e["name"] == "process_name"}
    assert sorted(tracks[s["pid"]] for s in spans) == ["traced rank 0", "traced rank 1"]
    assert {s["name"] for s in spans} == {"traced.score"}
    assert all(s["args"]["rows_out"] == 2 for s in spans)


def _spans(tracer: orc.Tracer) -> list[dict]:
    return [e for e in tracer.events() if e["ph"] == "X"]


async def test_nested_tracers_each_get_the_calls_made_while_they_record():
    """The inner block's end turned recording off for the group (the outer tracer missed every later call), and
    whichever tracer collected first took the other's spans."""
    batch = Batch.from_dict({"x": torch.arange(4)})
    async with _group() as g:
        async with orc.Tracer(g) as outer:
            await g.score(batch)  # A
            async with orc.Tracer(g) as inner:
                await g.score(batch)  # B
            await g.score(batch)  # C
        assert len(_spans(inner)) == 2  # B on 2 ranks
        assert len(_spans(outer)) == 6  # A, B, C on 2 ranks
        await g.score(batch)  # after both: nobody records
        assert sum(len(spans) for _pid, spans in await g.take_events()) == 0


async def test_a_tracer_block_that_raises_still_collects_and_stops_recording():
    batch = Batch.from_dict({"x": torch.arange(4)})
    async with _group() as g:
        with pytest.raises(ValueError, match="the block's own error"):
            async with orc.Tracer(g) as tracer:
                await g.score(batch)
                raise ValueError("the block's own error")
        assert len(_spans(tracer)) == 2  # what ran before the failure is in the trace (what a failure needs)
        for _ in range(3):
            await g.score(batch)
        assert sum(len(spans) for _pid, spans in await g.take_events()) == 0  # recording is off


def test_controller_spans_of_different_tracks_never_share_a_lane():
    """Chrome trace JSON needs complete ('X') events of one thread to nest; concurrent pipeline stages overlap, so
    each named track gets a lane (tid) of its own; spans of one track that overlap without nesting go to a further
    lane of that track."""
    tracer = orc.Tracer()
    tracer.add_span("step 0", 10.0, 20.0)
    tracer.add_span("reward", 10.5, 12.0, track="reward")
    tracer.add_span("old_log_prob", 11.0, 13.0, track="old_log_prob")  # overlaps reward without nesting
    tracer.add_span("update_actor", 13.0, 20.5, track="update_actor")  # ends after its step
    tracer.add_span("reward", 11.5, 12.5, track="reward")  # overlaps the first reward span: a second reward lane
    tracer.add_span("step 1", 20.0, 30.0)
    spans = _spans(tracer)
    lanes: dict[tuple[int, int], list[dict]] = {}
    for s in spans:
        lanes.setdefault((s["pid"], s["tid"]), []).append(s)
    for lane in lanes.values():
        for a in lane:
            for b in lane:
                a0, a1, b0, b1 = a["ts"], a["ts"] + a["dur"], b["ts"], b["ts"] + b["dur"]
                assert a is b or a1 <= b0 or b1 <= a0 or (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1), \
                    (a["name"], b["name"])
    names = {e["args"]["name"] for e in tracer.events() if e["name"] == "thread_name" and e["pid"] == 0}
    assert {"reward", "reward (2)", "old_log_prob", "update_actor"} <= names
    assert len({s["tid"] for s in spans if s["name"].startswith("step")}) == 1  # disjoint spans share their lane
