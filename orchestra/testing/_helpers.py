"""Helpers for tests of Workers, dispatch transforms and pipeline steps: order events across ranks (``Sequencer``),
make a rank fail (``FailOnCue`` + ``fail_rank``) or die (``kill_rank``) on cue.

Nothing here imports pytest: worker processes unpickle a ``Sequencer`` and import a Worker that mixes in
``FailOnCue``, and need not have pytest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from .. import _backend
from .._errors import WorkerDiedError
from ._sequencer_state import POLL_S
from .._host import CallCancelled as _CallCancelled
from .._group import WorkerGroup
from .._invocation import convert_error
from .._worker import Worker, endpoint, endpoints_of
from ..dispatch import broadcast
from ._sequencer_state import SequencerHost as _SequencerHost
from ._sequencer_state import ThreadSequencerState as _ThreadSequencerState

__all__ = ["FailOnCue", "InjectedFailure", "Sequencer", "SequencerError", "fail_rank", "kill_rank"]

log = logging.getLogger("orchestra")


# ------------------------------------------------------------------------------------------------------ Sequencer
class SequencerError(RuntimeError):
    """A sequencer position could not be entered: it timed out, was entered twice, or an earlier position failed."""


class Sequencer:
    """Runs blocks of code in a fixed global order across processes: ``with seq(i): ...`` (in a Worker) or
    ``async with seq(i): ...`` (in the test or an async endpoint) enters only after every position below ``i``
    has exited. Positions count from 0; each is used once.

    Backed by a small Ray actor, so a Sequencer can be passed to endpoints as an argument and used by every rank;
    every Sequencer this process makes on one cluster is a sequence of its own on one such actor (started with the
    first), so a new Sequencer costs no process start.
    A block that raises breaks the sequence: every waiting and later position fails with ``SequencerError``
    instead of waiting forever; so does a position still waiting after ``timeout`` seconds (a bound on a broken
    test, never what decides a passing one). A wait that ends before its block runs (cancelled, timed out) gives its
    position back: it was never entered, so it may be waited for again. Make one with ``Sequencer()`` after
    ``orc.init()`` (or use the ``orc_sequencer`` fixture); ``close()`` breaks its sequence (its waiting positions
    fail; a blocking round trip).
    Under the in-process backend (``backend="local"``, the default after ``orc.init(backend="local")``) it is a
    thread-safe object in this process instead.
    """

    def __init__(self, timeout: float = 60.0, *, backend: str | None = None) -> None:
        self.timeout = float(timeout)
        name = backend or _backend.current().name
        if name == "local":
            self._local: _ThreadSequencerState | None = _ThreadSequencerState()
            self._actor = None
            return
        if not ray.is_initialized():
            raise RuntimeError("Sequencer() needs a running Ray cluster: call orc.init() first (or use the orc_cluster "
                               "fixture); for groups of the in-process backend use Sequencer(backend='local')")
        self._local = None
        self._id = uuid.uuid4().hex
        self._actor = _sequencer_host()
        self._given_back: list[tuple[int, str]] = []  # waits given up here, sent again with this copy's next wait

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_given_back"] = []  # this process's own: another process's copy has its own waits
        return state

    def __call__(self, position: int) -> _Turn:
        """The block at ``position``: use it as ``with`` (blocking, e.g. in a sync endpoint) or ``async with``."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"a sequencer position is an int >= 0, got {position!r}")
        return _Turn(self, position)

    def position(self) -> int:
        """The position that may run now (blocking round trip)."""
        if self._local is not None:
            return self._local.position()
        return _on_host(self, lambda: ray.get(self._actor.position.remote(self._id)))

    def close(self) -> None:
        """Break the sequence, so no one waits on it: every waiting and later position raises SequencerError."""
        if self._local is not None:
            self._local.close()
            return
        try:
            ray.get(self._actor.close.remote(self._id))
        except ray.exceptions.RayActorError:
            log.debug("Sequencer.close(): its actor is gone, and its sequence with it")
            _forget_host(self._actor)

    def __repr__(self) -> str:
        return f"<Sequencer timeout={self.timeout:g}>"


class _Turn:
    """One use of a position. A wait that ends before its block runs (cancelled, interrupted) gives the position
    back: it was never entered, so the sequence neither counts it as entered nor waits for it to exit."""

    def __init__(self, seq: Sequencer, pos: int) -> None:
        self.seq, self.pos = seq, pos

    @staticmethod
    def _check(status: tuple[str, str]) -> None:
        if status[0] == "cancelled":  # the call this wait runs in was cancelled: it ends, as a cancelled call does
            raise _CallCancelled(status[1])
        if status[0] != "ok":
            raise SequencerError(status[1])

    def _give_back_on_host(self, ticket: str) -> None:
        """Tell the actor this wait was given up (not awaited: the caller is being cancelled); the next wait of this
        Sequencer says so again, since calls to an async actor run in no guaranteed order."""
        seq = self.seq
        seq._given_back.append((self.pos, ticket))
        ref = seq._actor.give_back.remote(seq._id, self.pos, ticket)
        ref.future().add_done_callback(lambda f, pos=self.pos: _gave_back(f, pos))

    def _send_enter(self, ticket: str) -> Any:
        seq = self.seq
        given_back, seq._given_back = tuple(seq._given_back), []
        return seq._actor.enter.remote(seq._id, self.pos, seq.timeout, ticket, given_back)

    def __enter__(self) -> None:
        local, ticket = self.seq._local, uuid.uuid4().hex
        cancelled = _call_cancelled()
        try:
            if local is not None:
                status = local.enter(self.pos, self.seq.timeout, ticket, cancelled)
            else:
                ref = self._send_enter(ticket)
                while cancelled is not None and not ray.wait([ref], timeout=POLL_S)[0]:
                    if cancelled():  # its call was cancelled: give the position back, end the call
                        self._give_back_on_host(ticket)
                        status = self._cancelled_status()
                        break
                else:
                    status = _on_host(self.seq, lambda: ray.get(ref))
                    if status[0] == "ok" and cancelled is not None and cancelled():  # let in as it was cancelled
                        self._give_back_on_host(ticket)
                        status = self._cancelled_status()
        except BaseException:  # interrupted while waiting (e.g. KeyboardInterrupt): the block never runs
            if local is not None:
                local.give_back(self.pos, ticket)
            else:
                self._give_back_on_host(ticket)
            raise
        self._check(status)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        err = None if exc_type is None else f"{exc_type.__name__}: {exc}"
        local = self.seq._local
        if local is not None:
            self._check(local.exit(self.pos, err))
        else:
            seq = self.seq
            self._check(_on_host(seq, lambda: ray.get(seq._actor.exit.remote(seq._id, self.pos, err))))

    def _cancelled_status(self) -> tuple[str, str]:
        return "cancelled", (f"cancelled while it waited for Sequencer position {self.pos}; the position was given "
                             f"back and the block did not run")

    async def __aenter__(self) -> None:
        local, ticket = self.seq._local, uuid.uuid4().hex
        cancelled = _call_cancelled()  # inside an endpoint: its call's cancellation, polled while waiting
        if local is not None:
            refused = local.arrive(self.pos, ticket)  # taken before the wait starts, so a cancellation can give it back
            if refused:
                self._check(refused)
            try:  # on this loop, no thread: any number of waits may wait at once
                status = await local.await_turn(self.pos, ticket, self.seq.timeout, cancelled)
            except BaseException:  # cancelled before its turn (or as it came)
                local.give_back(self.pos, ticket)
                raise
        else:
            reply = asyncio.wrap_future(self._send_enter(ticket).future())
            try:
                while True:
                    done, _ = await asyncio.wait([reply], timeout=None if cancelled is None else POLL_S)
                    if done:
                        status = await _on_host_async(self.seq, reply)
                        if status[0] == "ok" and cancelled is not None and cancelled():  # let in as it was cancelled
                            self._give_back_on_host(ticket)
                            status = self._cancelled_status()
                        break
                    if cancelled():  # its call was cancelled: give the position back, end the call
                        reply.cancel()
                        self._give_back_on_host(ticket)
                        status = self._cancelled_status()
                        break
            except BaseException:  # cancelled: the actor's wait goes on unless told
                reply.cancel()
                self._give_back_on_host(ticket)
                raise
        self._check(status)

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        err = None if exc_type is None else f"{exc_type.__name__}: {exc}"
        local = self.seq._local
        if local is not None:
            self._check(local.exit(self.pos, err))
        else:
            seq = self.seq
            self._check(await _on_host_async(seq, seq._actor.exit.remote(seq._id, self.pos, err)))




def _call_cancelled() -> Callable[[], bool] | None:
    """How the call running on this thread learns it was cancelled (what ``Worker.cancelled()`` asks), when this
    thread runs an endpoint: the in-process rank's Host of this lane, or the Ray actor's Host in a worker process.
    None elsewhere (the test body, a thread of the user's): such a wait is ended by cancelling its task."""
    from .._host import Host, process_host
    from .._local import current_host

    host = current_host() or process_host()
    return host.is_cancelled if isinstance(host, Host) else None


def _gave_back(f: Any, pos: int) -> None:
    """Done callback of a give-back call: its failure is logged (the actor is gone, and the sequence with it: the
    next use of the Sequencer raises SequencerError saying so)."""
    if not f.cancelled() and f.exception() is not None:
        log.warning("Sequencer: giving back position %d after a cancelled wait failed: %r", pos, f.exception())


_host_lock = threading.Lock()
_host: tuple[tuple[str, str], Any] | None = None  # ((job id, node id) of the cluster it runs on, its handle)


def _sequencer_host() -> Any:
    """The actor holding this process's Sequencers on the current cluster, started on first use (on this node, so
    that a test removing other nodes cannot take it away)."""
    global _host
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ctx = ray.get_runtime_context()
    key = (ctx.get_job_id(), ctx.get_node_id())
    with _host_lock:
        if _host is None or _host[0] != key:  # none yet, or one of an earlier cluster (shut down since)
            strategy = NodeAffinitySchedulingStrategy(node_id=key[1], soft=False)
            _host = (key, ray.remote(num_cpus=0)(_SequencerHost).options(scheduling_strategy=strategy).remote())
        return _host[1]


def _forget_host(handle: Any) -> None:
    """Drop a dead host, so that the next Sequencer starts a new one."""
    global _host
    with _host_lock:
        if _host is not None and _host[1] is handle:
            _host = None


def _host_died(seq: Sequencer, e: BaseException) -> SequencerError:
    _forget_host(seq._actor)
    return SequencerError(f"the actor holding this Sequencer's sequence died ({type(e).__name__}: {e}); its positions "
                          f"are lost: make a new Sequencer")


def _on_host(seq: Sequencer, fn: Any) -> Any:
    try:
        return fn()
    except ray.exceptions.RayActorError as e:
        raise _host_died(seq, e) from e


async def _on_host_async(seq: Sequencer, ref: Any) -> Any:
    try:
        return await ref
    except ray.exceptions.RayActorError as e:
        raise _host_died(seq, e) from e


# ------------------------------------------------------------------------------------------------- fail on cue
class InjectedFailure(RuntimeError):
    """What an endpoint armed by ``fail_rank`` raises (a ``WorkerError`` with ``exc_type == "InjectedFailure"`` in
    the controller)."""


class FailOnCue(Worker):
    """Mix into a Worker (``class TestScorer(FailOnCue, Scorer)``) to let ``fail_rank`` make the next call of one
    of its endpoints raise ``InjectedFailure`` on one rank. Adds one broadcast endpoint, ``orc_fail_next``; the
    Worker's own code is unchanged."""

    @endpoint(broadcast())
    def orc_fail_next(self, name: str, rank: int, message: str) -> bool:
        """On ``rank``: the next call of endpoint ``name`` raises ``InjectedFailure(message)`` instead of running.
        Returns whether this rank was armed."""
        if name not in endpoints_of(type(self)):
            raise ValueError(f"{type(self).__name__} has no endpoint {name!r}")
        if self.rank != rank:
            return False

        def fail(*args: Any, **kwargs: Any) -> Any:
            del self.__dict__[name]  # once: later calls run the real endpoint
            raise InjectedFailure(message)

        self.__dict__[name] = fail  # shadows the method for the host's lookup of the next call
        return True


async def fail_rank(group: WorkerGroup, rank: int, endpoint: str,
                    message: str = "failure injected by orchestra.testing.fail_rank") -> None:
    """Make the next call of ``endpoint`` on ``rank`` of ``group`` raise (``WorkerError`` with
    ``exc_type == "InjectedFailure"``); the other ranks run it normally. Calls made after this returns (calls are
    sent in order) are affected. The group's Worker must mix in ``FailOnCue``."""
    if not 0 <= rank < group.world_size:
        raise ValueError(f"fail_rank: rank {rank} is outside 0..{group.world_size - 1} of {group!r}")
    getattr(group, endpoint)  # AttributeError naming the group's endpoints if there is no such endpoint
    try:
        arm = group.orc_fail_next
    except AttributeError:
        raise TypeError(f"fail_rank: {group!r} cannot fail on cue; mix orchestra.testing.FailOnCue into its Worker "
                        f"class (class TestW(FailOnCue, W): pass) and make the group from that") from None
    armed = await arm(endpoint, rank, message)
    if armed.count(True) != 1:
        raise RuntimeError(f"fail_rank: expected rank {rank} alone to be armed, got {armed}")


# ------------------------------------------------------------------------------------------------- kill on cue
def _kill_pid(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


async def kill_rank(group: WorkerGroup, rank: int, timeout: float = 60.0) -> WorkerDiedError:
    """SIGKILL the process of ``rank`` and wait (at most ``timeout`` seconds) until the group reports the death:
    returns the rank's ``WorkerDiedError`` (as ``await group.ping()`` then raises it). The group's calls in flight
    fail with ``WorkerDiedError``; new calls are refused. Other ranks may be dead already; this one may not."""
    if not 0 <= rank < group.world_size:
        raise ValueError(f"kill_rank: rank {rank} is outside 0..{group.world_size - 1} of {group!r}")
    await group.ready()
    shared = group._shared
    if rank in shared.dead:
        raise RuntimeError(f"kill_rank: rank {rank} of {group!r} is already dead ({shared.dead[rank].message}); "
                           f"nothing was killed. Kill a live rank, or make a new group")
    # where the rank runs, as it described itself at start-up: asking it now (group.describe()) would ask every
    # rank, and fail on one already dead
    info = dict(shared.info[rank])
    died = asyncio.get_running_loop().create_future()

    def on_death(err: WorkerDiedError) -> None:
        if err.rank == rank and not died.done():
            died.set_result(err)

    remove = group.on_death(on_death)
    try:
        backend = group.pool.backend
        if not backend.own_process:  # in-process: the rank dies as the controller sees a process die
            backend.kill(shared.hosts[rank])
            info["pid"] = f"{info['pid']}, in-process"
        elif info.get("node_id") in (None, ray.get_runtime_context().get_node_id()):
            _kill_pid(int(info["pid"]))
        else:  # the rank runs on another node: send the signal from there
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            killer = ray.remote(num_cpus=0)(_kill_pid).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(info["node_id"], soft=False))
            await killer.remote(int(info["pid"]))
        log.info("kill_rank: sent SIGKILL to rank %d of %r (pid %s)", rank, group.name, info["pid"])
        t0 = time.monotonic()
        try:
            err = await asyncio.wait_for(died, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"kill_rank: rank {rank} of {group!r} (pid {info['pid']}) was sent SIGKILL but the "
                               f"group did not report its death within {timeout:g} s") from None
    finally:
        remove()
    try:  # the rank's own control lane: it must fail now, with this rank's death
        await shared.hosts[rank].ping.remote()
    except Exception as e:  # noqa: BLE001 - converted: a death is what is expected, anything else is raised
        died_err = convert_error(e, group.name, "ping", rank)
        if not isinstance(died_err, WorkerDiedError):
            raise died_err from e
        log.info("kill_rank: rank %d of %r reported dead after %.2f s", rank, group.name, time.monotonic() - t0)
        return died_err
    raise AssertionError(f"kill_rank: rank {rank} of {group!r} was reported dead ({err.message}), yet its ping "
                         f"answered")
