"""A test helper: hold the replies of one endpoint's calls at the controller (in-process backend), as Ray may deliver
them after those of a call that read them. Used by the memory tests and, copied next to a user's test file, by the
plugin's subprocess tests (it imports only orchestra, pytest and asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from orchestra import _invocation


def replies_held(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> tuple[asyncio.Event, list[asyncio.Task]]:
    """Hold the replies of ``endpoint``'s calls at the controller until the returned event is set, as Ray may deliver
    a reader's replies before its upstream's (the replies of different actors come in any order); the tasks that
    deliver them, for the test to await."""
    gate, tasks = asyncio.Event(), []
    make_slot, add = _invocation.Invocation._slot, _invocation.Slot.add

    def slot(inv, rank, collected):
        s = make_slot(inv, rank, collected)
        s.held = inv.endpoint == endpoint
        return s

    def held_add(s, ref, out=None):
        if getattr(s, "held", False):
            src = _invocation._replies.one(ref) if out is None else out
            late = asyncio.get_running_loop().create_future()

            async def deliver() -> None:
                await gate.wait()
                late.set_result(await src)
            tasks.append(asyncio.ensure_future(deliver()))
            out = late
        return add(s, ref, out)

    monkeypatch.setattr(_invocation.Invocation, "_slot", slot)
    monkeypatch.setattr(_invocation.Slot, "add", held_add)
    return gate, tasks
