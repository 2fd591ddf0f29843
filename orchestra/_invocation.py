"""Invocation: the one owner of a group call, from plan to result.

An invocation holds the call's plan, its place in the group's send order (gate ticket), one slot per executing
rank, every background task of the call (a root task with an anyio task group: submission, generator drains,
per-part stream followers) and its deadline. ``DataFuture`` is a thin view of it. Cancel, timeout and shutdown go
through ``Invocation.cancel``: it records the terminal error, cancels the root task (and so every child), cancels
the Ray work of every rank and part, and fails every slot, so no task outlives its invocation.

Before any rank is sent anything, every rank's arguments are built and checked for serialization
(``_preflight``): a call runs on all of its ranks or on none.
"""

from __future__ import annotations

import asyncio
import io
import logging
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import ray
import torch
from ray import cloudpickle

from . import _backend, _channel, _frame, _replies, _stats
from ._batch import Batch, balanced_sizes
from ._errors import (
    UPSTREAM_FAILED,
    CallCancelledError,
    CallTimeoutError,
    DispatchError,
    GroupClosedError,
    OrchestraError,
    WorkerDiedError,
    WorkerError,
)
from ._wire import (FRAME_KWARG, FRAME_REFS_KWARG, INLINE_BYTES, REFS_KWARG, SHARED_KWARG, STORE_KWARG, DataArg,
                    Layout, Output, PartInfo, RefAt, Source, Span, columns_apart, padded_again, rank_value)
from .dispatch import Plan, check_final, collects_by_shape, forwarded_as, joins_rows

__all__ = ["Invocation", "Slot", "convert_error", "components", "check_forwarded"]

log = logging.getLogger("orchestra")



class Slot:
    """The outputs of one executing rank, in order; grows while a streaming endpoint yields."""

    def __init__(self, rank: int, collected: bool, on_change: Callable[[], None] | None = None,
                 on_fail: Callable[[], None] | None = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.rank, self.collected = rank, collected
        self._on_change = on_change  # after any output or the end is done (a failure: ``on_fail`` first)
        self._on_fail = on_fail
        self.refs: list[ray.ObjectRef] = []
        self.outputs: list[asyncio.Future] = []  # each resolves to an Output (or a plain value)
        self.done = asyncio.Future(loop=loop or asyncio.get_running_loop())  # (``loop``: the running one, known)
        self.call_refs: list[Any] = []  # every ObjectRef / generator sent for this slot, for cancellation
        self._waiters: list[asyncio.Future] = []
        self._open = 0  # outputs whose done callback has not run yet (a quick answer for ``finished``)
        self.verified = False  # finished, and no future of it failed (``Invocation.wait`` skips it from then on)
        self.failed = False  # its end or one of its outputs failed (cancelled ones do not count, as in ``outcome``)

    def add(self, ref: ray.ObjectRef, out: asyncio.Future | None = None) -> Callable[[asyncio.Future], None]:
        """Record an output ref; ``out`` resolves to its value (Ray's per-ref completion when not given). Returns the
        done callback it registered on ``out`` (a fast-path reply runs it as it arrives: ``ChannelReply.first``)."""
        self.refs.append(ref)
        if out is None:
            out = _replies.one(ref)
        self._open += 1
        self.verified = False
        done = self._output_done
        out.add_done_callback(done)
        self.outputs.append(out)
        if self._waiters:
            self._notify()
        return done

    def _output_done(self, f: asyncio.Future) -> None:
        self._open -= 1
        # retrieved here: a forwarded, never-awaited failure must not log "never retrieved"
        if not f.cancelled() and f.exception() is not None:
            self.failed = True
            if self._on_fail is not None:
                self._on_fail()
        if self._on_change is not None:
            self._on_change()

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)
                self.done.exception()  # retrieved here; errors surface through wait()
                self.failed = True
                if self._on_fail is not None:
                    self._on_fail()
        if self._waiters:
            self._notify()
        if self._on_change is not None:
            self._on_change()

    def finished(self) -> bool:
        # the count is exact once every output's callback ran; until then, look at the outputs themselves (a loop,
        # not all(): this runs at every reply of every call, mostly on a slot whose output is not in yet)
        if not self.done.done():
            return False
        if self._open == 0:
            return True
        for o in self.outputs:
            if not o.done():
                return False
        return True

    def watch(self) -> asyncio.Future:
        """A future resolved at the next new output or at the end (check state after taking it, then await)."""
        w = asyncio.get_running_loop().create_future()
        self._waiters.append(w)
        return w

    def _notify(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


def components(x: Any) -> list[Any]:
    """The Batches and Invocations a data argument reads (a union has several; a future one; a Batch itself)."""
    if isinstance(x, Batch):
        return [x]
    return list(x._orc_sources)


def check_forwarded(plan: Plan) -> None:
    """Refuse, at call time, a future argument whose ``await`` is not something this call can read as it is (see
    ``dispatch.forwarded_as``): a value the controller collects from several ranks (``metrics()``), anywhere; one
    value per rank (``broadcast()``) in a shard call or a union, where it would be read as rows (every rank's copy
    of the same rows one after the other)."""
    for a in plan.data_args():
        if isinstance(a, Batch):  # (a Batch argument reads no future)
            continue
        comps = components(a)
        for c in comps:
            if not isinstance(c, Invocation):
                continue
            kind = forwarded_as(c.spec.dispatch, c.plan)
            what = f"the future of group {c.group!r}, endpoint {c.endpoint!r} ({c.spec.dispatch!r})"
            if kind == "collected":
                raise DispatchError(
                    f"{plan.where()}: {what} is collected into one value by the controller, from every rank's "
                    f"result; a call cannot read it as it is. Await it and pass the value")
            if kind == "per_rank" and (plan.shard is not None or len(comps) > 1):
                raise DispatchError(
                    f"{plan.where()}: {what} gives one value per rank (await gives a list), not one set of rows; "
                    f"{'a union joins rows' if len(comps) > 1 else 'shard() splits rows'}, so it cannot read it. "
                    f"Keep one rank's rows (from_rank(r)), make that endpoint shard() its rows, or await it and "
                    f"pass a Batch")


class Invocation:
    """One group call: plan, gate ticket, per-rank slots, background tasks, deadline and terminal state."""

    def __init__(self, target: Any, spec: Any, plan: Plan, timeout: float | None) -> None:
        self.target = target  # the WorkerGroup view: name, _shared (hosts, gate, live set), _method_name
        self.shared = target._shared
        self.spec, self.plan = spec, plan
        self.group, self.endpoint = target.name, spec.name
        self.loop = asyncio.get_running_loop()
        self.slots: list[Slot] = []
        self.submitted: asyncio.Future = asyncio.Future(loop=self.loop)
        self.timeout = timeout
        self.deadline = None if timeout is None else self.loop.time() + timeout
        self.error: BaseException | None = None  # terminal: cancel, timeout, shutdown
        self._ended: asyncio.Future | None = None  # made when someone waits: fails when the call ends early
        self.upstreams: list[Invocation] = []
        for a in plan.data_args():
            if not isinstance(a, Batch):  # (a Batch argument reads no future)
                self.upstreams.extend(c for c in components(a) if isinstance(c, Invocation))
        self.collect: Callable[[list[Any]], Any] | None = None
        self.concat_all = False
        self._awaited = False  # a first await took the replies as received; later ones fetch their own copies
        self._read_apart: list[Invocation] = []  # inputs read rank by rank (rank i: upstream rank i alone, or a
        # stream's parts) before their headers were all here: their columns are checked when this call ends
        self._apart_inputs: list[Invocation] = []  # inputs computed from such reads, their checks pending
        self._columns_ok = False  # every such read of this call and its inputs was checked, well
        self._apart_bad: str | None = None  # why: a read rank by rank that this call was computed from is refused
        self._apart_dependents: list[weakref.ref] = []  # calls that read this one rank by rank, or were computed
        # from such a read through it: told when its headers, all here, disagree (``_judge_columns``)
        self._apart_judged = False
        self._root: asyncio.Task | None = None
        self._ticket: int | None = None
        self._scan = 0  # slots before this index are finished (see _check_done)
        self._deadline_timer: asyncio.TimerHandle | None = None  # ends the call at its deadline (see start)
        self._written: _WriteCheck | None = None  # the caller's Batches as the call was made (see start)
        self._looked = False  # its outcome was handed to someone: a wait returned it or raised its error, a call
        # read it as an input, or the caller ended it (``looked_at``; see failed_calls_not_awaited)
        self._read = False  # a call that reads this one as an input ran to its end (``read_elsewhere``)
        self._waiting_for: Any = "its turn to be sent"  # what a call not sent yet waits for: a text, or a data
        # argument whose inputs it is describing (named when its timeout error is made: ``_waiting_text``)
        self._inputs_gone = False  # it finished well and let its inputs go (``_let_inputs_go``)
        self._wakes: list[asyncio.Future] = []  # the waits under way (``_wait_some``): woken by ``_wake``

    # -- starting -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Send now when nothing needs waiting for (the common repeated call); else start the owned root task."""
        shared, spec, plan = self.shared, self.spec, self.plan
        gate = shared.gate
        self._ticket = gate.ticket()
        shared.live.add(self)
        if self.deadline is not None:  # the deadline covers the whole call, awaited or not
            self._deadline_timer = self.loop.call_at(self.deadline, self._deadline_passed)
        if (shared.is_ready() and gate.is_turn(self._ticket) and not spec.streaming and not plan.stream
                and not spec.dispatch.needs_split(plan) and not self.upstreams and _all_small(plan.data_args())):
            try:
                self._bind_collect(plan)
                self._send_now(plan)
            except BaseException as e:
                self._fail_submit(e)
                shared.live.discard(self)  # nothing was sent: no call of this group is left running
                self._stop_deadline()
                raise
            finally:
                gate.release(self._ticket)
            return
        self.plan = plan = _held(plan)  # sent later: its other arguments as they are now (a copy)
        self._written = _WriteCheck(plan)  # and the caller's Batches must still be as they were now
        self._root = self.loop.create_task(self._run(), name=f"orchestra:{self.group}.{self.endpoint}")
        self._root.add_done_callback(_retrieve_task)

    async def _run(self) -> None:
        shared, spec, gate, ticket = self.shared, self.spec, self.shared.gate, self._ticket
        try:
            with anyio.fail_after(self.timeout):  # the deadline also covers a call that nobody awaits
                self._waiting_for = "its group to start"
                await shared.ready()
                self._waiting_for = "the group's earlier calls to be sent"
                await gate.turn(ticket)
                self._waiting_for = "its inputs' row counts, to split them"
                plan = await spec.dispatch.split(self.plan)
                check_final(plan, spec.dispatch)
                self._bind_collect(plan)
                calls = None if plan.stream else self._prepare(plan, await self._describe_all(plan))
                try:
                    async with anyio.create_task_group() as tg:
                        if calls is None:
                            await self._submit_stream(plan, tg, lambda: gate.release(ticket))
                        else:
                            self._written.check(self.where())  # nothing awaited since: nothing can write now
                            self._send(plan, calls, tg)
                            gate.release(ticket)
                except BaseExceptionGroup as eg:  # one failure (the usual case) is raised as itself
                    sole = _sole(eg)
                    if sole is None:
                        raise
                    raise sole from None
        except TimeoutError as e:  # this call's deadline — or an upstream's CallTimeoutError, which stays its own
            err = e if isinstance(e, CallTimeoutError) else self._timeout_error(self._running_ranks())
            self._fail_submit(err)
            self.fail(err)
        except asyncio.CancelledError:
            if self.error is None:  # cancelled from outside the invocation (loop shutdown)
                self.cancel(CallCancelledError(f"{self.where()}: cancelled before it finished sending"))
            raise
        except BaseException as e:  # noqa: BLE001 - recorded on the invocation and raised by every await
            self._fail_submit(e)
            self.fail(e)
        finally:
            gate.release(ticket)

    def where(self) -> str:
        return f"group {self.group!r}, endpoint {self.endpoint!r}"

    def _deadline_passed(self) -> None:
        """At the deadline, a call still running fails with CallTimeoutError and its ranks are cancelled, as when
        an awaiter sees the deadline pass: no one need be awaiting it (a late await gets the error, and so does a
        call that reads its result)."""
        self._deadline_timer = None
        if not self.finished():
            self.fail(self._timeout_error(self._running_ranks()))

    def _bind_collect(self, plan: Plan) -> None:
        self.plan = plan
        self.collect = lambda values: self.spec.dispatch.collect(plan, values)
        # a shard call's rows joined at once, unless a collect before shard()'s reads the per-rank results
        self.concat_all = plan.shard is not None and joins_rows(self.spec.dispatch)

    def _fail_submit(self, error: BaseException) -> None:
        if not self.submitted.done():
            self.submitted.set_exception(error)
            self.submitted.exception()

    def _set_slots(self, slots: list[Slot]) -> None:
        """Record the call's slots: the order is the order of its rows (see ``_row_order``)."""
        self.slots = slots
        if not self.submitted.done():
            self.submitted.set_result(None)
        self._check_done()

    def _slot(self, rank: int, collected: bool) -> Slot:
        return Slot(rank, collected, self._check_done, self._wake, self.loop)

    def _wake(self) -> None:
        """Wake the waits under way (``_wait_some``): every rank finished, one failed, or the call ended early."""
        wakes, self._wakes = self._wakes, []
        for w in wakes:
            if not w.done():
                w.set_result(True)

    def _check_done(self) -> None:
        """Leave the group's calls in flight once every rank finished (the first moment nothing is left to end).
        Scans from the first slot not yet seen finished, so a call's completions cost O(ranks) in all."""
        if not self.submitted.done():
            return
        slots, i = self.slots, self._scan
        while i < len(slots) and slots[i].finished():
            i += 1
        self._scan = i
        if i == len(slots):
            if self._wakes:
                self._wake()
            self._inputs_read()
            if self._apart_dependents and not self._apart_judged:
                self._judge_columns()
            self.shared.live.discard(self)
            self._stop_deadline()
            if self._inputs_gone:
                return
            well = self.error is None
            for s in slots:  # an output whose callback has not run yet may be a failure: this runs again from it
                if s.failed or s._open:
                    well = False
                    break
            if well:
                self._let_inputs_go()
            elif not self._looked and self.outcome() is not None:
                self.shared.note_unseen(self)

    def _let_inputs_go(self) -> None:
        """Every rank finished well: drop what the call held only to be sent — its upstream calls, the Batches and
        futures it read, the marks of the caller's Batches — so that a loop feeding each result into the next call
        (``x = g.f(x)``) keeps the last call alive, not every call before it and their rows. Its check of rows read
        rank by rank is settled now when it can be (``_settle_columns``); else it keeps what that check reads.
        A failed call keeps its inputs: a rank that read a failed upstream reports the upstream's error
        (``converted``); so does the plan of a call with a user's ``collect`` (``collects_by_shape``), which may
        read them — no other call can read such a call's future, so it holds its own inputs, not a chain."""
        self._inputs_gone = True
        if self._apart_pending():
            self._settle_columns()
        self.upstreams = []
        self._written = None
        self._waiting_for = "nothing: it finished"
        if self.plan.data_args() and collects_by_shape(self.spec.dispatch):  # (a user's collect may read them)
            plan = self.plan.without_data(_LET_GO)
            if self.collect is not None:
                self._bind_collect(plan)
            else:
                self.plan = plan

    # -- sending --------------------------------------------------------------------------------------------------
    def _prepare(self, plan: Plan, described: dict[int, Any]) -> dict[int, tuple[tuple, dict, list]]:
        """Every rank's (args, kwargs, refs); ``_send`` serializes them all before any rank is sent anything."""
        return _per_rank_calls(plan, described, self._readers(plan))

    def _readers(self, plan: Plan) -> tuple[int, ...]:
        """The DP sizes a shard call's output may be read at (``_Shared.reader_sizes``); none for other calls."""
        return self.shared.reader_sizes() if plan.shard is not None else ()

    def _send_now(self, plan: Plan) -> None:
        """Send a call whose arguments are all here and small: its frames written into its endpoint's template when
        one of its shape is known (``orchestra._template``), else made as usual (which may learn one)."""
        readers = self._readers(plan)
        role = self.target._role
        templates = self.shared.templates
        shape, frames = templates.frames(role, plan, readers)
        if frames is not None:
            self._send(plan, None, None, frames)
            return
        calls = _per_rank_calls(plan, _describe_batches(plan), readers)
        frames = _encode(plan, calls)
        self._send(plan, calls, None, frames)
        templates.saw(role, shape, plan, frames, lambda p: _frames_of(p, readers))

    def _send(self, plan: Plan, calls: dict[int, tuple[tuple, dict, list]] | None, tg: Any,
              encoded: dict[int, tuple[bytes | None, list, tuple]] | None = None) -> None:
        """Send every rank its call, each rank's arguments pickled once, into one frame, before any rank is sent
        anything (``_encode``, or ``encoded`` when given: then ``calls`` may be None): over the group's fast-path
        channel when the call qualifies (see ``orchestra._channel``), else as Ray actor calls that carry the frame."""
        hosts = self.shared.hosts
        meth = self.target._method_name(self.spec.name)
        collectors = set(plan.shard.collectors if plan.shard is not None else
                         plan.collectors if plan.collectors is not None else plan.ranks)
        if encoded is None:
            encoded = _encode(plan, calls)
        qualifies = (encoded is not None and not self.spec.streaming and _no_refs(encoded)
                     and self.shared.may_use_fast_path())
        channel = self.shared.fast_channel() if qualifies else None
        if channel is not None:
            role, name = self.target._role, self.spec.name
            slots = []
            for r in plan.ranks:
                call_id = _channel.Channel.new_id()
                blob = encoded[r][0] or _frame.NO_ARGUMENTS
                frame = pickle.dumps((call_id, role, name, blob), protocol=pickle.HIGHEST_PROTOCOL)
                reply = channel.call(r, frame, call_id, name)
                slot = self._slot(r, r in collectors)
                slot.call_refs.append(reply)
                reply.first = slot.add(reply, reply.out)
                # its only output: finish() without its notifications, which have no one to tell yet (the call has
                # no slots until _set_slots, so its _check_done returns at once, and no one watches these)
                slot.done.set_result(None)
                slots.append(slot)
            self._set_slots(_row_order(plan, slots))
            return
        if not qualifies:  # a call that needs Ray: hand the compute lanes back (see _Shared.before_ray_compute)
            self.shared.before_ray_compute(keep_streak=encoded is not None and self._needs_only_own_replies(encoded))
        slots = []
        for r in plan.ranks:
            a, kw = _ray_args(encoded, calls, r)
            slot = self._slot(r, r in collectors)
            if self.spec.streaming:
                gen = getattr(hosts[r], meth).options(num_returns="streaming").remote(*a, **kw)
                slot.call_refs.append(gen)
                tg.start_soon(_drain, gen, slot)
            else:
                slot.call_refs.append(getattr(hosts[r], meth).remote(*a, **kw))
            slots.append(slot)
        if not self.spec.streaming:  # every rank's reply resolved in one batch (see _replies)
            outs = _replies.batched([s.call_refs[0] for s in slots]) or [None] * len(slots)
            for slot, out in zip(slots, outs):
                slot.add(slot.call_refs[0], out)
                slot.finish()
        self._set_slots(_row_order(plan, slots))

    def _needs_only_own_replies(self, encoded: dict[int, tuple[bytes | None, list, tuple]]) -> bool:
        """Whether every ref the call carries is a reply of an earlier call of this group (or its colocated roles):
        over an open channel those replies come back by value, so a loop of ``g.read(g.make())`` can open one."""
        carried = [r for _, refs, top in encoded.values() for r in (*refs, *top)]
        own = {r for u in self.upstreams if u.shared is self.shared for s in u.slots for r in s.refs}
        return bool(carried) and all(r in own for r in carried)

    async def _describe_all(self, plan: Plan) -> dict[int, Any]:
        """Descriptors of every data argument (awaiting upstream submissions, never their payloads); large
        controller-made shards are put into the object store off the event loop."""
        out: dict[int, Any] = {}
        for a in plan.data_args():
            if id(a) in out:
                continue
            self._waiting_for = a
            if isinstance(a, Batch):
                if plan.shard is not None:
                    out[id(a)] = await anyio.to_thread.run_sync(_describe_batch, a, plan.shard, plan)
            else:
                out[id(a)] = await self._describe_data(a, plan)
        return out

    async def _describe_data(self, a: Any, plan: Plan) -> dict[int, tuple[list[list[Any]], Layout, list[Any]]]:
        """Per DP index: the sources (outputs by value, or refs; part infos), the layout of the rows it reads, and
        the guards: refs of the outputs of the upstream ranks whose results are not kept (see ``guard_refs``)."""
        spec = plan.shard
        comps = components(a)
        hurry = self._hurry
        guards = [g for c in comps if not isinstance(c, Batch) for g in await c.guard_refs(hurry)]
        self._inherit_read_apart(plan, comps)
        if spec is None:  # broadcast: every rank reads everything
            if len(comps) == 1 and not isinstance(comps[0], Batch):
                slots = await comps[0].forwardables(hurry)
                kind = forwarded_as(comps[0].spec.dispatch, comps[0].plan)
                if kind == "per_rank":  # each rank's outputs apart
                    return {0: (slots, Layout("per_rank"), guards)}
                # rows, or the plain values await gives: the slot boundaries let a rank rebuild await's list
                return {0: ([[o for s in slots for o in s]],
                            Layout("whole", slots=tuple(len(s) for s in slots), one=kind == "one"), guards)}
            return {0: ([await self._all_outputs(c, plan, hurry) for c in comps], Layout("whole"), guards)}
        D = spec.dp_size
        slot_lists = []
        for c in comps:
            if isinstance(c, Batch):  # stored as D balanced parts, so that each rank reads about its share
                parts = await anyio.to_thread.run_sync(lambda: [_put(p, plan, "argument") for p in c.chunk(D)
                                                                if len(p)])
                slot_lists.append([parts])
            else:
                slot_lists.append(await c.forwardables(hurry))
                _check_joinable(plan, c)
        # part i -> rank i only for one producer split the same way, read alone; a union routes by rows (each source
        # is read by global row range), since its producers may have split their rows differently; so do a call's
        # data arguments when it has several: each is split balanced, so every rank reads the same rows of each
        # (one read aligned would pair its upstream rank's rows with another share of the others')
        if (len(comps) == 1 and not spec.pad and len(slot_lists[0]) == D and not isinstance(comps[0], Batch)
                and len(plan.data_args()) == 1):
            if not comps[0].outputs_here():
                self._read_apart.append(comps[0])
                comps[0]._apart_watch(self)
            return {d: ([slot_lists[0][d]], Layout("whole"), guards) for d in range(D)}
        flat = [[o for s in slots for o in s] for slots in slot_lists]
        named = tuple("" if isinstance(c, Batch) else c.where() for c in comps)
        layouts = {d: Layout("balanced", d, D, spec.pad, allow_empty=spec.allow_empty, sources=named)
                   for d in range(D)}
        if spec.pad:
            _check_padded_again(plan, comps, layouts[0])
        return {d: (flat, layouts[d], guards) for d in range(D)}

    async def _all_outputs(self, c: Any, plan: Plan, hurry: Callable[[], asyncio.Future]) -> list[Any]:
        if isinstance(c, Batch):
            return [await anyio.to_thread.run_sync(_put, c, plan, "argument")]
        return [o for s in await c.forwardables(hurry) for o in s]

    def _hurry(self) -> asyncio.Future:
        """Done once a later call of this call's group waits for it to be sent (``_Gate.later``)."""
        return self.shared.gate.later(self._ticket)

    async def forwardables(self, hurry: Callable[[], asyncio.Future] | None = None) -> list[list[Any]]:
        """What a reader carries for each output of each collected slot (see ``_forwardable``; ``hurry``: the
        reader's ``_hurry``)."""
        return await self._forwardables(collected=True, hurry=hurry)

    async def guard_refs(self, hurry: Callable[[], asyncio.Future] | None = None) -> list[Any]:
        """The refs a reader carries for the outputs of every slot whose results are not kept (a ``from_rank``
        call's other ranks, a mesh's non-collector TP/PP ranks): never read, but fetched with its inputs so that a
        failure of any rank of this call fails the reader with that rank's own error, exactly as a collector's
        failure does (a call that failed somewhere has no result). A reply already here, well, needs no ref.
        (Non-collectors should return little, e.g. None, as a ``from_rank`` endpoint's other ranks do.)"""
        return [o for outs in await self._forwardables(collected=False, hurry=hurry) for o in outs
                if _backend.is_ref(o)]

    async def _forwardables(self, collected: bool,
                            hurry: Callable[[], asyncio.Future] | None = None) -> list[list[Any]]:
        """What a reader carries for each output of the slots that are (or are not) ``collected`` (see
        ``_forwardable``), once every call is sent and every stream of them finished; a failure seen here raises
        this call's outcome (the reader's error)."""
        await self.wait_submitted()
        slots = [s for s in self.slots if s.collected == collected]
        for s in slots:
            try:
                await asyncio.shield(s.done)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001
                raise await self.converted(e, s) from None
        out = []
        for s in slots:
            try:
                out.append([await _forwardable(r, o, hurry) for r, o in zip(s.refs, s.outputs)])
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - a reply failed: the reader fails with this call's outcome
                raise self.error or await self.converted(e, s) from None
        return out

    async def _submit_stream(self, plan: Plan, tg: Any, release: Callable[[], None]) -> None:
        """``stream()``: one call per arriving upstream part; the part from upstream slot i goes to DP replica
        i mod D (every rank of it). ``release`` is called once the last part is sent."""
        streamed = [a for a in plan.data_args() if not isinstance(a, Batch)]
        if len(streamed) != 1 or any(isinstance(x, Batch) for x in components(streamed[0])):
            raise DispatchError(f"{plan.where()}: stream() needs exactly one DataFuture argument (or a union of "
                                f"futures) to map over")
        if self.spec.streaming:
            raise DispatchError(f"{plan.where()}: stream() maps a plain endpoint over parts; a generator endpoint "
                                f"cannot be mapped")
        src = streamed[0]
        comps: list[Invocation] = components(src)
        for c in comps:
            await c.wait_submitted()
        n_slots = {len([s for s in c.slots if s.collected]) for c in comps}
        if len(n_slots) != 1:
            raise DispatchError(f"{plan.where()}: the futures joined with | stream from different numbers of ranks "
                                f"{sorted(n_slots)}; stream() pairs their parts one to one")
        shard = plan.shard
        D = shard.dp_size
        if shard.mesh is not None and n_slots.pop() != D:
            # ranks of a mesh run collectives: every DP replica must get a call per part. With a different number
            # of upstream ranks that cannot keep rows in order, so the call waits for every part and is sent once.
            plan = plan.with_(stream=False)
            self._bind_collect(plan)
            self._send(plan, self._prepare(plan, await self._describe_all(plan)), tg)
            release()
            return
        # each part is read apart from the others: a future whose ranks' results do not join is refused by the
        # headers here, part by part as they come, and by all of them when the call ends (``_check_read_apart``)
        self._inherit_read_apart(plan, comps)
        for c in comps:
            _check_joinable(plan, c)
            if not c.outputs_here():
                self._read_apart.append(c)
                c._apart_watch(self)
        firsts: list[Output | None] = [None] * len(comps)

        def check_part(items: list[Any]) -> None:
            for j, x in enumerate(items):
                if not (isinstance(x, Output) and x.schema and x.parts and any(p.rows for p in x.parts)):
                    continue
                if firsts[j] is None:
                    firsts[j] = x
                    continue
                refusal = columns_apart([firsts[j], x])
                if refusal is not None:
                    raise DispatchError(f"{plan.where()}: the future of {comps[j].where()} is not one Batch: "
                                        f"{refusal}")

        members = {d: [r for r in plan.ranks if shard.dp_of_rank[r] == d] for d in range(D)}
        comp_slots = [[s for s in c.slots if s.collected] for c in comps]
        collector_of = {shard.dp_of_rank[r]: r for r in shard.collectors}
        # the part of upstream slot i runs on replica i mod D: its slot names the rank of this group that reports it
        out_slots = [self._slot(collector_of[i % D], True) for i in range(len(comp_slots[0]))]
        side: list[Slot] = [self._slot(r, False) for r in plan.ranks if r not in shard.collectors]
        self._set_slots([*out_slots, *side])
        side_of = {s.rank: s for s in side}
        hosts = self.shared.hosts
        meth = self.target._method_name(self.spec.name)
        remaining = [len(out_slots)]

        def one_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                release()
                for s in side:
                    s.finish()

        async def follow(i: int) -> None:
            k = 0
            d = i % D
            try:
                while True:
                    if all(len(cs[i].refs) > k for cs in comp_slots):
                        b = _ArgBuilder()
                        items = [await _forwardable(cs[i].refs[k]) for cs in comp_slots]
                        check_part(items)
                        darg = DataArg(tuple(Source((b.add(x),)) for x in items), Layout("whole"))
                        refs = b.refs
                        calls = {}
                        for r in members[d]:
                            args, kwargs = plan.per_rank.get(r, (plan.args, plan.kwargs))
                            args = tuple(darg if x is src else x for x in args)
                            kwargs = {kk: (darg if v is src else v) for kk, v in kwargs.items()}
                            own = tuple(k for k, v in (*enumerate(args), *kwargs.items()) if _backend.is_ref(v))
                            if own:  # the caller's refs: every per-part call reads the one stored object
                                kwargs[SHARED_KWARG] = own
                            calls[r] = (args, kwargs, refs)
                        if self._written is not None:
                            self._written.check(self.where())
                        encoded = _encode(plan, calls)
                        self.shared.before_ray_compute()
                        for r in calls:
                            a, kw = _ray_args(encoded, calls, r)
                            ref = getattr(hosts[r], meth).remote(*a, **kw)
                            slot = out_slots[i] if r in shard.collectors else side_of[r]
                            slot.call_refs.append(ref)
                            if r in shard.collectors:
                                slot.add(ref)
                            else:  # tracked for errors only
                                slot.add(ref)
                        k += 1
                        continue
                    if all(cs[i].done.done() for cs in comp_slots):
                        for c, cs in zip(comps, comp_slots):
                            exc = cs[i].done.exception()
                            if exc is not None:
                                raise await c.converted(exc, cs[i])
                        if any(len(cs[i].refs) != len(comp_slots[0][i].refs) for cs in comp_slots):
                            raise DispatchError(f"{plan.where()}: the joined futures yielded different numbers of "
                                                f"parts on slot {i}; stream() pairs their parts one to one")
                        for c in comps:  # a failed rank whose results are not kept (a mesh's TP peer) fails it too
                            await c.wait()
                        out_slots[i].finish()
                        return
                    waits = [cs[i].watch() for cs in comp_slots]
                    # the two conditions above, again: a source ahead of another, or done before it, waits for it
                    # (``any`` here spun the loop without awaiting while one source was ahead)
                    if all(len(cs[i].refs) > k for cs in comp_slots) or all(cs[i].done.done() for cs in comp_slots):
                        for w in waits:
                            w.cancel()
                        continue
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - surfaced through the future
                out_slots[i].finish(e)
            finally:
                one_done()

        for i in range(len(out_slots)):
            tg.start_soon(follow, i)
        if not out_slots:
            release()

    # -- state ----------------------------------------------------------------------------------------------------
    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self.loop.time())

    def finished(self) -> bool:
        return self.error is not None or (self.submitted.done() and all(s.finished() for s in self.slots))

    def rows_if_known(self) -> int | None:
        """Rows the producers reported (every collected rank done, every output a Batch), else None."""
        parts = self.known_parts()
        return None if parts is None else sum(p.rows for p in parts)

    def known_parts(self) -> list[PartInfo] | None:
        """The part headers of the rows, in row order, once every collected rank is done and every output is a
        Batch; else None (nothing is waited for)."""
        if not self.submitted.done() or self.submitted.exception() is not None or self.error is not None:
            return None
        parts: list[PartInfo] = []
        for s in _row_order(self.plan, self.slots):
            if not s.collected:
                continue
            if not s.finished() or s.done.exception() is not None:
                return None
            for o in s.outputs:
                if o.exception() is not None:
                    return None
                v = o.result()
                if not (isinstance(v, Output) and v.is_batch):
                    return None
                parts.extend(v.parts)
        return parts

    def _apart_pending(self) -> bool:
        """Whether this call read, or was computed from, rows read rank by rank that are not checked yet."""
        return not self._columns_ok and bool(self._read_apart or self._apart_inputs)

    def _apart_graph(self) -> list[Invocation]:
        """This call and every input it was computed from whose check is pending, each once (iterative: a long
        chain of calls nobody awaited is deep)."""
        seen, order, todo = {id(self)}, [], [self]
        while todo:
            inv = todo.pop()
            order.append(inv)
            for c in inv._apart_inputs:
                if id(c) not in seen and c._apart_pending():
                    seen.add(id(c))
                    todo.append(c)
        return order

    def _apart_refusal(self, inv: Invocation, u: Invocation) -> str | None:
        refusal = columns_apart(u.known_outputs())
        if refusal is None:
            return None
        via = "" if inv is self else f" (by {inv.where()}, whose result this call read)"
        return (f"{self.where()}: ranks read the future of {u.where()} rank by rank{via}, each one rank's rows, but "
                f"it is not one Batch ({refusal}); the read was sent before its headers were all here, so ranks ran "
                f"on rows of different columns, and this call's result is refused")

    def apart_refusal_known(self) -> str | None:
        """The refusal of a read rank by rank this call was computed from, once that read's upstream finished and
        judged its headers (``_judge_columns``); None until then (``_check_read_apart`` waits for them)."""
        return None if self._apart_bad is None else f"{self.where()}: {self._apart_bad}; this call's result is refused"

    async def _check_read_apart(self) -> None:
        """Fail this finished call if a future that was read rank by rank on its way here (by this call, or by a
        call whose result it read), sent before all that future's headers were here, turns out not to be one Batch
        (``columns_apart``): ranks read rows of different columns. It ran (a reader of one rank's rows cannot
        tell); its result is refused, not used. Once all is well the verdict is kept (each call checked once);
        a refusal stays for later readers."""
        graph = self._apart_graph()
        for inv in graph:
            for u in inv._read_apart:
                outs = [o for s in u.slots if s.collected for o in s.outputs if not o.done()]
                if outs:  # here soon: each was read by a rank upstream (wait: a cancel here leaves them be)
                    await asyncio.wait(outs)
                refusal = self._apart_refusal(inv, u)
                if refusal is not None:
                    raise self.fail(DispatchError(refusal))
        _columns_checked(graph)

    def _settle_columns(self) -> None:
        """``_check_read_apart`` without waiting, for a call that finished well: when every header it reads is
        here and they agree, the verdict is kept now and the inputs it held for the check are let go. A header
        still on its way, or a disagreement, is left to ``_check_read_apart`` (at the next await), which fails the
        call."""
        graph = self._apart_graph()
        for inv in graph:
            for u in inv._read_apart:
                if not u.outputs_here() or self._apart_refusal(inv, u) is not None:
                    return
        _columns_checked(graph)

    def _inherit_read_apart(self, plan: Plan, comps: list[Any]) -> None:
        """Keep the inputs computed from rows read rank by rank and not checked yet (``_check_read_apart``), so that
        a call computed from them is refused too; refuse now when such a read's upstream already judged its headers
        apart (``_apart_bad``, set by ``_judge_columns``)."""
        for c in comps:
            if isinstance(c, Batch):
                continue
            if c._apart_bad is not None:
                raise DispatchError(f"{plan.where()}: its input, the future of {c.where()}, {c._apart_bad}")
            if c._apart_pending() and c not in self._apart_inputs:
                self._apart_inputs.append(c)
                c._apart_dependents.append(weakref.ref(self))

    def _apart_watch(self, reader: Invocation) -> None:
        """``reader`` reads this call rank by rank before its headers are all here: judge them when they are."""
        self._apart_dependents.append(weakref.ref(reader))

    def _judge_columns(self) -> None:
        """Every rank finished: if the headers of this call, read rank by rank by another, disagree, mark every call
        computed from such a read of it (``_apart_bad``), so that each is refused before sending and at its end.
        Each mark is made once; a good verdict lets the readers go."""
        self._apart_judged = True
        refusal = columns_apart(self.known_outputs())
        todo, self._apart_dependents = self._apart_dependents, []
        if refusal is None:  # a reader that finished before these headers were here settles its check now
            for ref in todo:
                inv = ref()
                if inv is not None and inv._inputs_gone and inv._apart_pending():
                    inv._settle_columns()
            return
        why = (f"was computed from the future of {self.where()} read rank by rank, which is not one Batch "
               f"({refusal})")
        while todo:
            inv = todo.pop()()
            if inv is None or inv._apart_bad is not None:
                continue
            inv._apart_bad = why
            todo.extend(inv._apart_dependents)

    def read_elsewhere(self) -> bool:
        """Whether a call that reads this one as an input ran to its end (``read_by_another``): this call has run
        then, though its own replies may still be on their way (Ray delivers different actors' replies in any
        order). A wait that merely started on it does not count."""
        return self._read

    def _inputs_read(self) -> None:
        """Every rank ran to its end, reading its inputs: each upstream's outcome (its rows, or its failure as this
        call's) was handed to this call. Not for a call ended early (cancelled, closed, timed out)."""
        if self.error is None:
            for u in self.upstreams:
                u.read_by_another()

    def read_by_another(self) -> None:
        """A call that reads this one ran to its end: this call's outcome reached it (see ``read_elsewhere``)."""
        self._read = True
        self.looked_at()

    def unreceived(self) -> list[asyncio.Future]:
        """What the controller still waits for from this call's ranks: its sending, each rank's end and replies.
        A wait on these runs after the call's own callbacks on them (a call read by another can have run, its rows
        read, with its replies still on their way here: Ray delivers the replies of different actors in any
        order)."""
        if not self.submitted.done():
            return [self.submitted]
        return [f for s in self.slots for f in (s.done, *s.outputs) if not f.done()]

    def outputs_here(self) -> bool:
        """Whether every collected slot's outputs were received (failed or not)."""
        return all(s.done.done() and all(o.done() for o in s.outputs) for s in self.slots if s.collected)

    def known_outputs(self) -> list[Any]:
        """The outputs of the collected slots received so far, well, in row order (nothing is waited for)."""
        return [o.result() for s in _row_order(self.plan, self.slots) if s.collected for o in s.outputs
                if o.done() and not o.cancelled() and o.exception() is None]

    def _running_ranks(self) -> list[int]:
        return sorted({s.rank for s in self.slots if not s.finished()})

    def _slot_of(self, fut: asyncio.Future) -> Slot | None:
        for s in self.slots:
            if fut is s.done or fut in s.outputs:
                return s
        return None

    def _waiting_text(self) -> str:
        w = self._waiting_for
        if isinstance(w, str):
            return w
        return "its inputs: " + ", ".join(c.where() if isinstance(c, Invocation) else "a Batch" for c in components(w))

    def _timeout_error(self, running: list[int]) -> CallTimeoutError:
        if not self.submitted.done():
            return CallTimeoutError(
                f"{self.where()}: no result after {self.timeout} s; it was not sent: it waited for "
                f"{self._waiting_text()}. Raise the timeout with .options(timeout=...) or look at what it waited for.",
                group=self.group, endpoint=self.endpoint, pending_ranks=[])
        return CallTimeoutError(
            f"{self.where()}: no result after {self.timeout} s; rank(s) {running} still running. Raise the timeout "
            f"with .options(timeout=...) or look at those ranks.",
            group=self.group, endpoint=self.endpoint, pending_ranks=running)

    async def converted(self, e: BaseException, slot: Slot | None) -> BaseException:
        """orchestra's error for a failure of ``slot``; an upstream failure becomes the upstream's own error. Every
        caller raises what this returns: the failure is handed to someone, so the call counts as seen."""
        err = convert_error(e, self.group, self.endpoint, slot.rank if slot else None)
        if isinstance(err, WorkerError) and err.exc_type == UPSTREAM_FAILED:
            for u in self.upstreams:
                try:
                    await u.wait()
                except OrchestraError as ue:
                    err = ue
                    break
        self.looked_at()
        return err

    # -- waiting --------------------------------------------------------------------------------------------------
    def looked_at(self) -> None:
        """The call's outcome was handed to someone — a wait returned it or raised its error, a call read it, the
        caller ended it — so its failure, if any, is seen there. Not called when a wait merely starts: a wait that
        stops early (a stream left with ``break``) has seen nothing of what comes after."""
        if not self._looked:
            self._looked = True
            self.shared.unseen.pop(id(self), None)
            self.shared.undrained.pop(id(self), None)

    def iterating(self) -> None:
        """An iteration of this call's parts started: until it reaches the end or hands out the call's error (or
        the outcome is seen otherwise), the call is a stream not drained (``WorkerGroup.streams_not_drained``)."""
        if not self._looked:
            self.shared.note_undrained(self)

    def iteration_ended(self) -> None:
        """An iteration of this call's parts ended otherwise than by being left (an error of its own, not the
        call's): it is no stream left undrained."""
        self.shared.undrained.pop(id(self), None)

    def outcome_as_awaited(self) -> BaseException | None:
        """``outcome()`` as ``await`` raises it: a failure of a rank that read a failed upstream is that upstream's
        own error (naming its group, rank and endpoint), as ``converted`` makes it, found without waiting."""
        err = self.outcome()
        inv, seen = self, {id(self)}
        while isinstance(err, WorkerError) and err.exc_type == UPSTREAM_FAILED:
            found = None
            for u in inv.upstreams:
                ue = u.outcome()
                if ue is not None and id(u) not in seen:
                    found = u
                    break
            if found is None:
                break
            inv, err = found, found.outcome()
            seen.add(id(inv))
        return err

    def outcome(self) -> BaseException | None:
        """The call's failure once it has one: how it was ended early, else the first failure of a rank."""
        if self.error is not None:
            return self.error
        for s in self.slots:
            for f in (s.done, *s.outputs):
                if f.done() and not f.cancelled() and f.exception() is not None:
                    return convert_error(f.exception(), self.group, self.endpoint, s.rank)
        return None

    async def wait_submitted(self) -> None:
        """Until the call was sent to its ranks; raises its failure to be sent (then the call counts as seen)."""
        if self.error is not None:
            self.looked_at()
            raise self.error
        if not self.submitted.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.submitted), self.remaining())
            except asyncio.TimeoutError:
                self.looked_at()
                raise self.fail(self._timeout_error([])) from None
        exc = self.submitted.exception()
        if exc is not None:
            self.looked_at()
            raise exc

    async def wait(self) -> None:
        """Wait until every rank has finished; raise the first failure at once, cancelling the other ranks. The
        call counts as seen once this returns or raises its error (``looked_at``); a wait cancelled by its caller
        ends the call instead (``CallCancelledError``: the caller's own act)."""
        try:
            await self._wait()
        except asyncio.CancelledError:
            raise
        except BaseException:
            self.looked_at()
            raise
        self.looked_at()
        self._inputs_read()  # (its slots' own callbacks may not have run yet: ``_check_done`` does it then too)

    async def _wait(self) -> None:
        try:
            await self.wait_submitted()
            while True:
                if self.error is not None:
                    raise self.error
                pending: set[asyncio.Future] = set()
                for s in self.slots:  # failures that already happened (slots seen finished without one: skipped)
                    if s.verified:
                        continue
                    settled = True
                    for f in (s.done, *s.outputs):
                        if not f.done():
                            pending.add(f)
                            settled = False
                        elif not f.cancelled() and f.exception() is not None:
                            raise self.fail(await self.converted(f.exception(), s))
                    s.verified = settled
                if not pending:
                    if self._apart_pending():
                        await self._check_read_apart()
                    return
                if not await self._wait_some(pending):
                    raise self.fail(self._timeout_error(self._running_ranks()))
        except asyncio.CancelledError:
            if not self.finished():
                self.cancel(CallCancelledError(f"{self.where()}: the task awaiting this call was cancelled"))
            raise

    def ended(self) -> asyncio.Future:
        """A future that fails with the call's outcome once the call is ended early (a sibling rank died, shutdown,
        cancel, deadline); made on first use, so a call nobody waits on pays nothing for it."""
        if self._ended is None:
            self._ended = self.loop.create_future()
            if self.error is not None:
                self._ended.set_exception(self.error)
                self._ended.exception()  # retrieved: the error surfaces through wait()
        return self._ended

    async def _wait_some(self, pending: set[asyncio.Future]) -> bool:
        """Until every future of ``pending`` (outputs and ends of the call's slots) is done, one of them fails, or
        the call is ended early (a sibling rank died, shutdown, cancel: this wakes even while a rank still blocks,
        e.g. in a collective whose peer is gone). False when the deadline passed first. ``asyncio.wait``
        (FIRST_EXCEPTION) plus the early end, told by the call's own hooks instead of a callback on each future:
        ``_check_done`` once every slot finished, a slot's ``on_fail``, ``_end`` (``_wake``)."""
        waiter = asyncio.Future(loop=self.loop)
        self._wakes.append(waiter)
        remaining = self.remaining()
        timer = None if remaining is None else self.loop.call_later(
            remaining, lambda: waiter.done() or waiter.set_result(False))
        try:
            # a reply landing in the same loop turn as the deadline counts (asyncio.wait's rule): loop again
            return await waiter or any(f.done() for f in pending)
        finally:
            if timer is not None:
                timer.cancel()
            if waiter in self._wakes:  # (not woken: cancelled, or the deadline passed)
                self._wakes.remove(waiter)

    async def outputs(self) -> list[list[Output]]:
        """Per collected slot, its output headers (waiting for every rank to finish), fetched again from the
        backend as a later await fetches them: rows that rode in a reply and plain values are the caller's own,
        while the controller's stay as received, for the first await and for forwarding."""
        return await self._fetched_again()

    async def _fetched_again(self) -> list[list[Output]]:
        """Per collected slot, its outputs fetched again from the backend: a fresh deserialization of each reply."""
        await self.wait()
        out = []
        for s in self.slots:
            if s.collected:
                try:  # a Ray reply's frame read off the event loop (``_replies.one``)
                    values = await asyncio.gather(*[_replies.one(r) if isinstance(r, ray.ObjectRef) else r
                                                    for r in s.refs])
                except _backend.ReplyUnreadable as e:
                    raise convert_error(e, self.group, self.endpoint, s.rank) from None
                out.append([_as_output(v, s.rank) for v in values])
        return out

    async def result(self) -> Any:
        """The materialized value, a private copy for each await: writing into it changes nothing another reader
        (or a later await) sees. The first await uses the replies as they arrived; a later one fetches them again
        from the backend (a fresh deserialization), as any other reader would."""
        if not self._awaited:
            self._awaited = True
            await self.wait()  # then per collected slot, its outputs as received (never handed out as they are)
            values = self._plain_values()
            if values is not None:  # one plain value a rank (a step's metrics): what _join would give, at once
                return self.collect(values) if self.collect else values
            per_slot = [[_as_output(o.result(), s.rank) for o in s.outputs] for s in self.slots if s.collected]
        else:
            per_slot = await self._fetched_again()
        infos = [p for outs in per_slot for o in outs if o.is_batch for p in o.parts]
        refs = [p.ref for p in infos if _backend.is_ref(p.ref)]
        fetched = await asyncio.gather(*refs) if refs else []  # on the loop: a deadline or cancel ends it at once
        _stats.add_materialized(sum(p.nbytes for p in infos))
        if refs:  # parts from the object store (large): joined off the event loop (a copy of every byte)
            values = await anyio.to_thread.run_sync(self._join, per_slot, infos, fetched)
        else:  # every part rode in its reply (small): joins too small to move
            values = self._join(per_slot, infos, [])
        return self.collect(values) if self.collect else values

    def _plain_values(self) -> list[Any] | None:
        """Per collected slot, its one output's value as received when every such slot has exactly one and none is
        rows (an Output); else None. ``rank_value`` gives such a value as it is, and no bytes are materialized."""
        values = []
        for s in self.slots:
            if s.collected:
                if len(s.outputs) != 1:
                    return None
                v = s.outputs[0].result()
                if isinstance(v, Output):
                    return None
                values.append(v)
        return values

    def _join(self, per_slot: list[list[Output]], infos: list[PartInfo], got: list[Any]) -> list[Any]:
        """Per collected slot, its value: Batch parts (``got``: the fetched ones, in order) joined into fresh
        Batches, plain values as they came."""
        fetched = iter(got)
        by_info = {id(p): (next(fetched) if _backend.is_ref(p.ref) else p.ref) for p in infos}

        def joined(parts: list[PartInfo]) -> Batch:
            if not parts:
                return Batch.from_dict({})
            if len(parts) == 1:
                return by_info[id(parts[0])].clone()
            batches = [by_info[id(p)] for p in parts]
            try:
                return Batch.concat(batches)
            except ValueError:  # (the failure path only) again, each part named by the rank that made it
                try:
                    Batch._concat(batches, _part_names(per_slot, parts))
                except ValueError as e:
                    raise ValueError(f"{self.where()}: the ranks' results do not join into one Batch: {e}") from None
                raise

        values: list[Any] = []
        if self.concat_all and per_slot and all(o.is_batch for outs in per_slot for o in outs):
            # rows of a sharded call that only shard()'s collect joins: one concatenation over every part (not per
            # rank, then again over ranks); a collect of a user's before it gets one value per slot (below)
            values.append(joined([p for outs in per_slot for o in outs for p in o.parts]))
            per_slot = []
        for outs in per_slot:
            values.append(rank_value(outs, joined))
        return values

    # -- cancellation ---------------------------------------------------------------------------------------------
    def fail(self, error: BaseException) -> BaseException:
        """Record ``error`` as the call's outcome (the first one wins), end whatever still runs; returns the
        outcome."""
        if self.error is None:
            self.error = error
            self._end()
        return self.error

    def cancel(self, error: BaseException | None = None) -> None:
        """End everything this call owns: its tasks, the Ray work of every rank and part, and its slots. A call
        that already finished is left as it is (``fut.cancel()`` of a stream read in part says the caller is done
        with it: no stream left undrained; a failure it had stays one nobody awaited)."""
        if self.error is not None or (self.submitted.done() and all(s.finished() for s in self.slots)):
            if error is None:
                self.iteration_ended()
            return
        if error is None:  # fut.cancel(): the caller knows how it ended
            self.looked_at()
        self.error = error or CallCancelledError(f"{self.where()}: the call was cancelled (fut.cancel())")
        self._end()

    def _stop_deadline(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    def _end(self) -> None:
        self._stop_deadline()
        self._wake()
        if not self._looked and not isinstance(self.error, (CallCancelledError, GroupClosedError)):
            self.shared.note_unseen(self)  # a deadline, a death, a failed send: nobody has seen it yet
        if self._ended is not None and not self._ended.done():
            self._ended.set_exception(self.error or CallCancelledError(f"{self.where()}: the call was ended"))
            self._ended.exception()  # retrieved: the error surfaces through wait()
        if self._root is not None and not self._root.done():
            self._root.cancel()
        hosts = self.shared.hosts
        by_rank: dict[int, list[str]] = {}
        for s in self.slots:
            if not s.finished():
                by_rank.setdefault(s.rank, []).extend(_task_id(ref) for ref in s.call_refs)
        for r, ids in by_rank.items():
            if r < len(hosts) and ids:  # cooperative: queued calls are skipped, running ones see Worker.cancelled()
                ack = asyncio.wrap_future(hosts[r].cancel_calls.remote(ids).future())
                ack.add_done_callback(_retrieve)  # a dead rank's refusal needs no one's attention
        for s in self.slots:
            s.finish(self.error)
        self._fail_submit(self.error)
        if self._ticket is not None:  # a root task cancelled before its first step never reaches its finally
            self.shared.gate.release(self._ticket)
        self.shared.live.discard(self)


_IMMUTABLE = frozenset({type(None), bool, int, float, complex, str, bytes})


def _held(plan: Plan) -> Plan:
    """``plan`` with its plain arguments as they are now, for a call sent later than it is made: each pickled and
    unpickled here (a rank gets a copy either way), so a caller's write before the send reaches no rank, as for a
    call sent at once (before, they were read at send time: on the fast path, a reader of a running call got them as
    they were when that call replied, where the general path had sent them). Batches stay: ``_WriteCheck`` refuses
    one written meanwhile (copying would cost a copy of every large argument); so do DataFutures and immutable
    scalars."""
    def held(a: Any) -> Any:
        if type(a) in _IMMUTABLE or isinstance(a, Batch) or hasattr(type(a), "_orc_sources"):
            return a
        try:
            return _frame.loads_frame(_frame.dumps_frame(a, limit=None))  # fresh bytes: no one else reads them
        except Exception:  # noqa: BLE001 - not lost: the send pickles it again and names it (or Ray carries its refs)
            return a

    def args_of(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(held(a) for a in args), {k: held(v) for k, v in kwargs.items()}

    args, kwargs = args_of(plan.args, plan.kwargs)
    return plan.with_(args=args, kwargs=kwargs, per_rank={r: args_of(*ak) for r, ak in plan.per_rank.items()})


class _WriteCheck:
    """The caller's Batches of a call as it was made, to refuse sending them changed. A call sent later than it was
    made (its Batch large and stored first, a union with a future, its group starting, calls queued before it)
    reads its Batches when it is sent; a write in between would send rows as they are then, or a mix of old and
    new (a write during the store). Copying every Batch at call time would cost a copy of every large argument, so
    the call remembers what it can compare cheaply — the columns, each tensor column's object and in-place write
    counter (``Tensor._version``, shared by its views), a copy of each non-tensor column, the meta entries — and a
    change is a DispatchError naming the column, raised before any rank is sent anything."""

    __slots__ = ("_marks",)

    def __init__(self, plan: Plan) -> None:
        batches: dict[int, Batch] = {}
        for args, kwargs in [(plan.args, plan.kwargs), *plan.per_rank.values()]:
            for a in (*args, *kwargs.values()):
                if isinstance(a, Batch) or hasattr(type(a), "_orc_sources"):
                    for c in components(a):
                        if isinstance(c, Batch):
                            batches[id(c)] = c
        self._marks = [(b, _mark(b)) for b in batches.values()]

    def check(self, where: str) -> None:
        for i, (b, mark) in enumerate(self._marks):
            what = _changed(b, mark)
            if what is not None:
                raise DispatchError(
                    f"{where}: a Batch argument (#{i}) was written after the call was made ({what}), before the "
                    f"call was sent; nothing was sent (or, for a stream, no further part), since the rows would be "
                    f"those at send time or a mix. A call reads its Batches when it is sent, which can be later than "
                    f"the call (a large Batch, a union with a future, a group still starting, calls queued before "
                    f"it): pass a copy (batch.clone()), or write only after awaiting the call")


def _part_names(per_slot: list[list[Output]], parts: list[PartInfo]) -> list[str]:
    """Each of ``parts`` named by the rank whose output holds it (its place among that rank's parts when several)."""
    where = {id(p): (o.rank, k, len(outs) > 1 or len(o.parts) > 1)
             for outs in per_slot for o in outs for k, p in enumerate(o.parts or ())}
    return [f"rank {r}'s part {k}" if many else f"rank {r}'s result" for r, k, many in (where[id(p)] for p in parts)]


def _mark(b: Batch) -> tuple:
    tensors = {k: (t, t._version) for k, t in b.tensors.items(include_nested=True, leaves_only=True)}
    return (_names(b), tensors, {k: (a, _column_print(a)) for k, a in b.non_tensors.items()}, dict(b.meta),
            _fingerprint(b.meta))


def _names(b: Batch) -> tuple:
    """Every column name of ``b``, nested leaves too (as tuples): a leaf added under a nested column is a change."""
    return (*b.keys(), *(k for k in b.tensors.keys(include_nested=True, leaves_only=True) if isinstance(k, tuple)))


_ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})  # values no one can change in place


class _ObjectPrint:
    """An object column as it was, compared cheaply. A column of strings, numbers and None (values that cannot
    change in place): its shape and each element's identity (a shallow copy holds them), where a pickle of the
    whole column cost the event loop about 5x as much at the call and again at the send (``bench.batch_checks``).
    Any other column:
    its pickle, so that a dict written in place shows (or, when it cannot be pickled, its elements' identity)."""

    __slots__ = ("shape", "items", "pickled")

    def __init__(self, a: np.ndarray) -> None:
        self.shape = a.shape
        flat = a.ravel()
        self.pickled = None if all(type(v) in _ATOMS for v in flat) else _fingerprint(a)
        self.items = flat.copy() if self.pickled is None else None  # the elements themselves (references)

    def same(self, a: np.ndarray) -> bool:
        """Whether ``a`` holds what it held: the same shape and elements (one replaced by an equal value of the
        same type counts as the same: it pickles alike), none of them changed in place."""
        if a.shape != self.shape:
            return False
        if self.items is None:
            return _fingerprint(a) == self.pickled
        for x, y in zip(a.ravel(), self.items):
            if x is not y:
                p = _fingerprint(x)
                if p is None or p != _fingerprint(y):
                    return False
        return True


def _column_print(a: np.ndarray) -> bytes | _ObjectPrint | None:
    """What a non-tensor column holds, to compare (see ``_same_column``)."""
    return _ObjectPrint(a) if a.dtype == object else _fingerprint(a)


def _same_column(a: np.ndarray, printed: bytes | _ObjectPrint | None) -> bool:
    if isinstance(printed, _ObjectPrint):
        return a.dtype == object and printed.same(a)
    return printed is None or _fingerprint(a) == printed


def _fingerprint(x: Any) -> bytes | None:
    """What ``x`` holds, to compare: a numeric array's bytes (-0.0 is not 0.0 here), anything else (an object
    column, the meta) pickled, so a dict inside it written in place shows. None: it cannot be pickled (its send
    says so), compared by identity."""
    if isinstance(x, np.ndarray) and x.dtype != object:
        return x.tobytes()
    try:
        return _frame.dumps_frame(x, limit=None)
    except Exception:  # noqa: BLE001 - not lost: the send pickles it again and names what failed
        return None


def _changed(b: Batch, mark: tuple) -> str | None:
    """What changed in ``b`` since ``mark`` (None: nothing)."""
    keys, tensors, non_tensors, meta, meta_print = mark
    names = _names(b)
    if names != keys:
        added, gone = sorted(set(names) - set(keys), key=str), sorted(set(keys) - set(names), key=str)
        return f"column(s) {', '.join(map(repr, added + gone))} {'added' if added else 'removed'}"
    now = dict(b.tensors.items(include_nested=True, leaves_only=True))
    for k, (t, version) in tensors.items():
        if now.get(k) is not t:
            return f"column {k!r} replaced"
        if t._version != version:
            return f"column {k!r} written in place"
    for k, (arr, printed) in non_tensors.items():
        cur = b.non_tensors[k]
        if cur is not arr:
            return f"column {k!r} replaced"
        if not _same_column(cur, printed):
            return f"column {k!r} changed"
    if b.meta.keys() != meta.keys() or any(b.meta[k] is not v for k, v in meta.items()):
        return "its meta changed"
    if meta_print is not None and _fingerprint(b.meta) != meta_print:
        return "its meta changed in place"
    return None


def _columns_checked(graph: list[Invocation]) -> None:
    """Keep the good verdict of every call of ``graph`` (``Invocation._apart_graph``): each checked once, and the
    inputs it held for the check let go."""
    for inv in graph:
        inv._columns_ok = True
        inv._read_apart, inv._apart_inputs = [], []


class _LetGo:
    """What a finished call's plan holds where its Batch and DataFuture arguments were (``_let_inputs_go``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<an input of a finished call, let go>"


_LET_GO = _LetGo()


def _all_small(data: list[Any]) -> bool:
    """Whether every data argument is smaller than ``INLINE_BYTES`` (a call sent at once: see ``start``)."""
    for a in data:
        if a.nbytes >= INLINE_BYTES:
            return False
    return True


def _no_refs(encoded: dict[int, tuple[bytes | None, list, tuple]]) -> bool:
    """Whether no rank's frame lifted a ref out, nor takes one as an argument (only Ray may carry those)."""
    for _, refs, top in encoded.values():
        if refs or top:
            return False
    return True


def _row_order(plan: Plan, slots: list[Slot]) -> list[Slot]:
    """A shard call's slots in the order of its rows: the collectors by the DP replica they serve (a mesh need not
    number its replicas in rank order), then the other ranks. Everything that reads a call's rows — ``await``, a
    forwarded future's layout, ``parts()``, ``stream()`` — follows the slot order, so this is the one place that
    decides it. Other calls keep rank order (the order of ``await``'s list)."""
    spec = plan.shard
    if spec is None:
        return slots
    if len(slots) == len(plan.ranks) and plan.ranks == spec.dp_of_rank == spec.collectors == tuple(range(len(slots))):
        return slots  # (one slot per rank, made in rank order, each collecting the DP piece of its number: sorted)
    return sorted(slots, key=lambda s: (0, spec.dp_of_rank[s.rank]) if s.collected else (1, s.rank))


def _sole(eg: BaseExceptionGroup) -> BaseException | None:
    """The one exception inside ``eg`` (nested groups flattened), or None when there are several."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [eg]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        else:
            leaves.append(e)
    return leaves[0] if len(leaves) == 1 else None


def _task_id(ref: Any) -> str:
    """The task id behind a call ref (a generator's is that of its completion ref)."""
    if hasattr(ref, "completed"):
        ref = ref.completed()
    return ref.task_id().hex()


def _retrieve_task(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:  # recorded on the invocation; log what escaped it
        log.error("orchestra: invocation task %s ended with %r", t.get_name(), t.exception())


async def _drain(gen: Any, slot: Slot) -> None:
    try:
        async for ref in gen:
            slot.add(ref)
        slot.finish()
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - surfaced through the future
        slot.finish(e)


async def _forwardable(ref: Any, out: asyncio.Future | None = None,
                       hurry: Callable[[], asyncio.Future] | None = None) -> Any:
    """What a downstream call carries for an upstream output. A fast-path reply: the Output itself (small: it rides
    in the call), or the Ray ref the rank stored a large one under; until it is here the reader waits for it (a
    loop of chains stays on the fast path), unless ``hurry`` says a later call of the reader's group waits behind
    it: then a Ray ref to the outcome, which the rank keeps for the reader (``ChannelReply.forwardable``). A Ray
    reply already here (``out``, its reply future, done well) that holds Batch rows: the Output as the controller
    received it (headers, and rows under ``INLINE_BYTES`` that rode in the reply, which the controller never hands
    out: ``outputs()`` fetches its own), so that no reader fetches it from the controller again. Anything else: the
    ref, which the reading rank fetches when the call runs. A Ray reply is never waited for: a reading call is sent
    at once, so that it holds back no later call of its group (a plain value stays in the object store however
    large; an in-process reference cannot leave its process, and is refused by a Ray group's call)."""
    if isinstance(ref, _channel.ChannelReply):  # waits for the reply, unless a later call is held back (hurry)
        return await ref.forwardable(hurry)
    if (isinstance(ref, ray.ObjectRef) and out is not None and out.done() and not out.cancelled()
            and out.exception() is None):
        value = out.result()
        if isinstance(value, Output) and value.parts is not None:
            return value
    return ref


def _frame_of(args: tuple, kwargs: dict, base: dict | None = None) -> tuple[bytes, list, tuple]:
    """One rank's Ray call as (frame, the refs lifted out of it, the refs given as arguments themselves): those stay
    top-level arguments of the Ray call, which Ray resolves to their values; the frame holds their places. ``base``:
    the call's reductions (``_frame.reductions()``)."""
    top: list[Any] = []

    def lift(v: Any) -> Any:
        if isinstance(v, ray.ObjectRef):
            top.append(v)
            return _frame.Resolved(len(top) - 1)
        return v

    blob, nested = _frame.dumps_call((tuple(lift(v) for v in args), {k: lift(v) for k, v in kwargs.items()}),
                                     base=base)
    return blob, nested, tuple(top)


def _encode(plan: Plan,
            calls: dict[int, tuple[tuple, dict, list]]) -> dict[int, tuple[bytes | None, list, tuple]] | None:
    """Every rank's (frame, the ObjectRefs lifted out of it, the refs given as arguments themselves, which Ray
    resolves to values before the call), pickled before any rank is sent anything: this is the call's
    serialization check (ranks given the same arguments share one pickle). None when the call takes
    Ray's per-argument path (in-process ranks, or a frame over ``FRAME_BYTES``), after ``_preflight`` checked
    it. A value that cannot be pickled raises ``_preflight``'s DispatchError, naming rank, argument and column."""
    if not plan.group.pool.backend.own_process:
        _preflight(plan, calls)
        return None
    out: dict[int, tuple[bytes | None, list, tuple]] = {}
    done: dict[tuple, tuple[bytes, list, tuple]] = {}
    kept = []  # the argument objects stay alive while their ids key ``done``
    base: dict | None = None  # the reductions, read once for every rank of the call
    try:
        for r, (args, kwargs, refs) in calls.items():
            a, kw = _with_refs(args, kwargs, refs)
            if not a and not kw:  # nothing to pickle: the Ray call carries no argument at all
                out[r] = (None, [], ())
                continue
            kept.append((a, kw))
            key = (tuple(map(id, a)), tuple((k, id(v)) for k, v in kw.items()))
            enc = done.get(key)
            if enc is None:
                if base is None:
                    base = _frame.reductions()
                enc = done[key] = _frame_of(a, kw, base)
            out[r] = enc
    except _frame.NeedsRay:  # too large for a frame: Ray serializes it argument by argument
        _preflight(plan, calls)
        return None
    except Exception:
        _preflight(plan, calls)  # names the rank, argument and column
        raise
    return out


def _frames_of(plan: Plan, readers: tuple[int, ...]) -> dict[int, tuple[bytes | None, list, tuple]] | None:
    """The frames of a call whose arguments are all here and small (``_send_now``): its shards described, each
    rank's arguments built and pickled (``_encode``); ``readers``: the call's ``_readers``."""
    return _encode(plan, _per_rank_calls(plan, _describe_batches(plan), readers))


def _ray_args(encoded: dict[int, tuple[bytes | None, list, tuple]] | None, calls: dict[int, tuple[tuple, dict, list]],
              r: int) -> tuple[tuple, dict]:
    """What rank ``r``'s Ray call carries: its frame (and the refs lifted out of it), with the refs given as arguments
    themselves as the only positional arguments (Ray resolves them); its arguments as they are without a frame."""
    if encoded is None:
        args, kwargs, refs = calls[r]
        return _with_refs(args, kwargs, refs)
    blob, refs, top = encoded[r]
    if blob is None:
        return top, {}
    return top, ({FRAME_KWARG: blob, FRAME_REFS_KWARG: refs} if refs else {FRAME_KWARG: blob})


def _with_refs(args: tuple, kwargs: dict, refs: list) -> tuple[tuple, dict]:
    """Upstream header refs ride nested in one keyword argument; the worker fetches them (see Host._call)."""
    if not refs:
        return args, kwargs
    return args, {**kwargs, REFS_KWARG: list(refs)}


def _per_rank_calls(plan: Plan, described: dict[int, Any],
                    readers: tuple[int, ...] = ()) -> dict[int, tuple[tuple, dict, list]]:
    """(args, kwargs, top-level refs) for every executing rank, with data arguments turned into descriptors.
    A shard call also tells each rank the DP sizes its output's readers may have (``readers``: see
    ``Host._store``) and, for a controller-made shard, where its rows sit in the batch."""
    spec = plan.shard
    per_dp_readers = ({d: sum(1 for r in plan.ranks if spec.dp_of_rank[r] == d) for d in range(spec.dp_size)}
                      if spec else {})
    out = {}
    store: dict[Span | None, tuple] = {}
    interned: dict[tuple, tuple] = {}  # one SHARED_KWARG object per distinct value: _encode dedupes frames by id
    for r in plan.ranks:
        args, kwargs = plan.per_rank.get(r, (plan.args, plan.kwargs))
        b = _ArgBuilder()
        shared: list[int | str] = []  # the arguments other readers share (Host._resolve copies them)
        given: list[Span | None] = []

        def convert(key: int | str, a: Any) -> Any:
            per_dp = described.get(id(a))
            if per_dp is None:
                # the caller's own ref (ray.put): resolved on every rank to the one stored object, shared memory
                # that each rank must copy before its endpoint may write into it (not a shard only it reads)
                if _backend.is_ref(a):
                    shared.append(key)
                return a
            d = spec.dp_of_rank[r] if spec is not None else 0
            sources, layout, guards = per_dp[d]
            for g in guards:  # fetched with the inputs (a failed upstream rank fails this call), never read
                b.add(g)
            if (len(sources) == 1 and len(sources[0]) == 1 and isinstance(sources[0][0], PartInfo)
                    and layout.kind == "whole" and not layout.pad_rows):
                # a controller-made shard: the Batch itself, or its ref for Ray to resolve; an object more than one
                # rank reads (the TP ranks of a mesh replica) must be copied by each reader before use
                if per_dp_readers.get(d, 2) > 1 and _backend.is_ref(sources[0][0].ref):  # inline: each rank's own
                    shared.append(key)
                given.append(layout.span)
                return sources[0][0].ref
            return DataArg(tuple(Source(tuple(b.add(o) for o in src)) for src in sources), layout,
                           values_ok=spec is None)

        new_args = tuple([convert(i, a) for i, a in enumerate(args)])
        new_kwargs = {k: convert(k, v) for k, v in kwargs.items()}
        if shared:
            key = tuple(shared)
            new_kwargs[SHARED_KWARG] = interned.setdefault(key, key)
        if spec is not None and readers:
            span = given[0] if given and all(g == given[0] for g in given) else None
            # one object per distinct value: ranks given the same arguments (a mesh replica) still share one pickle;
            # the span as a plain tuple (a dataclass costs a rank more to unpickle than the rest of the frame)
            new_kwargs[STORE_KWARG] = store.setdefault(
                span, (readers, None if span is None else (span.start, span.rows, span.total)))
        out[r] = (new_args, new_kwargs, b.refs)
    return out


class _ArgBuilder:
    """Collects the refs a rank's call takes as top-level arguments (Ray resolves them before the call runs)."""

    def __init__(self) -> None:
        self.refs: list[Any] = []
        self._index: dict[Any, int] = {}

    def add(self, o: Any) -> Any:
        if _backend.is_ref(o):
            i = self._index.get(o)
            if i is None:
                i = self._index[o] = RefAt(len(self.refs))
                self.refs.append(o)
            return i
        return o


def _check_joinable(plan: Plan, c: Invocation) -> None:
    """Refuse, before sending, a shard read of a future whose ranks' results do not join (``columns_apart``) by the
    headers here; the readers of headers not here yet refuse it alike, each by all of them (a reader of one
    upstream rank's rows alone cannot: see ``_check_read_apart``)."""
    refusal = columns_apart(c.known_outputs())
    if refusal is not None:
        raise DispatchError(f"{plan.where()}: the future of {c.where()} is not one Batch: {refusal}")


def _check_padded_again(plan: Plan, comps: list[Any], layout: Layout) -> None:
    """Refuse, before sending, a pad read of rows that hold padding of their own (``padded_again``), for each input
    whose part headers are here; an input still being produced is refused by every rank alike, by the same rule."""
    for c in comps:
        parts = c.known_parts() if isinstance(c, Invocation) else None
        rows, own = ((len(c), c.pad_count) if isinstance(c, Batch) else
                     (sum(p.rows for p in parts), sum(p.pad for p in parts)) if parts is not None else (0, 0))
        refusal = padded_again(rows, layout, own)
        if refusal is not None:
            raise DispatchError(f"{plan.where()}: {refusal}")


def _put(b: Batch, plan: Plan, what: str, rank: int | None = None, nbytes: int | None = None) -> PartInfo:
    """``b`` as a part: itself when small, else stored (``nbytes``: its size when the caller knows it)."""
    nbytes = b.nbytes if nbytes is None else nbytes
    if nbytes < INLINE_BYTES:
        return PartInfo(b, len(b), nbytes, pad=b.pad_count)
    try:
        ref = plan.group.pool.backend.put(b)
    except Exception as e:
        raise _unserializable(plan, what, rank, b, e) from None
    _stats.add_put(nbytes)
    return PartInfo(ref, len(b), nbytes, pad=b.pad_count)


def _describe_batches(plan: Plan) -> dict[int, Any]:
    """Descriptors of the data arguments when every one is a concrete, small Batch (the send-now path)."""
    if plan.shard is None:
        return {}
    return {id(a): _describe_batch(a, plan.shard, plan) for a in plan.data_args()}


def _describe_batch(a: Batch, spec: Any, plan: Plan) -> dict[int, tuple[list[list[Any]], Layout, list[Any]]]:
    """A concrete Batch split by the controller: DP piece d becomes one part that only DP replica d reads."""
    D = spec.dp_size
    rows = len(a)
    batch = a
    if spec.pad and rows % D:
        if a.pad_count:
            raise DispatchError(f"{plan.where()}: pad() would pad a batch that has {a.pad_count} padding row(s) of "
                                f"its own (pad_to_multiple), and its pieces could not say which are which: unpad() "
                                f"it first, or pass it padded to a call without pad()")
        # pad()'s filler rows are the controller's to drop (Layout.pad_rows): the pieces carry no pad count of them
        batch = a.pad_to_multiple(D)._pad_free()
    sizes = balanced_sizes(len(batch), D)
    try:
        shards = batch.split(sizes)
    except Exception:  # a column torch cannot split (sparse, ...) is one the wire cannot carry: named, if so
        try:
            a._check_tensors()
        except TypeError as why:
            raise DispatchError(f"{plan.where()}: a Batch argument cannot be split into its {D} shards ({why}); no "
                                f"rank was sent the call") from None
        raise
    row_bytes = batch._bytes_per_row()  # a shard's size is its rows' share (None: each shard's own sum)
    out, start = {}, 0
    for d, (s, n) in enumerate(zip(shards, sizes)):
        pad_rows = min(n, max(0, start + n - rows)) if batch is not a else 0
        span = Span(start, n - pad_rows, rows)
        start += n
        rank = spec.dp_of_rank.index(d) if d in spec.dp_of_rank else None
        out[d] = ([[_put(s, plan, "argument", rank, None if row_bytes is None else n * row_bytes)]],
                  Layout("whole", pad_rows=pad_rows, span=span), [])
    return out


# -- all or nothing: every rank's arguments serialize before any rank is sent anything -------------------------------
class _DryRun(cloudpickle.CloudPickler):
    """Pickles to nowhere, skipping what the backend serializes by its own means (refs, tensors, numeric arrays, and
    — for in-process ranks only — the in-process backend's references and handles, which travel by reference)."""

    def __init__(self, file: io.BytesIO, in_process_ok: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.in_process_ok = in_process_ok

    def persistent_id(self, obj: Any) -> Any:
        if _in_process(obj):
            if self.in_process_ok:
                return 0
            raise _cannot_leave_process(obj)
        if (isinstance(obj, torch.Tensor) or _backend.is_ref(obj)
                or (isinstance(obj, np.ndarray) and obj.dtype != object)):
            return 0
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Batch):  # tensor columns travel as raw buffers: only the other columns can fail,
            obj._check_wire()  # a TensorDict value that is not a tensor, which the wire would drop,
            obj._check_tensors()  # and a tensor the wire cannot carry (jagged, sparse, quantized, meta, DTensor)
            return tuple, ((obj.non_tensors, obj.meta),)
        return super().reducer_override(obj)


def _in_process(obj: Any) -> bool:
    """An object of the in-process backend (a reference, handle or Sequencer state) that travels by reference."""
    return getattr(type(obj), "_orc_in_process", False)


def _cannot_leave_process(obj: Any) -> TypeError:
    return TypeError(f"{obj!r} belongs to the in-process backend (backend='local'): a future, reference or Sequencer "
                     f"of in-process ranks cannot reach ranks in other processes. Await it and pass the value, or run "
                     f"both groups on one backend")


def _dry_run(value: Any, in_process_ok: bool = False) -> None:
    _DryRun(io.BytesIO(), in_process_ok).dump(value)


_SIMPLE = (int, float, str, bytes, bool, type(None), ray.ObjectRef, torch.Tensor)


def _only_tensors(v: Any) -> bool:
    """A Batch of plain tensor columns alone with plain meta: nothing in it can fail to serialize (cheap check; a
    value put into its TensorDict that is not a tensor, and a tensor the wire cannot carry — jagged, sparse,
    quantized, on the meta device, a subclass that redefines its contents — are left to the dry run, which names
    them)."""
    if not (isinstance(v, Batch) and not v.non_tensors and all(
            type(k) is str and isinstance(m, (int, float, str, bool, type(None))) for k, m in v.meta.items())):
        return False
    try:
        v._check_wire()
    except TypeError:
        return False
    return _tensors_travel(v)


def _tensors_travel(b: Batch) -> bool:
    """Whether every tensor column of ``b`` is one the wire carries (``Batch._check_tensors``)."""
    try:
        b._check_tensors()
    except TypeError:
        return False
    return True


def _preflight(plan: Plan, calls: dict[int, tuple[tuple, dict, list]]) -> None:
    """Raise DispatchError naming the rank, argument and column of the first value that cannot be serialized."""
    checked: set[int] = set()
    in_process_ok = not plan.group.pool.backend.own_process
    for r, (args, kwargs, refs) in calls.items():
        stray = None if in_process_ok else next((x for x in refs if _in_process(x)), None)
        if stray is not None:
            raise _unserializable(plan, "a forwarded future", r, refs, _cannot_leave_process(stray))
        for name, v in [*((i, a) for i, a in enumerate(args)), *kwargs.items()]:
            if isinstance(v, _SIMPLE) or id(v) in checked:
                continue
            if _only_tensors(v):  # (a broadcast's ranks share the object: checked once)
                checked.add(id(v))
                continue
            try:
                _dry_run(v, in_process_ok)
            except Exception as e:  # noqa: BLE001 - re-raised as DispatchError naming where
                raise _unserializable(plan, f"argument {name!r}" if isinstance(name, str) else f"argument {name}",
                                      r, v, e) from None
            checked.add(id(v))


def _unserializable(plan: Plan, what: str, rank: int | None, value: Any, e: BaseException) -> DispatchError:
    column = ""
    batch = value if isinstance(value, Batch) else getattr(value, "ref", None) if isinstance(value, PartInfo) else None
    if isinstance(value, DataArg):
        batch = next((o.ref for s in value.sources for o in s.outputs
                      if isinstance(o, PartInfo) and isinstance(o.ref, Batch)), None)
    if isinstance(batch, Batch) and _tensors_travel(batch):  # (else the error itself names the tensor column)
        for k, col in batch.non_tensors.items():
            try:
                _dry_run(col)
            except Exception:  # noqa: BLE001
                column = f", column {k!r}"
                break
        else:
            try:
                _dry_run(batch.meta)
            except Exception:  # noqa: BLE001
                column = ", its meta"
    where = f"rank {rank}" if rank is not None else "every rank"
    return DispatchError(f"{plan.where()}: {what} for {where}{column} cannot be serialized ({type(e).__name__}: "
                         f"{e}); no rank was sent the call. Pass picklable values (or keep such objects on the "
                         f"worker).")


def _as_output(x: Any, rank: int) -> Output:
    return x if isinstance(x, Output) else Output(rank, value=x)


def convert_error(e: BaseException, group: str, endpoint: str, rank: int | None) -> BaseException:
    """Turn a backend's error into orchestra's: the worker's own WorkerError, or WorkerDiedError for a dead rank."""
    if isinstance(e, _backend.RankDied):
        return _died(e, group, endpoint, rank)
    if isinstance(e, _backend.ReplyUnreadable) or _unreadable_on_ray(e):
        cause = e.cause if isinstance(e, _backend.ReplyUnreadable) else None
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(e.client_exc)  # type: ignore[attr-defined]
        return WorkerError(f"the reply could not be unpickled where it was read ({what}); return values whose classes "
                           f"the controller and the reading ranks can import and rebuild", group=group, rank=rank,
                           endpoint=endpoint, exc_type=type(cause).__name__ if cause is not None else "RaySystemError")
    if isinstance(e, _backend.TaskFailed):
        return WorkerError(str(e), group=group, rank=rank, endpoint=endpoint, remote_traceback=e.remote_traceback,
                           exc_type=type(e.cause or e).__name__)
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, WorkerError):
            return _plain(cause)
        if isinstance(cause, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)):
            return _died(cause, group, endpoint, rank)
        if isinstance(cause, ray.exceptions.TaskCancelledError):
            return _cancelled(group, endpoint)
        return WorkerError(str(cause or e), group=group, rank=rank, endpoint=endpoint,
                           remote_traceback=str(e), exc_type=type(cause or e).__name__)
    if isinstance(e, WorkerError):
        return _plain(e) if type(e) not in (WorkerError, WorkerDiedError) else e
    if isinstance(e, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError,
                      ray.exceptions.WorkerCrashedError)):
        return _died(e, group, endpoint, rank)
    if isinstance(e, ray.exceptions.TaskCancelledError):
        return _cancelled(group, endpoint)
    return e


def _unreadable_on_ray(e: BaseException) -> bool:
    """Ray's report of a value that its deserializer could not rebuild (a ``RaySystemError`` from
    ``deserialize_objects``): the reply exists, it cannot be read here."""
    return isinstance(e, ray.exceptions.RaySystemError) and "deserializ" in (getattr(e, "traceback_str", "") or "")


def _cancelled(group: str, endpoint: str) -> CallCancelledError:
    return CallCancelledError(f"group {group!r}, endpoint {endpoint!r}: the call was cancelled")


def _plain(e: WorkerError) -> WorkerError:
    """A WorkerError without Ray's dual-class wrapper, so that ``except orc.WorkerError`` reads naturally."""
    cls = WorkerDiedError if isinstance(e, WorkerDiedError) else WorkerError
    return cls(e.message, group=e.group, role=e.role, rank=e.rank, endpoint=e.endpoint,
               remote_traceback=e.remote_traceback, exc_type=e.exc_type)


def _died(e: BaseException, group: str, endpoint: str, rank: int | None) -> WorkerDiedError:
    return WorkerDiedError(
        f"the worker process{'' if rank is None else f' of rank {rank}'} died while running this call "
        f"({type(e).__name__}{f': {e}' if isinstance(e, _backend.RankDied) and str(e) else ''}); check the worker's "
        f"log for an OOM kill or crash (the group's report of the death, group.health() or on_death, names the file), "
        f"then recreate the group", group=group, rank=rank, endpoint=endpoint,
        exc_type="WorkerDied")


def closed_error(group: str, why: str = "the group") -> GroupClosedError:
    return GroupClosedError(f"group {group!r} was shut down ({why}); create a new WorkerGroup to run more calls")
