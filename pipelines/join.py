"""Awaiting several things at once, structured: the first failure ends the others, and none outlives the await."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import anyio

log = logging.getLogger("orchestra")

__all__ = ["join"]


async def join(*aws: Awaitable[Any]) -> list[Any]:
    """Await every one of ``aws`` at once and return their results in order. The first failure ends the others:
    they are cancelled (a DataFuture's await cancelled cancels its call) and waited for, then that failure is
    raised as it is (not in a group, not changed: it may be a shared upstream's); any other that failed meanwhile
    is logged (ERROR, ``orchestra`` logger).
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
    if failed:  # the first raised as it is; each other one (retrieved: none is lost to the garbage collector) logged
        first = failed[0]
        for i, other in enumerate(failed[1:], 1):  # (two readers of one failed upstream raise its one error object)
            if all(other is not x for x in failed[:i]):
                log.error("join: another awaitable failed too, while %s: %s is raised: %s: %s", type(first).__name__,
                          str(first).splitlines()[0] if str(first) else "", type(other).__name__, other)
        raise first
    return [t.result() for t in tasks]
