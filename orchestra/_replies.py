"""Reply completion: a call's replies resolved in one batch instead of one event-loop wake-up per Ray reference.

Awaiting an ``ObjectRef`` (``ref.future()`` / ``await ref``) costs, for every rank of every call, a deserialization
and a Python callback on Ray's I/O thread, a concurrent future and a loop wake-up: 0.10–0.16 ms more controller
CPU per reply than a synchronous ``ray.get`` here, on the thread that also receives every other reply. ``batched``
hands all of one call's reply refs to a *reply lane*, a thread that fetches them with one blocking ``ray.get`` (as a
synchronous controller would), then resolves every reply future in one loop callback (``python -m bench.replies``
compares the three ways on the same actors). A reply that is a frame (``Host._reply``) is unpickled there too, off
the event loop (``_frame.read_reply``; a per-ref reply on Ray's thread, ``one``).

Replies not back within ``FAST_WINDOW_S`` (a long call: a training step, a generation), and a call whose ranks
failed, go to Ray's per-ref async callbacks: a long call never holds a lane, every rank's reply gets its own
outcome, and a failing rank is reported at most the window later (the replies already fetched are then fetched and
unpickled again, once each: a cost paid only by a call that failed). When every lane is busy the call takes the
per-ref path at once: batching never queues a call. Lanes start when first needed and stop at ``stop()``
(``orc.shutdown()``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Any

import ray

from . import _backend, _frame

__all__ = ["FAST_WINDOW_S", "MIN_BATCH", "batched", "one", "quiesce", "stop"]

log = logging.getLogger("orchestra")

FAST_WINDOW_S = 0.05  # how long one batch waits for replies before handing them to per-ref callbacks
MIN_BATCH = 2  # a lane beats per-ref completion from 2 replies, not at 1 (python -m bench.replies)
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
        while True:
            item = self.items.get()
            if item is None:
                return
            loop, outcomes = item[0], None
            try:
                outcomes = _batch(*item)  # module-level, looked up per batch (tests wrap it)
            finally:
                _give_back(self)  # out of Ray, free again before it delivers: the caller's next call finds it free
            if outcomes is not None:
                _call_soon(loop, _deliver, outcomes)
            del item, loop, outcomes  # hold no call's replies (nor its loop) while waiting for the next


def batched(refs: list[Any]) -> list[asyncio.Future] | None:
    """Futures on the running loop for ``refs`` (one call's replies), resolved together; None when the per-ref
    path is as good (fewer than ``MIN_BATCH`` refs) or every reply lane is busy (batching never queues a call)."""
    global _busy
    if len(refs) < MIN_BATCH or not all(isinstance(r, ray.ObjectRef) for r in refs):
        return None
    loop = asyncio.get_running_loop()
    pairs = [(r, loop.create_future()) for r in refs]
    with _lock:  # taken and fed under one lock: ``stop`` cannot end the lane in between
        if _free:
            lane = _free.pop()
        elif len(_lanes) < _THREADS:
            lane = _Lane()
            _lanes.append(lane)
        else:
            return None
        _busy += 1
        lane.items.put((loop, pairs))
    return [f for _, f in pairs]


def _give_back(lane: _Lane) -> None:
    """``lane`` is out of Ray and free for the next batch (unless ``stop`` ended it meanwhile)."""
    global _busy
    with _lock:
        _busy -= 1
        if lane in _lanes:
            _free.append(lane)
        if _busy == 0:
            _idle.notify_all()


def quiesce(timeout: float = 2.0) -> bool:
    """Wait (blocking) until no reply lane is inside Ray, so that Ray can be shut down under none of them; each
    leaves within ``FAST_WINDOW_S`` plus one fetch. True when none is left."""
    with _lock:
        return _idle.wait_for(lambda: _busy == 0, timeout)


def stop(timeout: float = 2.0) -> None:
    """End every reply lane (each after the batch it is on, if any) and wait up to ``timeout`` for their threads;
    later calls start new ones."""
    with _lock:
        lanes = list(_lanes)
        _lanes.clear()
        _free.clear()
    for lane in lanes:
        lane.items.put(None)
    for lane in lanes:
        lane.thread.join(timeout)
        if lane.thread.is_alive():
            log.warning("orchestra: a reply thread did not end within %.1f s of shutdown", timeout)


def _batch(loop: asyncio.AbstractEventLoop,
           pairs: list[tuple[Any, asyncio.Future]]) -> list[tuple[asyncio.Future, Any, BaseException | None]] | None:
    """In a reply lane: every ref fetched within the window, as outcomes to deliver in one loop callback. If they
    are not all back by then, or one failed, each goes the per-ref way instead (a failure gets its own rank's
    error; None is returned): registered here, while the lane still counts as inside Ray, so that
    ``orc.shutdown()`` cannot end Ray in between."""
    try:
        values = ray.get([r for r, _ in pairs], timeout=FAST_WINDOW_S)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):  # late or failed: each ref on its own
        try:
            for ref, fut in pairs:
                _per_ref(loop, ref, fut)
        except BaseException as e:  # noqa: BLE001 - Ray failed under us: the replies left fail with its error
            log.debug("orchestra: per-ref reply completion failed (%r)", e)
            return [(f, None, e) for _, f in pairs]  # _deliver skips those already resolved
        return None
    except BaseException as e:  # noqa: BLE001 - Ray itself failed: every reply fails with that error
        log.debug("orchestra: batched reply fetch failed (%r)", e)
        return [(f, None, e) for _, f in pairs]
    return [_read(f, v) for (_, f), v in zip(pairs, values)]


def _read(fut: asyncio.Future, value: Any) -> tuple[asyncio.Future, Any, BaseException | None]:
    """The outcome of one reply: its frame unpickled here, in the lane (``_frame.read_reply``), or why it could not."""
    try:
        return fut, _frame.read_reply(value), None
    except _backend.ReplyUnreadable as e:
        return fut, None, e


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is left to read these replies
        log.debug("orchestra: event loop closed before replies were delivered")


def _deliver(outcomes: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for fut, value, error in outcomes:
        if fut.done():
            continue
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)


def one(ref: Any) -> asyncio.Future:
    """A future on the running loop for one reply ``ref``, its frame read (``_frame.read_reply``): Ray's per-ref
    completion for an ObjectRef; an in-process reply (never a frame) as it comes."""
    if not isinstance(ref, ray.ObjectRef):
        return asyncio.wrap_future(ref.future())
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    _per_ref(loop, ref, fut)
    return fut


def _per_ref(loop: asyncio.AbstractEventLoop, ref: Any, fut: asyncio.Future) -> None:
    """Resolve ``fut`` (on ``loop``) from Ray's own async completion of ``ref``: one callback for this ref. A frame
    is read on Ray's thread, where Ray deserialized the reply, not on the event loop."""
    def done(src: concurrent.futures.Future) -> None:  # on Ray's thread
        if src.cancelled():
            _call_soon(loop, _cancel, fut)
        elif src.exception() is not None:
            _call_soon(loop, _deliver, [(fut, None, src.exception())])
        else:
            _call_soon(loop, _deliver, [_read(fut, src.result())])

    ref.future().add_done_callback(done)


def _cancel(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.cancel()
