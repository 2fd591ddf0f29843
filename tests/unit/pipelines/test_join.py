"""``join``: several awaits at once, none left running after it returns or raises (``asyncio.gather`` left the
others running, owned by nobody, when one failed: PPO's critic update after a failed actor update)."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from pipelines.join import join


class _Blocks:
    """An await that never finishes by itself; records that it was cancelled and had ended."""

    def __init__(self) -> None:
        self.ended = False

    async def wait(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.ended = True


async def _fails() -> None:
    await asyncio.sleep(0)
    raise ValueError("the actor update failed")


async def _value(v: int) -> int:
    await asyncio.sleep(0)
    return v


async def test_results_come_back_in_order():
    assert await join(_value(1), _value(2), _value(3)) == [1, 2, 3]
    assert await join() == []


async def test_the_first_failure_ends_the_others_before_it_is_raised():
    other = _Blocks()
    with pytest.raises(ValueError, match="the actor update failed"):  # as it is, not in an ExceptionGroup
        await join(other.wait(), _fails())
    assert other.ended  # cancelled and finished before join raised: nothing left on the loop


async def test_cancelled_from_outside_it_ends_everything_and_the_scope_knows_its_cancellation():
    a, b = _Blocks(), _Blocks()
    with anyio.CancelScope() as scope:
        asyncio.get_running_loop().call_soon(scope.cancel)
        await join(a.wait(), b.wait())
    assert scope.cancelled_caught and a.ended and b.ended
