"""WorkerGroup: one actor per rank of a pool, seen from the controller as one object whose endpoints return futures."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import ray

from . import _channel, _runtime, _stats, _template
from ._batch import Batch
from ._errors import DECLARED_DEAD, CallCancelledError, DispatchError, GroupClosedError, WorkerDiedError
from ._future import DataFuture
from ._host import CONCURRENCY_GROUPS, host_class, method_name
from ._invocation import Invocation, check_forwarded, closed_error, convert_error
from ._pool import ResourcePool
from ._worker import EndpointSpec, MeshInfo, Worker, endpoints_of
from .dispatch import Plan, check_final, every_rank
from .dispatch import stream as stream_transform

__all__ = ["WorkerGroup"]

UNSEEN_KEPT = 64  # failed calls nothing awaited, kept per group for failed_calls_not_awaited()
EXIT_WAIT_S = 30.0  # how long closing a group waits for its killed ranks' processes to exit (then warns)


def _log_unseen(inv: Any) -> None:
    log.error("group %r, endpoint %r: a call failed and nothing awaited it (nor read its result): %r",
              inv.group, inv.endpoint, inv.outcome_as_awaited())

log = logging.getLogger("orchestra")


class _Gate:
    """Calls on a group's actors are sent in the order they were made. A call that must wait before sending (a
    mesh lookup, an upstream stream still producing) holds back the later ones, so that every rank sees the same
    sequence of calls: collectives on those ranks then always pair up."""

    def __init__(self) -> None:
        self._next = 0
        self._open = 0
        self._done: set[int] = set()
        self._waiters: dict[int, asyncio.Future] = {}
        self._hurry: dict[int, asyncio.Future] = {}  # ticket -> done once a later ticket waits (see ``later``)

    def ticket(self) -> int:
        t = self._next
        self._next += 1
        return t

    def is_turn(self, ticket: int) -> bool:
        return self._open == ticket

    def later(self, ticket: int) -> asyncio.Future:
        """A future that is done once a call after ``ticket`` waits for its turn: a call holding its turn while it
        waits for something (a reading call, for a fast-path reply) sends itself at once then, so that it holds
        back no later call (which the thing it waits for may itself be waiting for)."""
        f = self._hurry.get(ticket)
        if f is None:
            f = self._hurry[ticket] = asyncio.get_running_loop().create_future()
            if any(t > ticket for t in self._waiters):
                f.set_result(None)
        return f

    async def turn(self, ticket: int) -> None:
        if self._open < ticket:
            for t, f in self._hurry.items():
                if t < ticket and not f.done():
                    f.set_result(None)
            w = self._waiters[ticket] = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                self._waiters.pop(ticket, None)

    def release(self, ticket: int) -> None:
        if ticket < self._open or ticket in self._done:  # idempotent
            return
        self._done.add(ticket)
        self._hurry.pop(ticket, None)
        while self._open in self._done:
            self._done.discard(self._open)
            self._open += 1
        w = self._waiters.get(self._open)
        if w is not None and not w.done():
            w.set_result(None)


class _Shared:
    """The actors of a group (shared by the role views of a colocated group), their start-up, the calls in flight
    (``live``) and the group's end: ``close`` cancels start-up and every call, kills the actors and lets go of
    the pool."""

    def __init__(self, pool: ResourcePool, roles: dict[str, tuple[type, tuple, dict]], name: str) -> None:
        self.pool, self.roles, self.name = pool, roles, name
        self.hosts: list[Any] = []
        self.info: list[dict] = []
        self.processes: list[dict] = []  # each rank's process (``Host.process``), known before its set-up ran
        self._close_lock = threading.Lock()  # finish_close runs once at a time: a second close waits for the first
        self._unkilled: list[Any] = []  # the actor handles a close took, still to kill (``finish_close``)
        self.meshes: dict[tuple[str, str], list[MeshInfo]] = {}
        self._start: asyncio.Task | None = None
        self._ready = False
        self.closed: str | None = None  # why the group was shut down
        self.gate = _Gate()
        self.live: weakref.WeakSet = weakref.WeakSet()  # invocations not yet finished
        # invocations that failed and that nothing has awaited (nor read) yet, oldest first, at most UNSEEN_KEPT
        self.unseen: collections.OrderedDict[int, Any] = collections.OrderedDict()
        # invocations whose parts an iteration began to read and that nothing saw to the end yet (a stream left
        # with ``break``, or still being read), oldest first, at most UNSEEN_KEPT: see streams_not_drained()
        self.undrained: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self.dead: dict[int, WorkerDiedError] = {}  # rank -> how it died (seen by the watch calls)
        self.death_callbacks: list[Callable[[WorkerDiedError], None]] = []
        # held while a death is recorded and the callbacks to tell it are read, and while a registration reads the
        # deaths already known and adds its callback: a registration from another thread's loop hears each death
        # once, either told at once or owed (it could read the deaths, then miss one recorded before it was added)
        self.deaths_lock = threading.Lock()
        self.callback_errors: list[str] = []  # what on_death callbacks raised (logged too), for death_callback_errors()
        # deaths known when a callback was registered with no event loop running there: told on the group's loop
        self._owed: list[tuple[Callable[[WorkerDiedError], None], list[WorkerDiedError]]] = []
        self._watch_refs: list[Any] = []  # one never-returning supervision call per rank
        self._watches: list[asyncio.Future] = []  # those refs wrapped for the loop the group is used from
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self.channel: _channel.Channel | None = None  # the fast path, while open (see orchestra._channel)
        self._draining: list[_channel.Channel] = []  # released channels whose ranks may still be joining or serving
        self.fast_path_off = False  # set once the raw actor handles were taken (group.actors)
        self._fast_ok: bool | None = None  # backend and placement allow it (decided once the ranks are up)
        self._streak = 0  # fast-path-eligible calls in a row
        self.fast_calls = 0  # calls sent over a channel, all channels together
        self.templates = _template.Templates()  # each endpoint's frames of its last call shape (orchestra._template)
        # this group's one reference on the pool, given back exactly once (finish_close, from any thread): another
        # group on the same pool keeps it whatever sequence of close/aclose/shutdown/failed start happens here.
        # The lock guards it and the handles a close took (``_unkilled``)
        self._pool_ref_lock = threading.Lock()
        self._holds_pool_ref = True
        self._pool_era = pool.acquire()
        _runtime.register(self)

    def home_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the group lives on now: the one supervision follows, or the one starting it."""
        if self._watch_loop is not None:
            return self._watch_loop
        return self._start.get_loop() if self._start is not None else None

    def is_ready(self) -> bool:
        return self._ready and self.closed is None

    def start(self) -> asyncio.Task:
        if self.closed is not None:
            raise closed_error(self.name, self.closed)
        if self._start is None:
            self._start = asyncio.get_running_loop().create_task(self._boot(), name=f"orchestra:{self.name}.start")
            self._start.add_done_callback(_retrieve_start)
        return self._start

    async def _boot(self) -> None:
        slots = await self.pool.slots()
        if self.closed is not None:  # shut down while placing: give back what was placed meanwhile
            if not self.pool.holds_refs():
                await anyio.to_thread.run_sync(self.pool.release)
            raise closed_error(self.name, self.closed)
        world = len(slots)
        host_cls = host_class({role: cls for role, (cls, _, _) in self.roles.items()})
        self.hosts = self.pool.backend.spawn(self.pool, host_cls, slots, self.name, CONCURRENCY_GROUPS)
        try:
            # each rank's process first: closing waits for it to exit, even when the start-up below fails
            known = await asyncio.gather(*[h.process.remote() for h in self.hosts], return_exceptions=True)
            self.processes = [p for p in known if isinstance(p, dict)]
            failed = next((p for p in known if isinstance(p, BaseException)), None)
            if failed is not None:
                raise failed
            ip, port = await self.hosts[0].address.remote()
            self.info = await asyncio.gather(*[
                h.setup.remote({"RANK": str(s.rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(s.local_rank),
                                "LOCAL_WORLD_SIZE": str(sum(1 for t in slots if t.node_id == s.node_id)),
                                "MASTER_ADDR": ip, "MASTER_PORT": str(port)}, self.roles)
                for h, s in zip(self.hosts, slots)])
        except BaseException as e:
            if self.closed is not None:
                raise closed_error(self.name, self.closed) from None
            err = convert_error(e, self.name, "__init__", None)
            self.close(f"its start-up failed: {err}")  # what health() and later calls say: which rank, and why
            await _closing(self.finish_close)
            raise err from None
        if self.closed is not None:
            raise closed_error(self.name, self.closed)
        self._watch()
        self._ready = True

    def _watch(self) -> None:
        """Supervision: one never-returning call per rank; Ray fails it when the process dies, and the done
        callback (no task) fails the group's calls in flight and tells whoever registered ``on_death``."""
        self._watch_refs = [h.watch.remote() for h in self.hosts]
        self._wrap_watches(asyncio.get_running_loop())

    def _wrap_watches(self, loop: asyncio.AbstractEventLoop) -> None:
        for rank, ref in enumerate(self._watch_refs):
            cf = ref.future()
            if cf.done():  # died while no loop was listening (between two asyncio.run): known now, not a turn later
                self._rank_exited(rank, cf)
            w = asyncio.wrap_future(cf, loop=loop)
            w.add_done_callback(lambda f, rank=rank: self._rank_exited(rank, f))
            self._watches.append(w)
        self._watch_loop = loop

    def _live_calls(self) -> list[Any]:
        """The calls in flight whose futures can still be failed: not those of an event loop that is closed (nobody
        can await them any more; ``fut.cancel()`` still ends their ranks' work)."""
        return [inv for inv in list(self.live) if not inv.loop.is_closed()]

    def follow_loop(self) -> None:
        """Move supervision to the running loop when the group is used from another one than before (a script's
        second ``asyncio.run``): the same supervision calls, their completion delivered here; the old loop's
        wrappers are cancelled on it (or die with it, when it is closed)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # sync code: nothing to deliver to
            return
        home = self.home_loop()
        if home is not None and _runtime.runs_elsewhere(home):
            return  # the group's loop runs in another thread: its channel and supervision are touched there only
        if self._draining:
            self._close_orphaned()
        if self._owed:
            self._tell_owed()
        if not self._watch_refs or self.closed is not None:
            return
        if loop is self._watch_loop:
            return
        self.before_ray_compute()  # a channel serves the loop that made it
        for w in self._watches:
            _cancel_on_its_loop(w)
        self._watches = []
        self._wrap_watches(loop)

    # -- who may read a shard call's output (Host._store cuts its parts for them) ---------------------------------
    @staticmethod
    def reader_sizes() -> tuple[int, ...]:
        """The DP sizes a shard call's output may be read at: every open group's rank count and the DP size of
        each mesh its workers registered at start or it has looked up since (a producer cuts its output's parts
        where such readers' shares start or end)."""
        sizes = set()
        for ref in list(_runtime._groups.data):  # (the WeakSet's weak references: no iteration guard per call)
            g = ref()
            if g is not None and g.closed is None and g.hosts:
                sizes.add(len(g.hosts))
                sizes.update(ms[0].dp_size for ms in list(g.meshes.values()) if ms)
                if g.info:  # meshes a worker registered in its __init__, before any call looked them up
                    sizes.update(m["dp_size"] for role in g.info[0].get("meshes", {}).values() for m in role.values())
        return tuple(sorted(sizes))

    # -- the fast path (orchestra._channel) ----------------------------------------------------------------------
    def may_use_fast_path(self) -> bool:
        """Whether this group's calls may take a fast-path channel: on by default (``ORCHESTRA_FAST_PATH=0``
        turns it off), Ray ranks (on any node: those off the controller's join over TCP), raw handles never taken,
        no rank dead."""
        if self._fast_ok is None:
            if not self._ready:
                return False
            self._fast_ok = _channel.enabled() and self.pool.backend.name == "ray"
        return self._fast_ok and not self.fast_path_off and not self.dead and self.closed is None

    def fast_channel(self) -> _channel.Channel | None:
        """The channel for a call that qualifies: the open one, or a new one once enough qualifying calls came in
        a row; None: send it through Ray (no channel is open then)."""
        self._streak += 1
        ch = self.channel
        if ch is not None:
            if ch.open and ch.loop is asyncio.get_running_loop():
                self.fast_calls += 1
                return ch
            self.before_ray_compute()  # ended by a death, or made on another event loop
            return None
        if self._streak < _channel.threshold() or not self.may_use_fast_path():
            return None
        try:
            remote = _off_this_node([i.get("node_id") for i in self.info])
            self.channel = _channel.Channel(self.hosts, self.name, remote=remote,
                                            node_ip=_node_ip() if remote else None,
                                            on_join_failed=self._fast_join_failed)
        except OSError as e:  # no socket here (temp dir path too long for one, disk full ...): Ray it is
            self._fast_ok = False
            fix = ("check that this node's address can be listened on (ray.util.get_node_ip_address())"
                   if len(remote) == len(self.hosts) else "set TMPDIR to a short writable path")
            log.warning("group %r: the fast path could not open a socket (%r); its calls go through Ray. To use "
                        "it, %s; or set ORCHESTRA_FAST_PATH=0 to silence this", self.name, e, fix)
            return None
        self.fast_calls += 1
        log.debug("group %r: fast path opened after %d qualifying calls in a row", self.name, self._streak)
        return self.channel

    def _fast_join_failed(self, ch: _channel.Channel, rank: int, error: BaseException) -> None:
        """A rank could not join channel ``ch`` (the calls sent meanwhile went through Ray, or failed as run by no
        rank): later channels would most likely fail the same way (a firewall between nodes), so the group's fast
        path is turned off. A newer channel than ``ch`` is left to be released by the group's next call (as the
        switch does), not now: its calls, written to no rank yet, may still go through Ray if it cannot join."""
        if self.closed is not None:  # the group is closing: its ranks' loops end with it, nothing to turn off
            return
        self.fast_path_off = True
        if self.channel is ch:
            self.before_ray_compute()
        log.warning("group %r: rank %d could not join the fast path (%r); the group's fast path is turned off and "
                    "its calls go through Ray. Set group.fast_path = True to try again, or ORCHESTRA_FAST_PATH=0 to "
                    "silence this", self.name, rank, getattr(error, "cause", None) or error)

    def before_ray_compute(self, keep_streak: bool = False) -> None:
        """A compute-lane call is about to go through Ray: release the channel first, so that each rank's loop
        returns after the calls already written and the Ray call runs after them, in the order calls were made.
        ``keep_streak``: the call does not end a run of qualifying calls (it needs Ray only for the replies of this
        group's own earlier calls, which would have been values over a channel)."""
        if not keep_streak:
            self._streak = 0
        ch, self.channel = self.channel, None
        if ch is not None:
            log.debug("group %r: fast path released for a call that needs Ray (%d calls sent over it)", self.name,
                      ch.sent)
            ch.release()
            if not ch.closed:  # its ranks' loops have yet to return (or to join): closed with the group at the latest
                self._draining.append(ch)
        if self._draining:
            self._close_orphaned()

    def _close_orphaned(self) -> None:
        """Close the released channels whose event loop ended (an ``asyncio.run`` that returned before their ranks
        joined or read their last frames; a loop stopped, the group now used from another): no loop serves them,
        and each of their ranks holds its compute lane, so every later call, queued behind it, would hang. Drop
        those that finished meanwhile."""
        for c in self._draining:
            if (not c.closed or c.owes_tells) and c.orphaned():
                c.release()  # closes it: its ranks' loops end, and they drop what they kept for its unread replies
        self._draining = [c for c in self._draining if not c.closed or c.owes_tells]

    def _rank_exited(self, rank: int, f: asyncio.Future) -> None:
        if f.cancelled():
            return
        e = f.exception()
        if self.closed is not None or rank in self.dead:
            return
        if e is None:  # the watch returned: the group stopped it (close), or a role declared the rank dead
            declared = f.result()
            if isinstance(declared, dict) and "declared_dead" in declared:
                self.declared_dead(rank, declared["declared_dead"])
            return
        err = convert_error(e, self.name, "watch", rank)
        if not isinstance(err, WorkerDiedError):
            log.error("group %r rank %d: supervision call failed without a death: %r", self.name, rank, e)
            return
        self._died(rank, WorkerDiedError(f"the worker process of rank {rank} died ({type(e).__name__}); "
                                         f"{self._log_hint(rank)}, then recreate the group", group=self.name,
                                         rank=rank, exc_type="WorkerDied"))

    def _log_hint(self, rank: int) -> str:
        """Where to look for why rank ``rank``'s process died: its log file (and node), as it described itself."""
        info = self.info[rank] if rank < len(self.info) else {}
        where = info.get("log")
        if not where:
            return "check its log for an OOM kill or crash"
        return (f"its log, {where} (pid {info.get('pid')}, on node {info.get('node_ip')}), ends with what it wrote "
                f"last (after a crash, each thread's Python stack); no stack there: an OOM kill or SIGKILL (see the "
                f"kernel log, dmesg)")

    def declared_dead(self, rank: int, why: str) -> None:
        """Rank ``rank`` declared itself dead (``Worker.declare_dead``): from now on it is dead to the group."""
        if self.closed is None and rank not in self.dead:
            self._died(rank, WorkerDiedError(f"rank {rank} was declared dead by its worker ({why}); recreate the "
                                             f"group", group=self.name, rank=rank, exc_type=DECLARED_DEAD))

    def first_death(self) -> tuple[int, WorkerDiedError] | None:
        """The death to report first: a process that died before a rank that declared itself dead (a peer's death
        may be what made it declare), then the lowest rank."""
        return min(self.dead.items(), key=lambda kv: (kv[1].declared, kv[0]), default=None)

    def _died(self, rank: int, err: WorkerDiedError) -> None:
        """Rank ``rank`` is dead: fail the calls in flight, refuse new ones (``dead``), tell ``on_death``."""
        with self.deaths_lock:
            if rank in self.dead:  # recorded meanwhile (the watch's reply and a ping's both say so)
                return
            self.dead[rank] = err
            callbacks = list(self.death_callbacks)
        log.warning("group %r: rank %d died", self.name, rank)
        for inv in self._live_calls():  # a group with a dead rank cannot finish any call: fail them now
            inv.fail(WorkerDiedError(err.message, group=inv.group, rank=rank, endpoint=inv.endpoint,
                                     exc_type=err.exc_type))
        for cb in callbacks:
            self._tell(cb, err)

    def _tell(self, cb: Callable[[WorkerDiedError], None], err: WorkerDiedError) -> None:
        try:
            cb(err)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - a bad callback must not stop the others: logged, and kept
            # (death_callback_errors(); make_group fails the test with it). BaseException: pytest.fail() in a
            # callback raises one, and it would otherwise end up in the event loop's log instead
            log.exception("group %r: on_death callback %r raised when told rank %d died", self.name, cb, err.rank)
            name = getattr(cb, "__qualname__", None) or repr(cb)
            self.callback_errors.append(f"{name} (told rank {err.rank} of {self.name!r} died) raised "
                                        f"{type(e).__name__}: {e}")

    def add_death_callback(self, cb: Callable[[WorkerDiedError], None]) -> None:
        """Register ``cb`` for deaths; the ranks already known dead are told to it too, once each: at once when
        registered on the group's event loop (or on a loop the group then follows), else on the group's loop when it
        runs in another thread, or on the next one the group is used from."""
        self.follow_loop()  # a death found now is told to the callbacks registered before
        with self.deaths_lock:  # a death recorded in another thread is in ``known`` or told to ``cb`` by _died
            known = [err for _, err in sorted(self.dead.items())]
            self.death_callbacks.append(cb)
        if not known:
            return
        self._owed.append((cb, known))
        home = self.home_loop()
        if home is not None and _runtime.runs_elsewhere(home):  # sync code or another thread's loop: told there
            # a loop closed meanwhile: still owed, told by the next loop the group is used from
            with contextlib.suppress(RuntimeError):
                home.call_soon_threadsafe(self._tell_owed)
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # sync code, no loop runs the group now: the next one it is used from tells it
            return
        self._tell_owed()

    def _tell_owed(self) -> None:
        """Tell the callbacks registered after some deaths of those deaths (on an event loop)."""
        owed, self._owed = self._owed, []
        for cb, errs in owed:
            for err in errs:
                if cb in self.death_callbacks:  # not if unregistered meanwhile
                    self._tell(cb, err)

    async def ready(self) -> None:
        t = self._start
        if t is not None and t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # the start-up error (e.g. a rank's __init__ failed), for every awaiter
        if t is not None and t.cancelled() and self.closed is None:
            # only the end of the loop it ran on cancels a start-up task of an open group (close() marks the
            # group closed first): what it placed or spawned may be half done, so close the group, not retry
            self.close("its start-up was cancelled when the event loop it began on ended (an asyncio.run() "
                       "that returned before ready()); make the group, and await ready(), in the loop that uses it")
            await _closing(self.finish_close)
        if self.closed is not None:
            raise closed_error(self.name, self.closed)
        self.follow_loop()
        await asyncio.shield(self.start())

    def note_unseen(self, inv: Any) -> None:
        """``inv`` failed and nothing awaited it: kept for ``failed_calls_not_awaited`` (the oldest is dropped past
        ``UNSEEN_KEPT``, with its error logged, as it is at close: a failure nobody looked at is never silent). One
        noted after the close is logged at once (the close logged the others). A call ended by ``fut.cancel()`` or
        by closing its group did not fail: the caller ended it (as ``Invocation._end`` decides for its own error)."""
        if isinstance(inv.outcome(), (CallCancelledError, GroupClosedError)):
            return
        self.unseen[id(inv)] = inv
        if self.closed is not None:
            _log_unseen(inv)
        while len(self.unseen) > UNSEEN_KEPT:
            _, old = self.unseen.popitem(last=False)
            if self.closed is None:  # after the close, every kept one was logged already
                _log_unseen(old)

    def note_undrained(self, inv: Any) -> None:
        """An iteration of ``inv``'s parts began (``Invocation.iterating``): kept until the call's outcome is seen
        (the oldest dropped past ``UNSEEN_KEPT``: for tests, not a record of every stream a program read)."""
        self.undrained[id(inv)] = inv
        self.undrained.move_to_end(id(inv))
        while len(self.undrained) > UNSEEN_KEPT:
            self.undrained.popitem(last=False)

    def close(self, why: str = "shutdown() was called") -> None:
        """Mark closed, cancel start-up and every call in flight; the actors are killed by ``finish_close``."""
        if self.closed is not None:
            return
        self.closed = why
        for inv in list(self.unseen.values()):  # logged, and kept: failed_calls_not_awaited() still lists them
            _log_unseen(inv)
        if self._start is not None and not self._start.done() and self._start is not _current_task():
            self._start.cancel()
        err = closed_error(self.name, why)
        for inv in self._live_calls():
            inv.cancel(err)
        for w in self._watches:
            _cancel_on_its_loop(w)
        self._watches.clear()
        self._watch_refs = []
        ch, self.channel = self.channel, None
        draining, self._draining = self._draining, []
        for c in [*draining, *([ch] if ch is not None else [])]:
            c.close(err)
        with self._pool_ref_lock:
            self._unkilled, self.hosts = self.hosts, []

    def end(self, why: str = "shutdown() was called") -> Callable[[], None] | None:
        """Close the group; return the blocking rest of the close (``finish_close``), to run off the event loop, or
        None once nothing is left to do. Every close that finds the rest not done runs it: the first to get there
        does the work, the others wait for it (a second close had returned at once, or ran its thread before the
        first's, killing nothing and giving the pool back while the ranks still ran)."""
        self.close(why)
        # left to do: ranks to kill or the pool to give back, or a finish_close under way (which ends by doing so)
        left = self._unkilled or self._holds_pool_ref or self._close_lock.locked()
        return self.finish_close if left else None

    def forget_pool(self) -> None:
        """The cluster this group ran on is gone (``orc.shutdown()``): its ranks and its pool's reservations ended
        with it, so closing later has nothing to give back (and must not call Ray, which would start a cluster)."""
        with self._pool_ref_lock:
            self._holds_pool_ref = False
            self._unkilled = []
        self.pool.forget()

    def finish_close(self) -> None:
        """After ``close``: kill the actors, wait until their processes on this node have exited (their memory and
        devices are free for the next group placed there: a kill returns before that; up to ``EXIT_WAIT_S``), and
        give this group's pool reference back, the first time only. Blocking: run off the event loop when on one.
        Any number of closes may call it, from any thread: the first does the work, the others return once it is
        done, so that no close returns with ranks still running or gives the pool back before they were killed."""
        with self._close_lock:
            with self._pool_ref_lock:
                hosts, self._unkilled = self._unkilled, []
            self._kill_and_release(hosts)

    def _kill_and_release(self, hosts: list[Any]) -> None:
        """``finish_close``'s work: kill, wait for the processes, give the pool reference back."""
        for h in hosts:
            try:
                self.pool.backend.kill(h)
            except Exception as e:  # noqa: BLE001 - already dead or Ray gone: nothing left to free
                log.debug("group %r: kill: %r", self.name, e)
        stopped = getattr(self.pool.backend, "wait_stopped", None)  # in-process ranks: their lanes' threads
        if hosts and stopped is not None:
            running = stopped(hosts, EXIT_WAIT_S)
            if running:
                log.warning("group %r: %s still running %.0f s after the group closed: an in-process rank's thread "
                            "cannot be killed; make the endpoint return when self.cancelled() is True", self.name,
                            ", ".join(running), EXIT_WAIT_S)
        if hosts and self.processes:
            left = self.pool.backend.wait_exited(self.processes, EXIT_WAIT_S)
            if left:
                log.warning("group %r: rank(s) %s (pid %s) still running %.0f s after they were killed; their "
                            "memory and devices may still be held", self.name, [r.get("rank") for r in left],
                            [r.get("pid") for r in left], EXIT_WAIT_S)
        with self._pool_ref_lock:
            mine, self._holds_pool_ref = self._holds_pool_ref, False
        if mine:
            self.pool.release_ref(self._pool_era)


async def _closing(fn: Callable[[], None]) -> None:
    """Run the blocking rest of a close (``finish_close``) in a worker thread of its own. It may wait up to
    ``EXIT_WAIT_S`` for ranks to end, so it must not take one of anyio's default threads (40 per event loop, shared
    with every other blocking step of the loop's calls): with 40 closes waiting, the 41st close, or the step whose end
    lets their ranks end, would never start."""
    await anyio.to_thread.run_sync(fn, limiter=anyio.CapacityLimiter(1))


def _off_this_node(node_ids: list[Any]) -> frozenset[int]:
    """The ranks that run on another node than the controller's (a fast-path socket to them is a TCP one); every
    rank when the controller has no node id."""
    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception as e:  # noqa: BLE001 - no node context: every rank counts as remote
        log.debug("fast path: no node id here: %r", e)
        here = None
    return frozenset(r for r, n in enumerate(node_ids) if here is None or n != here)


def _node_ip() -> str:
    """The address Ray uses for this node: where ranks on other nodes reach the controller's fast-path socket."""
    return ray.util.get_node_ip_address()


def _runs_here(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is the event loop running in this thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _refuse_off_its_loop(shared: Any, what: str, fix: str) -> None:
    """Refuse ``what`` (RuntimeError, nothing changed) while the group's event loop runs in another thread: its
    calls and supervision live there, and are touched from that thread only."""
    loop = shared.home_loop()
    if loop is not None and _runtime.runs_elsewhere(loop):
        raise RuntimeError(f"{what} in thread {threading.current_thread().name!r}, but the group's event loop runs "
                           f"in another thread, where its calls and supervision live; nothing was changed. {fix}")


def _cancel_on_its_loop(f: asyncio.Future) -> None:
    """Cancel ``f`` on the loop it belongs to: here, or scheduled there; nothing when that loop is closed."""
    loop = f.get_loop()
    if loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        f.cancel()
    else:
        loop.call_soon_threadsafe(f.cancel)


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (shutdown() from sync code)
        return None


def _retrieve_start(t: asyncio.Task) -> None:
    if not t.cancelled():
        t.exception()  # raised to every awaiter of ready(); retrieved here so asyncio does not log it


class WorkerGroup:
    """The ranks of a pool running one Worker class; endpoints appear as methods that return DataFutures.

    ``WorkerGroup(pool, Cls, *init_args, group_name=..., **init_kwargs)`` returns at once; actors start in the
    background (``await group.ready()`` waits for them). Use it as ``async with WorkerGroup(...) as g:`` or end it
    with ``await g.aclose()`` / ``g.shutdown()``: calls in flight then fail with ``GroupClosedError``, the actors
    are killed, and the pool is released once no group uses it. ``WorkerGroup.colocate`` puts several roles in
    one process per rank.
    """

    def __init__(self, pool: ResourcePool, cls: type[Worker], *args: Any, group_name: str | None = None,
                 **kwargs: Any) -> None:
        _check_worker_class(cls)
        name = group_name or cls.__name__
        self._init(_Shared(pool, {name: (cls, args, kwargs)}, name), name, cls)

    def _init(self, shared: _Shared, role: str, cls: type) -> None:
        self._shared, self._role, self._cls = shared, role, cls
        self._endpoints = endpoints_of(cls)
        self._callers: dict[str, _Endpoint] = {}
        self._method_names: dict[str, str] = {}  # endpoint -> its Host method (``_method_name``)
        try:
            asyncio.get_running_loop()
            shared.start()
        except RuntimeError:
            pass  # no loop yet: start on the first await

    @classmethod
    def colocate(cls, pool: ResourcePool, classes: Mapping[str, type[Worker]], *, group_name: str | None = None,
                 **init: Any) -> dict[str, WorkerGroup]:
        """One process per rank holding every role; returns a view per role (sharing the actors).

        Init arguments go by role name: ``colocate(pool, {"actor": A, "critic": C}, actor={"lr": 1e-3})`` — a
        dict is keyword arguments, a tuple or list positional ones.
        """
        unknown = set(init) - set(classes)
        if unknown:
            raise TypeError(f"colocate: init arguments for unknown role(s) {sorted(unknown)}; roles are "
                            f"{sorted(classes)}")
        roles = {}
        for role, klass in classes.items():
            _check_worker_class(klass)
            a = init.get(role, {})
            args, kwargs = ((), dict(a)) if isinstance(a, Mapping) else (tuple(a), {})
            roles[role] = (klass, args, kwargs)
        shared = _Shared(pool, roles, group_name or "+".join(classes))
        views = {}
        for role, klass in classes.items():
            v = cls.__new__(cls)
            v._init(shared, role, klass)
            views[role] = v
        return views

    # -- properties -----------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The group's name as used in errors and traces (``group/role`` for colocated roles)."""
        return self._role if self._shared.name == self._role else f"{self._shared.name}/{self._role}"

    @property
    def role(self) -> str:
        return self._role

    @property
    def world_size(self) -> int:
        return self._shared.pool.world_size

    @property
    def pool(self) -> ResourcePool:
        return self._shared.pool

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, one per rank (after ``ready()``). Taking them turns the group's fast path off
        (``fast_path``): a direct call on a handle's compute lane would otherwise wait behind the fast path's loop."""
        self.fast_path = False
        return list(self._shared.hosts)

    @property
    def fast_path(self) -> bool:
        """This group's fast-path switch (``orchestra._channel``; True by default). True lets its repeated small
        calls take the fast path where it applies (a Ray group, ``ORCHESTRA_FAST_PATH`` not 0; never on the
        in-process backend). A rank that cannot join a channel (e.g. a firewall between its node and the
        controller's) sets it to False, with a warning. Set it to False to send every call through Ray: an open channel
        is released first, after the calls already written. The switch is the group's (colocated roles share it).
        Taking ``actors`` sets it to False; set it back to True only while you make no compute-lane call on those
        handles yourself (such a call would wait until the group's next call that needs Ray)."""
        return not self._shared.fast_path_off

    @fast_path.setter
    def fast_path(self, on: bool) -> None:
        shared = self._shared
        shared.fast_path_off = not on
        if not on:
            shared.before_ray_compute()  # the ranks' loops return before anything else reaches their lanes

    @property
    def closed(self) -> bool:
        """True once the group was shut down."""
        return self._shared.closed is not None

    async def ready(self) -> WorkerGroup:
        """Wait until every rank's worker is constructed; raises the first construction error."""
        await self._shared.ready()
        return self

    async def _control(self, method: str, *args: Any) -> list[Any]:
        """One control-lane call per rank; a dead rank is a WorkerDiedError naming this group and the rank."""
        return self._answers(method, await self._gather(method, *args))

    async def _gather(self, method: str, *args: Any) -> list[Any]:
        """Every rank's answer to control call ``method``, or the exception it raised, in rank order."""
        await self.ready()
        return await asyncio.gather(*[getattr(h, method).remote(*args) for h in self._shared.hosts],
                                    return_exceptions=True)

    def _answers(self, method: str, results: list[Any]) -> list[Any]:
        """A control call's answers, or the error of the first rank that failed or is dead."""
        for rank, r in enumerate(results):
            if isinstance(r, BaseException):
                if self._shared.closed is not None:
                    raise closed_error(self.name, self._shared.closed) from None
                raise convert_error(r, self.name, method, rank) from None
        death = self._shared.first_death()  # a rank declared dead still answers, but it is dead
        if death is not None:
            rank, err = death
            raise WorkerDiedError(err.message, group=self.name, rank=rank, endpoint=method, exc_type=err.exc_type)
        return list(results)

    async def describe(self) -> list[dict[str, Any]]:
        """Per rank: rank, local rank, node, pid, log file (``log``: the process's stderr, None in-process), bundle,
        devices, roles and registered meshes."""
        return await self._control("describe")

    async def stats(self) -> list[dict[str, dict[str, float]]]:
        """Per rank, per endpoint of this role: calls (begun), errors, cancelled, parts/rows/bytes fetched and
        produced, seconds."""
        return await self._control("stats", self._role)

    async def reset_stats(self) -> None:
        """Zero this role's counters on every rank (a colocated role's are its own: they stay)."""
        await self._control("reset_stats", self._role)

    async def set_tracing(self, enabled: bool = True) -> None:
        """Record a span per call on every rank (and the parts each fetched and produced) for ``orchestra.Tracer``."""
        await self._control("set_tracing", enabled)

    async def take_events(self) -> list[tuple[int, list[dict]]]:
        """Per rank, (pid, spans recorded since the last take)."""
        return await self._control("take_events")

    def health(self) -> list[dict[str, Any]]:
        """Per rank, what supervision knows now (no round trip): ``{"rank", "ready", "alive", "error"}``. ``ready``:
        the group started (before ``ready()`` finished a rank is neither alive nor failed: ``error`` is None). A
        death is seen within about a second of the process exiting, whatever the controller is awaiting."""
        shared = self._shared
        shared.follow_loop()
        ready = shared.is_ready()
        return [{"rank": r, "ready": ready, "alive": shared.closed is None and r not in shared.dead and ready,
                 "error": str(shared.dead[r]) if r in shared.dead else shared.closed}
                for r in range(self.world_size)]

    def failed_calls_not_awaited(self) -> list[str]:
        """``"group.endpoint: error"`` of every call of this group (every colocated role's) that failed and that
        nothing awaited, nor read as an input of another call; oldest first (the 64 most recent). For tests that
        check no failure went unnoticed (the ``make_group`` fixture fails a test that leaves one); a group logs these
        when it closes, and still lists them after."""
        return [f"{inv.group}.{inv.endpoint}: {inv.outcome_as_awaited()!r}"
                for inv in list(self._shared.unseen.values())]

    def streams_not_drained(self) -> list[str]:
        """``"group.endpoint"`` of every call of this group (every colocated role's) that finished well, whose parts
        an iteration (``async for part in fut``) stopped reading before the end (a ``break``, or an iterator left
        suspended) and that nothing awaited afterwards; oldest first. For tests: a stream still producing is in
        ``calls_in_flight()``, a failed one in ``failed_calls_not_awaited()``; read to the end, awaited or
        cancelled, it is not listed."""
        return [f"{inv.group}.{inv.endpoint}" for inv in list(self._shared.undrained.values())
                if inv.finished() and inv.outcome() is None]

    def death_callback_errors(self) -> list[str]:
        """What this group's ``on_death`` callbacks raised, oldest first: ``"callback (told rank r of 'group' died)
        raised error"``. Each is logged with its traceback when raised; the other callbacks are told regardless. For
        tests (the ``make_group`` fixture fails a test whose callback raised); kept after the group closed."""
        return list(self._shared.callback_errors)

    def calls_in_flight(self) -> list[str]:
        """``"group.endpoint"`` of every call not yet finished or ended on this group's actors (every colocated
        role's), sorted; empty when nothing is left running. For tests that check no call was left behind. A call
        another call read is listed until its own replies are here, which can be after its reader returned."""
        return sorted(f"{inv.group}.{inv.endpoint}" for inv in list(self._shared.live))

    def on_death(self, callback: Callable[[WorkerDiedError], None]) -> Callable[[], None]:
        """Call ``callback(error)`` on the event loop when a rank of this group dies (once per rank); the group's
        calls in flight have already failed with WorkerDiedError then. A rank that died before the registration is
        told too: at once when registered on an event loop, which the group then follows. A callback that raises is
        logged and listed by ``death_callback_errors()``; the other callbacks are told regardless. Returns a function
        that unregisters it."""
        self._shared.add_death_callback(callback)

        def remove() -> None:
            if callback in self._shared.death_callbacks:
                self._shared.death_callbacks.remove(callback)
        return remove

    async def ping(self) -> list[int]:
        """Round trip to every rank's control lane (answers even while an endpoint computes). A dead rank, or one
        declared dead (``Worker.declare_dead``) whose process still answers, is a WorkerDiedError."""
        answers = await self._gather("ping")
        for rank, r in enumerate(answers):
            if isinstance(r, dict) and "declared_dead" in r:
                self._shared.declared_dead(rank, r["declared_dead"])  # the ping beat the supervision call's reply
        return self._answers("ping", answers)

    def shutdown(self) -> None:
        """End the group now (blocking): cancel start-up and every call in flight, kill the actors (of every
        colocated role) and release the pool once no other group uses it. ``await aclose()`` on an event loop.

        The group's calls and supervision live on the event loop it is used from: while that loop runs in another
        thread, this refuses (RuntimeError, nothing changed); hand the close to it instead with
        ``asyncio.run_coroutine_threadsafe(group.aclose(), loop).result()``."""
        _refuse_off_its_loop(self._shared, f"group {self.name!r}: shutdown() was called",
                             "Close it on that loop: asyncio.run_coroutine_threadsafe(group.aclose(), loop).result() "
                             "from this thread, or await group.aclose() there")
        rest = self._shared.end()
        if rest is not None:
            rest()

    async def aclose(self) -> None:
        """``shutdown()`` for async code: the blocking Ray calls run in a worker thread."""
        self._shared.follow_loop()
        rest = self._shared.end()
        if rest is not None:
            await _closing(rest)

    async def __aenter__(self) -> WorkerGroup:
        try:
            return await self.ready()
        except BaseException:
            await self.aclose()
            raise

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __getattr__(self, name: str) -> _Endpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        caller = self._callers.get(name)
        if caller is None:
            spec = self._endpoints.get(name)
            if spec is None:
                raise AttributeError(f"{self._cls.__name__} (group {self.name!r}) has no endpoint {name!r}; "
                                     f"endpoints: {sorted(self._endpoints)}. Mark methods with @endpoint.")
            caller = self._callers[name] = _Endpoint(self, spec)
        return caller

    def __repr__(self) -> str:
        return f"<WorkerGroup {self.name!r} {self._cls.__name__} x{self.world_size}>"

    def _method_name(self, endpoint: str) -> str:
        name = self._method_names.get(endpoint)
        if name is None:
            name = self._method_names[endpoint] = method_name(list(self._shared.roles).index(self._role), endpoint)
        return name

    # -- meshes ---------------------------------------------------------------------------------------------------
    def cached_mesh(self, name: str) -> list[MeshInfo] | None:
        """Mesh ``name`` as registered on every rank, if already looked up (for a dispatch's sync ``check``)."""
        return self._shared.meshes.get((self._role, name))

    async def mesh(self, name: str, endpoint: str = "?") -> list[MeshInfo]:
        """Mesh ``name`` as registered on every rank (looked up once, validated, then cached)."""
        key = (self._role, name)
        if key not in self._shared.meshes:
            found = await self._control("meshes", self._role)
            self._shared.meshes[key] = _validate_mesh(self.name, endpoint, name, [m.get(name) for m in found])
        return self._shared.meshes[key]


def _check_worker_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"a WorkerGroup runs a subclass of orchestra.Worker, got {cls!r}")


def _validate_mesh(group: str, endpoint: str, name: str, infos: list[MeshInfo | None]) -> list[MeshInfo]:
    where = f"group {group!r}, endpoint {endpoint!r}: shard(mesh={name!r})"
    missing = [r for r, m in enumerate(infos) if m is None]
    if missing:
        raise DispatchError(f"{where}: rank(s) {missing} never called self.register_mesh({name!r}, ...); register the "
                            f"mesh on every rank (e.g. in __init__) before calling this endpoint")
    sizes = {m.dp_size for m in infos}
    if len(sizes) != 1:
        raise DispatchError(f"{where}: ranks disagree on dp_size ({sorted(sizes)})")
    dp = sizes.pop()
    for d in range(dp):
        members = [r for r, m in enumerate(infos) if m.dp_rank == d]
        if not members:
            raise DispatchError(f"{where}: no rank registered dp_rank {d} of dp_size {dp}")
        collectors = [r for r in members if infos[r].is_collector]
        if len(collectors) != 1:
            raise DispatchError(f"{where}: DP replica {d} (ranks {members}) needs exactly one collector rank, has "
                                f"{collectors}")
    return list(infos)


class _Endpoint:
    """A group's endpoint: call it to get a DataFuture; ``.options(timeout=...)`` for a per-call deadline."""

    def __init__(self, group: WorkerGroup, spec: EndpointSpec, timeout: float | None = None,
                 stream: bool = False, bound: set | None = None) -> None:
        self.group, self.spec, self.timeout, self.stream = group, spec, timeout, stream
        # argument shapes (count, keyword names) already bound to the signature: binding checks only those
        self._bound: set[tuple[int, tuple[str, ...]]] = set() if bound is None else bound

    def options(self, *, timeout: float | None = None, stream: bool | None = None) -> _Endpoint:
        """This endpoint with call options: ``timeout`` seconds (> 0) until the call fails with CallTimeoutError
        and is cancelled everywhere; ``stream=True`` maps a sharded endpoint over the parts of a streamed input as
        they arrive (``D.stream()``)."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"{self!r}.options(timeout={timeout!r}): timeout must be a number of seconds")
            if not timeout > 0 or timeout != timeout or timeout == float("inf"):
                raise ValueError(f"{self!r}.options(timeout={timeout!r}): timeout must be a finite number of "
                                 f"seconds > 0 (leave it out for no deadline)")
        if stream is not None and not isinstance(stream, bool):
            raise TypeError(f"{self!r}.options(stream={stream!r}): stream must be True or False")
        return _Endpoint(self.group, self.spec, float(timeout) if timeout is not None else self.timeout,
                         self.stream if stream is None else stream, self._bound)

    def __repr__(self) -> str:
        return f"<endpoint {self.group.name}.{self.spec.name} dispatch={self.spec.dispatch!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> DataFuture:
        g, spec = self.group, self.spec
        shared = g._shared
        if shared.closed is not None:
            raise closed_error(g.name, shared.closed)
        # the usual call, on the loop supervision already follows with nothing owed: neither check has work to do
        if shared._watch_loop is None or shared._draining or shared._owed or not _runs_here(shared._watch_loop):
            _refuse_off_its_loop(shared, f"group {g.name!r}, endpoint {spec.name!r}: called",
                                 "Two loops' calls would race for its call order. Make the call on that loop: "
                                 "asyncio.run_coroutine_threadsafe(<coroutine awaiting the call>, loop)")
            shared.follow_loop()
        if shared.dead:
            rank, err = shared.first_death()
            raise WorkerDiedError(f"{err.message} (noticed before this call was sent; nothing was sent)",
                                  group=g.name, rank=rank, endpoint=spec.name, exc_type=err.exc_type)
        shape = (len(args), tuple(kwargs))
        if spec.signature is not None and shape not in self._bound:
            try:
                spec.signature.bind(None, *args, **kwargs)
                if len(self._bound) < 64:
                    self._bound.add(shape)
            except TypeError as e:
                raise DispatchError(f"group {g.name!r}, endpoint {spec.name!r}: {e}; signature is "
                                    f"{spec.name}{spec.signature}") from None
        world = g.world_size
        plan = Plan(group=g, endpoint=spec.name, world_size=world, ranks=every_rank(world), args=args,
                    kwargs=kwargs)
        plan = spec.dispatch.check(plan)
        if self.stream and not plan.stream:
            plan = stream_transform().check(plan)
        check_final(plan, spec.dispatch)
        check_forwarded(plan)
        if spec.requires:
            _check_columns(plan, spec)
        if plan.shard is not None and plan.shard.pad:
            _check_padded_stream(plan, spec)
        if shared._start is None:
            shared.start()
        inv = Invocation(g, spec, plan, self.timeout)
        _stats.add_call()
        inv.start()
        return DataFuture(inv)


def _check_padded_stream(plan: Plan, spec: EndpointSpec) -> None:
    """A padded shard and a stream do not go together, whatever the rows: refused at the call (a rank given filler
    rows refused a generator's call while the others ran it, and stream() ran the call per part, unpadded)."""
    if plan.shard is None or not plan.shard.pad:
        return
    if spec.streaming:
        raise DispatchError(f"{plan.where()}: a streaming endpoint (a generator) cannot take shard(pad=True) / pad(): "
                            f"its yields are stored as they come, so pad()'s filler rows could not be taken out of "
                            f"its result. Drop pad from its dispatch (shard(allow_empty=True) takes any row count), "
                            f"or return one Batch instead of yielding")
    if plan.stream:
        raise DispatchError(f"{plan.where()}: stream() runs the call once per arriving part of its input, each part "
                            f"whole, so pad() could not make the ranks' shards equal. Drop stream() "
                            f"(options(stream=True)), or read the parts with an endpoint without pad")


def _check_columns(plan: Plan, spec: EndpointSpec) -> None:
    if not spec.requires:
        return
    for a in plan.data_args():
        if isinstance(a, Batch):
            missing = [k for k in spec.requires if k not in a]
            if missing:
                raise DispatchError(f"{plan.where()}: the batch is missing column(s) {missing} (it has "
                                    f"{sorted(a.keys())}); add them or pass a future whose result has them")
