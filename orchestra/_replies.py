"""Reply completion: a call's replies resolved in one batch instead of one event-loop wake-up per Ray reference.

Awaiting an ``ObjectRef`` (``ref.future()`` / ``await ref``) costs a Ray async-get callback, a concurrent future
and a loop wake-up for every rank of every call: about 0.2 ms of controller CPU per reply here (``bench.scaling``,
``*_per_ref`` columns). ``batched`` hands all of one call's reply refs to a thread that waits for them with
one ``ray.wait`` and fetches them with one ``ray.get``, then resolves every reply future in one loop callback.

Replies not back within ``FAST_WINDOW_S`` (a long call: a training step, a generation) go to Ray's per-ref async
callbacks, so a long call never holds a thread and the extra latency of a failing rank is at most the window.
When every reply thread is busy the call takes the per-ref path at once: batching never queues a call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

__all__ = ["FAST_WINDOW_S", "MIN_BATCH", "batched", "quiesce"]

log = logging.getLogger("orchestra")

FAST_WINDOW_S = 0.05  # how long one batch waits for replies before handing the rest to per-ref callbacks
MIN_BATCH = 8  # below this many replies the thread hop costs about what it saves (bench.scaling, per_ref columns)
_THREADS = 8

_lock = threading.Lock()
_busy = 0
_idle = threading.Condition(_lock)
_pool: ThreadPoolExecutor | None = None


def batched(refs: list[Any]) -> list[asyncio.Future] | None:
    """Futures on the running loop for ``refs`` (one call's replies), resolved together; None when the per-ref
    path is as good (fewer than ``MIN_BATCH`` refs) or every reply thread is busy (batching never queues a call)."""
    if len(refs) < MIN_BATCH or not all(isinstance(r, ray.ObjectRef) for r in refs) or not _take_thread():
        return None
    loop = asyncio.get_running_loop()
    pairs = [(r, loop.create_future()) for r in refs]
    try:
        _executor().submit(_batch, loop, pairs)
    except RuntimeError:  # the pool is shutting down (interpreter exit): the per-ref path still works
        _give_thread()
        return None
    return [f for _, f in pairs]


def _take_thread() -> bool:
    global _busy
    with _lock:
        if _busy >= _THREADS:
            return False
        _busy += 1
        return True


def _give_thread() -> None:
    global _busy
    with _lock:
        _busy -= 1
        if _busy == 0:
            _idle.notify_all()


def quiesce(timeout: float = 2.0) -> bool:
    """Wait (blocking) until no reply thread is inside Ray, so that Ray can be shut down under none of them; each
    leaves within ``FAST_WINDOW_S`` plus one fetch. True when none is left."""
    with _lock:
        return _idle.wait_for(lambda: _busy == 0, timeout)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="orchestra-replies")
        return _pool


def _batch(loop: asyncio.AbstractEventLoop, pairs: list[tuple[Any, asyncio.Future]]) -> None:
    """In a reply thread: wait up to the window for every ref, fetch the ready ones together, deliver once."""
    resolved: list[tuple[asyncio.Future, Any, BaseException | None]] = []
    rest = pairs
    try:
        refs = [r for r, _ in pairs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=FAST_WINDOW_S, fetch_local=True)
        ready_set = set(ready)
        now = [(r, f) for r, f in pairs if r in ready_set]
        rest = [(r, f) for r, f in pairs if r not in ready_set]
        if now:
            try:
                values = ray.get([r for r, _ in now])
                resolved = [(f, v, None) for (_, f), v in zip(now, values)]
            except BaseException:  # noqa: BLE001 - one of them failed: fetch one by one to give each its own
                for r, f in now:
                    try:
                        resolved.append((f, ray.get(r), None))
                    except BaseException as e:  # noqa: BLE001 - delivered to that reply's future
                        resolved.append((f, None, e))
    except BaseException as e:  # noqa: BLE001 - Ray shut down or failed: every ref goes the per-ref way
        log.debug("orchestra: batched reply wait failed (%r); per-ref completion", e)
        resolved, rest = [], pairs
    finally:
        _give_thread()
    try:
        loop.call_soon_threadsafe(_deliver, resolved, rest)
    except RuntimeError:  # the loop is closed: nobody is left to read these replies
        log.debug("orchestra: event loop closed before %d replies were delivered", len(pairs))


def _deliver(resolved: list[tuple[asyncio.Future, Any, BaseException | None]],
             rest: list[tuple[Any, asyncio.Future]]) -> None:
    for fut, value, error in resolved:
        if fut.done():
            continue
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
    for ref, fut in rest:
        _per_ref(ref, fut)


def _per_ref(ref: Any, fut: asyncio.Future) -> None:
    """Resolve ``fut`` from Ray's own async completion of ``ref`` (one callback for this ref)."""
    if fut.done():
        return
    src = asyncio.wrap_future(ref.future())
    src.add_done_callback(lambda s: _copy(s, fut))


def _copy(src: asyncio.Future, fut: asyncio.Future) -> None:
    if fut.done():
        if not src.cancelled():
            src.exception()  # retrieved: the reply's own future already has its outcome
        return
    if src.cancelled():
        fut.cancel()
    elif src.exception() is not None:
        fut.set_exception(src.exception())
    else:
        fut.set_result(src.result())
