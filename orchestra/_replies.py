"""Reply completion: a call's replies resolved in one batch instead of one event-loop wake-up per Ray reference.

Awaiting an ``ObjectRef`` (``ref.future()`` / ``await ref``) costs, for every rank of every call, a deserialization
and a Python callback on Ray's I/O thread, a concurrent future and a loop wake-up: about 0.1 ms of controller CPU
per reply here, on the thread that also receives every other reply. ``batched`` hands all of one call's reply refs
to a *reply lane*, a thread that fetches them with one blocking ``ray.get`` (as a synchronous controller would),
then resolves every reply future in one loop callback. A 4-rank no-op call then costs about what a synchronous
``ray.get`` of 4 bare calls costs (``python -m bench.scaling``, ``*_per_ref`` columns for the per-ref way).

Replies not back within ``FAST_WINDOW_S`` (a long call: a training step, a generation), and a call whose ranks
failed, go to Ray's per-ref async callbacks: a long call never holds a lane, every rank's reply gets its own
outcome, and a failing rank is reported at most the window later. When every lane is busy the call takes the
per-ref path at once: batching never queues a call. Lanes start when first needed and stop at ``stop()``
(``orc.shutdown()``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

import ray

__all__ = ["FAST_WINDOW_S", "MIN_BATCH", "batched", "quiesce", "stop"]

log = logging.getLogger("orchestra")

FAST_WINDOW_S = 0.05  # how long one batch waits for replies before handing them to per-ref callbacks
MIN_BATCH = 1  # a lane pays off from one reply (bench.scaling: a 1-rank no-op too)
_THREADS = 8  # lanes at most

_lock = threading.Lock()
_idle = threading.Condition(_lock)
_lanes: list[_Lane] = []  # every running lane
_free: list[_Lane] = []  # lanes waiting for a batch
_busy = 0  # lanes handed a batch and not yet out of Ray


class _Lane:
    """One reply thread, fed one call's replies at a time by ``batched``; ``None`` ends it."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="orchestra-replies", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (item := self.items.get()) is not None:
            _batch(*item)  # module-level, looked up per batch (tests wrap it)


def batched(refs: list[Any]) -> list[asyncio.Future] | None:
    """Futures on the running loop for ``refs`` (one call's replies), resolved together; None when the per-ref
    path is as good (fewer than ``MIN_BATCH`` refs) or every reply lane is busy (batching never queues a call)."""
    if len(refs) < MIN_BATCH or not all(isinstance(r, ray.ObjectRef) for r in refs):
        return None
    lane = _take_lane()
    if lane is None:
        return None
    loop = asyncio.get_running_loop()
    pairs = [(r, loop.create_future()) for r in refs]
    lane.items.put((loop, pairs))
    return [f for _, f in pairs]


def _take_lane() -> _Lane | None:
    global _busy
    with _lock:
        if _free:
            lane = _free.pop()
        elif len(_lanes) < _THREADS:
            lane = _Lane()
            _lanes.append(lane)
        else:
            return None
        _busy += 1
        return lane


def _give_lane() -> None:
    """The calling lane is out of Ray and free for the next batch."""
    global _busy
    with _lock:
        _busy -= 1
        lane = next((x for x in _lanes if x.thread is threading.current_thread()), None)
        if lane is not None:  # not stopped meanwhile
            _free.append(lane)
        if _busy == 0:
            _idle.notify_all()


def quiesce(timeout: float = 2.0) -> bool:
    """Wait (blocking) until no reply lane is inside Ray, so that Ray can be shut down under none of them; each
    leaves within ``FAST_WINDOW_S`` plus one fetch. True when none is left."""
    with _lock:
        return _idle.wait_for(lambda: _busy == 0, timeout)


def stop() -> None:
    """End every reply lane (each after the batch it is on, if any); later calls start new ones."""
    with _lock:
        lanes = list(_lanes)
        _lanes.clear()
        _free.clear()
    for lane in lanes:
        lane.items.put(None)


def _batch(loop: asyncio.AbstractEventLoop, pairs: list[tuple[Any, asyncio.Future]]) -> None:
    """In a reply lane: fetch every ref within the window and deliver them in one loop callback; if they are not
    all back by then, or one failed, each goes the per-ref way (a failure gets its own rank's error)."""
    resolved: list[tuple[asyncio.Future, Any]] = []
    rest = pairs
    try:
        values = ray.get([r for r, _ in pairs], timeout=FAST_WINDOW_S)
        resolved, rest = [(f, v) for (_, f), v in zip(pairs, values)], []
    except BaseException as e:  # noqa: BLE001 - late, failed, or Ray shut down: every ref goes the per-ref way
        if not isinstance(e, (ray.exceptions.GetTimeoutError, ray.exceptions.RayError)):
            log.debug("orchestra: batched reply fetch failed (%r); per-ref completion", e)
    finally:
        _give_lane()
    try:
        loop.call_soon_threadsafe(_deliver, resolved, rest)
    except RuntimeError:  # the loop is closed: nobody is left to read these replies
        log.debug("orchestra: event loop closed before %d replies were delivered", len(pairs))


def _deliver(resolved: list[tuple[asyncio.Future, Any]], rest: list[tuple[Any, asyncio.Future]]) -> None:
    for fut, value in resolved:
        if not fut.done():
            fut.set_result(value)
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
