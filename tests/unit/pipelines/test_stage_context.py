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


async def test_a_death_reported_while_a_failed_step_ends_is_caught_by_the_supervising_scope():
    """CI race (test_elastic_recovery): the awaited call failed with the death, and supervision's ``on_death``
    cancelled its scope while the step's ``__aexit__`` waited for the watchers it had just cancelled. The
    cancellation that came out carried a watcher's message, not the scope's, so the scope let it through and the
    run ended with a bare CancelledError instead of restarting."""
    import anyio

    ctx = StepContext(None, load_config(None, []), 0)  # type: ignore[arg-type]
    caught: list[BaseException] = []
    with anyio.CancelScope() as scope:  # as Runner._supervised: the call's own error is caught inside the scope
        try:
            async with ctx:
                ctx.stage("update_actor", _Pending())
                await asyncio.sleep(0)  # the watcher is waiting
                asyncio.get_running_loop().call_soon(scope.cancel)  # the death, reported one loop turn later
                raise RuntimeError("the awaited call failed: rank 1 died")
        except RuntimeError as e:
            caught.append(e)
    assert [str(e) for e in caught] == ["the awaited call failed: rank 1 died"]
    assert scope.cancel_called
    assert ctx._watch and all(t.done() for t in ctx._watch)
    await asyncio.sleep(0)  # no cancellation left pending on the task once the scope is gone
