"""Awaiting several things at once, structured: the first failure ends the others, and none outlives the await."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import anyio

__all__ = ["join"]


async def join(*aws: Awaitable[Any]) -> list[Any]:
    """Await every one of ``aws`` at once and return their results in order. The first failure ends the others:
    they are cancelled (a DataFuture's await cancelled cancels its call) and waited for, then that failure is
    raised as it is (not in a group); any other that failed meanwhile is named in a note on it.
    ``asyncio.gather`` would leave them running, owned by nobody."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            with anyio.CancelScope(shield=True):  # cancelled ones end within a loop turn or two
                await asyncio.wait(pending)
    failed = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
    if failed:  # the first raised; every other one said on it (each retrieved: none is lost to the garbage collector)
        first = failed[0]
        for other in failed[1:]:
            first.add_note(f"(join: another awaitable failed too: {type(other).__name__}: {other})")
        raise first
    return [t.result() for t in tasks]
