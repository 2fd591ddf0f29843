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
