"""StepContext owns its stage watchers: none outlives the step, whether it finished or failed."""

from __future__ import annotations

import asyncio

import pytest

from pipelines.config import load_config
from pipelines.stage import StepContext


class _Pending:
    """A future-like stage output that never finishes (a stage still running when its step fails)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()


class _Done:
    async def wait(self) -> None:
        return None


async def test_a_failed_step_leaves_no_stage_watcher_running():
    ctx = StepContext(None, load_config(None, []), 0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="the step failed"):
        async with ctx:
            ctx.stage("slow", _Pending())
            raise RuntimeError("the step failed")
    assert ctx._watch and all(t.done() for t in ctx._watch)  # cancelled and awaited, not left on the loop


async def test_a_finished_step_records_every_stage_time():
    ctx = StepContext(None, load_config(None, []), 0)  # type: ignore[arg-type]
    async with ctx:
        ctx.stage("a", _Done())
        ctx.stage("b", _Done())
    assert set(ctx.timings) == {"time/a", "time/b"}
    assert all(t.done() for t in ctx._watch)
