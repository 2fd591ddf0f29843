"""Tracks and arrows of a trace (in-process backend, no Ray): arrows from producer to consumer whatever the order the
groups were given in; groups of the same name on tracks of their own; failed and cancelled calls as marked spans."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, Worker, WorkerGroup, endpoint
from orchestra import dispatch as D

import holding  # noqa: E402
from holding import Holding  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_ray")  # conftest: a module that started Ray fails


class Stage(Holding):
    @endpoint(D.broadcast())
    def boom(self) -> int:
        raise ValueError("boom")

    @endpoint(D.shard())
    def double(self, batch: Batch) -> Batch:
        return Batch.from_dict({"y": batch["x"] * 2})

    @endpoint(D.shard())
    def consume(self, batch: Batch) -> Batch:
        return Batch.from_dict({"z": batch["y"] + 1})


def _group(n: int, name: str | None = None) -> WorkerGroup:
    pool = ResourcePool(process_on_nodes=[n], cpus_per_worker=0.01, backend="local")
    return WorkerGroup(pool, Stage) if name is None else WorkerGroup(pool, Stage, group_name=name)


def _tracks(tracer: orc.Tracer) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in tracer.events() if e["name"] == "process_name"}


def _count(tracer: orc.Tracer, ph: str) -> int:
    return sum(e["ph"] == ph for e in tracer.events())


async def test_arrows_do_not_depend_on_the_order_the_groups_were_given_in():
    """Tracer(prod, cons) drew 2 arrows, Tracer(cons, prod) none: an arrow was drawn only if its producer's span had
    been added before its consumer's."""
    prod, cons = _group(2, "prod"), _group(2, "cons")
    await prod.ready()
    await cons.ready()
    try:
        x = Batch.from_dict({"x": torch.arange(8)})
        for order in ((prod, cons), (cons, prod)):
            async with orc.Tracer(*order) as tracer:
                await cons.consume(prod.double(x))
            assert (_count(tracer, "X"), _count(tracer, "s"), _count(tracer, "f")) == (4, 2, 2), order
            tracks = _tracks(tracer)
            starts = [tracks[e["pid"]] for e in tracer.events() if e["ph"] == "s"]
            ends = [tracks[e["pid"]] for e in tracer.events() if e["ph"] == "f"]
            assert sorted(starts) == ["prod rank 0", "prod rank 1"]
            assert sorted(ends) == ["cons rank 0", "cons rank 1"]
    finally:
        await prod.aclose()
        await cons.aclose()


async def test_an_arrow_from_a_producer_collected_in_an_earlier_collect():
    prod, cons = _group(2, "prod2"), _group(2, "cons2")
    await prod.ready()
    await cons.ready()
    try:
        x = Batch.from_dict({"x": torch.arange(8)})
        async with orc.Tracer(cons, prod) as tracer:
            y = prod.double(x)
            await y
            await tracer.collect()
            await cons.consume(y)
        assert (_count(tracer, "X"), _count(tracer, "s"), _count(tracer, "f")) == (4, 2, 2)
    finally:
        await prod.aclose()
        await cons.aclose()


async def test_two_groups_of_one_name_get_tracks_of_their_own():
    """Tracks were keyed by (group name, rank): two groups named alike shared one track per rank, with overlapping
    spans on one pid/tid."""
    a, b = _group(2), _group(2)
    await a.ready()
    await b.ready()
    try:
        assert a.name == b.name
        async with orc.Tracer(a, b) as tracer:
            await asyncio.gather(a.slow(0.05), b.slow(0.08))
        tracks = _tracks(tracer)
        name = a.name
        assert sorted(tracks.values()) == sorted(["controller", f"{name} rank 0", f"{name} rank 1",
                                                  f"{name}#2 rank 0", f"{name}#2 rank 1"])
        spans = [e for e in tracer.events() if e["ph"] == "X"]
        by_lane: dict[tuple[int, int], list[dict]] = {}
        for s in spans:
            by_lane.setdefault((s["pid"], s["tid"]), []).append(s)
        assert len(by_lane) == 4 and all(len(v) == 1 for v in by_lane.values())
    finally:
        await a.aclose()
        await b.aclose()


async def test_failed_and_cancelled_calls_are_spans_marked_as_such():
    """Only calls that returned were in the trace; a failed or cancelled call was counted in stats but never
    shown."""
    g = _group(1, "marked")
    await g.ready()
    try:
        async with orc.Tracer(g) as tracer:
            await holding.fail_cancel_and_hold(g)
        all_spans = [e for e in tracer.events() if e["ph"] == "X"]
        assert len(all_spans) == 3
        boom = [e for e in all_spans if e["name"] == "marked.boom"]
        assert len(boom) == 1 and boom[0]["args"]["error"] == "ValueError"
        slow = sorted((e for e in all_spans if e["name"] == "marked.hold"), key=lambda e: e["ts"])
        assert slow[0]["args"].get("cancelled") is True and slow[0]["dur"] > 0
        assert "cancelled" not in slow[1]["args"] and "error" not in slow[1]["args"]
    finally:
        await g.aclose()
