"""Tracer and stats on Ray, where a rank is a process of its own (the in-process tests are
tests/unit/core/test_trace_*.py and test_stats_*.py): a rank SIGKILLed inside a tracer block costs only its own spans,
and a failed call, over Ray and over the fast path, is a marked span and counted in ``errors``."""

from __future__ import annotations

import json

import pytest
import torch
from orc_test_workers import Scorer

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup
from orchestra.testing import kill_rank


def _group(name: str) -> WorkerGroup:
    return WorkerGroup(ResourcePool(process_on_nodes=[2], cpus_per_worker=0.01), Scorer, group_name=name)


def _raise(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("bad rows")


def _tracks(tracer: orc.Tracer) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in tracer.events() if e["name"] == "process_name"}


async def test_a_ray_rank_killed_in_a_tracer_block_costs_only_its_own_spans(tmp_path):
    g = _group("trace_kill")
    await g.ready()
    try:
        tracer = orc.Tracer(g)
        with pytest.raises(orc.WorkerDiedError):
            async with tracer:
                for _ in range(3):
                    await g.score(Batch.from_dict({"x": torch.arange(4)}))
                await kill_rank(g, 1)
                await g.score(Batch.from_dict({"x": torch.arange(4)}))
        tracks = _tracks(tracer)
        spans = [tracks[e["pid"]] for e in tracer.events() if e["ph"] == "X"]
        assert spans.count("trace_kill rank 0") >= 3
        marks = [(tracks[e["pid"]], e["args"]) for e in tracer.events() if e["ph"] == "i"]
        assert [t for t, _ in marks] == ["trace_kill rank 1"] and not marks[0][1]["spans_kept"]
        saved = json.loads(tracer.save(tmp_path / "trace.json").read_text())
        assert [(x["group"], x["rank"]) for x in saved["otherData"]["lost_ranks"]] == [("trace_kill", 1)]
    finally:
        await g.aclose()


async def test_failed_calls_are_marked_spans_and_counted_over_ray_and_the_fast_path():
    g = _group("trace_fail")
    await g.ready()
    try:
        batch = Batch.from_dict({"x": torch.arange(4)})
        async with orc.Tracer(g) as tracer:
            for fast in (False, True):
                g.fast_path = fast
                with pytest.raises(orc.WorkerError, match="bad rows"):
                    await g.apply(_raise, batch)
                await g.score(batch)
        # fail-fast may cancel a rank's call once the other's failed: such a call is cancelled, or never begun
        st = [s["apply"] for s in await g.stats()]
        assert all(s["calls"] == s["errors"] + s["cancelled"] and s["calls"] <= 2 for s in st), st
        assert sum(s["errors"] for s in st) >= 2  # each failing call failed on a rank at least
        assert [(s["score"]["calls"], s["score"]["errors"]) for s in await g.stats()] == [(2, 0), (2, 0)]
        failed = [e for e in tracer.events() if e["ph"] == "X" and e["name"] == "trace_fail.apply"]
        assert len(failed) == sum(s["calls"] for s in st)
        assert sum(e["args"].get("error") == "ValueError" for e in failed) == sum(s["errors"] for s in st)
        assert all(e["args"].get("error") == "ValueError" or e["args"].get("cancelled") for e in failed)
        ok = [e for e in tracer.events() if e["ph"] == "X" and e["name"] == "trace_fail.score"]
        assert len(ok) == 4 and all("error" not in e["args"] and "cancelled" not in e["args"] for e in ok)
    finally:
        await g.aclose()
