"""The fast path: one persistent socket per rank for a group's repeated small calls.

A training loop calls the same endpoints on the same group again and again with small, concrete arguments. On the
general path each such call is one Ray actor task per rank (argument binding, task submission, an ObjectRef and its
async completion): about 1 ms of controller CPU per rank. On the fast path the controller writes one frame per rank
into a Unix socket that the rank's compute lane reads in a loop (``Host.serve_channel``), and the rank writes its
reply back on the same socket: no Ray task, no ObjectRef, one pickle each way.

When it applies (decided in ``Invocation._send``, with ``_Shared.fast_channel`` in ``_group.py``): a Ray group, for
a call that is not streaming and whose arguments, as sent, hold no
ObjectRef or actor handle and pickle to at most ``FRAME_BYTES`` (concrete data under ``INLINE_BYTES``, and DataFuture
arguments whose outputs came back by value: ``ChannelReply.forwardable``; ``orchestra._frame`` is the frame codec,
which the general path's Ray calls use too), after
``ORCHESTRA_FAST_PATH_AFTER`` such calls in a row (default 4). Any other call first releases the channel
(``release``): the rank's loop returns after the frames already written, and the Ray call queued behind it runs next,
so every rank still sees the group's calls in the order they were made. A reply holding a Batch of
``INLINE_BYTES`` or more (or a value of more than ``FRAME_BYTES``) is kept by the rank and taken over Ray's control
lane (``Host.take_result``), so large payloads still go to the object store and never through the controller; it is
put into the object store when its call returns (``Host._snapshot``: the next call may write into it). A reading call
waits for a fast reply before it is sent, unless a later call of its group waits behind it: then it carries a Ray
ref to the outcome, which the rank keeps for it (``ChannelReply.forwardable``, ``Host.retain``/``retained``).

Semantics do not change: the rank runs the same ``Host._call`` (private inputs, padding, stats, traces, errors with
group, rank and endpoint); cancellation names the call's own id (``Worker.cancelled()`` sees it); deadlines,
supervision and ``aclose`` work as on the general path; a rank that dies closes its socket, and its calls fail with
``WorkerDiedError`` (a write that finds a rank gone fails that rank's part only: the call's frames still go to the
other ranks before their sockets are shut, ``_lost``), and the channel is released, so the other ranks' loops
return. Setting ``ORCHESTRA_FAST_PATH=0`` turns the fast path off.

Joining: ranks on the controller's node connect to a Unix socket in a fresh ``0700`` directory of the controller's
temp dir (only this user's processes on this node can connect); ranks on other nodes connect over TCP to the address
Ray uses for the controller's node (never every interface), on a free port. Either way a rank's first frame is the
channel's secret (32 random bytes, handed to the rank in its ``serve_channel`` call, over Ray) and its rank; the
controller reads nothing else from a connection until then, unpickles nothing from it, and closes one that sends
anything else. The listeners close once every rank has joined. No call frame is written to any rank before every
rank has joined: when a rank cannot join (its connect refused or timed out after ``CONNECT_TIMEOUT_S``: e.g. a
firewall between its node and the controller's), the calls sent meanwhile, which ran nowhere, go through Ray
instead (``_resend``), and its group's fast path is turned off (``group.fast_path`` reads False; set it back to True
to try again); they fail as sent to no rank when the channel was released first (a later call already went through
Ray), and as died when the rank's process died. Strangers are closed after ``HELLO_TIMEOUT_S`` without a hello, at
most ``MAX_STRANGERS`` wait, and a failing accept rests the listener. Frames cross the cluster network
unencrypted, as Ray's own traffic does: run clusters on a private network (``docs/cluster.md``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import hmac
import itertools
import logging
import os
import pickle
import secrets
import shutil
import socket
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO

import ray

from . import _backend, _replies
from ._errors import WorkerDiedError, WorkerError
from ._frame import loads_frame

__all__ = ["Channel", "ChannelReply", "call_number", "connect", "recv_frame", "send_frame", "enabled", "threshold"]

log = logging.getLogger("orchestra")

_LEN = struct.Struct("!I")
_RANK = struct.Struct("!I")
SECRET_BYTES = 32
_HELLO_BYTES = SECRET_BYTES + _RANK.size
CONNECT_TIMEOUT_S = 20.0  # a rank that cannot reach the controller's socket in this long fails to join
HELLO_TIMEOUT_S = 10.0  # a connection that has not proved the secret in this long is closed (a rank sends it at once)
MAX_STRANGERS = 16  # connections waiting to prove the secret, beyond one per rank: the oldest is closed for a new one
ACCEPT_PAUSE_S = 0.1  # after an accept that failed (out of file descriptors ...), the listener rests this long
_ids = itertools.count()
_PREFIX = uuid.uuid4().hex[:8]


_OFF, _ON = {"0", "false", "no", "off"}, {"1", "true", "yes", "on", ""}


def enabled() -> bool:
    """Whether the fast path may be used at all (``ORCHESTRA_FAST_PATH``: ``0``/``false``/``no``/``off`` turn it off,
    ``1``/``true``/``yes``/``on`` or unset leave it on; anything else is refused)."""
    raw = os.environ.get("ORCHESTRA_FAST_PATH", "1")
    value = raw.strip().lower()
    if value in _OFF or value in _ON:
        return value not in _OFF
    raise ValueError(f"ORCHESTRA_FAST_PATH={raw!r}: set it to 0 (or false, no, off) to turn the fast path off, or to "
                     f"1 (or true, yes, on) to leave it on")


def threshold() -> int:
    """How many fast-path-eligible calls in a row open a group's channel (``ORCHESTRA_FAST_PATH_AFTER``)."""
    raw = os.environ.get("ORCHESTRA_FAST_PATH_AFTER", "4")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"ORCHESTRA_FAST_PATH_AFTER={raw!r}: set it to a whole number of calls of at least 1 "
                         f"(default 4), or set ORCHESTRA_FAST_PATH=0 to turn the fast path off")
    return n


@contextlib.contextmanager
def batch_scheduled() -> Any:
    """While a rank's serve thread holds its channel: SCHED_BATCH on Linux, put back as it was afterwards. A thread
    of that policy, woken, does not preempt the thread running on its core: a frame written to it no longer stops
    the controller in the middle of writing the same call's frames to the other ranks (on 2 cores, 1.2 involuntary
    switches of the controller per call before, 0.1 after; ``docs/benchmarks.md``). Its share of the CPU is
    unchanged. Threads it starts meanwhile inherit the policy. Where the policy cannot be set (another OS, a
    sandbox that forbids it), nothing changes."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:  # (no such call here, or not allowed)
        log.debug("fast path: the serve thread keeps its scheduling policy (%r)", e)
        before = None
    if before is None:  # (the loop runs outside the handler: its own errors carry no context of this one)
        yield
        return
    try:
        yield
    finally:
        try:
            os.sched_setscheduler(0, *before)
        except OSError as e:
            log.warning("fast path: the serve thread could not take its scheduling policy back (%r); it stays "
                        "SCHED_BATCH", e)


def call_number(call_id: str) -> int:
    """The place of fast-path call ``call_id`` in the order its controller made them (``Channel.new_id``)."""
    return int(call_id.rsplit("-", 1)[1])


def send_frame(sock: socket.socket, body: bytes) -> None:
    """Write one frame (blocking socket; the rank's side)."""
    sock.sendall(_LEN.pack(len(body)) + body)


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    """``n`` bytes of ``stream``; None at its end (also inside them). A buffered stream gives them in one read, a raw
    one (``buffering=0``: no read-ahead) in as many as the socket needs."""
    data = stream.read(n)
    if data is None or len(data) == n:
        return data
    got = bytearray(data)
    while len(got) < n:
        more = stream.read(n - len(got))
        if not more:
            return None
        got += more
    return bytes(got)


def recv_frame(stream: BinaryIO) -> bytes | None:
    """Read one frame from the file of a blocking socket (``sock.makefile("rb")``: the rank's side, whose buffer cuts
    what one ``recv`` brings into frames, so a small frame costs one system call); None at the end of the stream."""
    head = _read_exact(stream, _LEN.size)
    if head is None:
        return None
    return _read_exact(stream, _LEN.unpack(head)[0])


def connect(address: str | tuple[str, int], secret: bytes, rank: int) -> socket.socket:
    """A rank's side of joining a channel: connect to ``address`` (a Unix socket path on the controller's node, or
    the controller's (ip, port) from another node) and say which rank it is, proving it with the channel's
    ``secret`` (handed to the rank over Ray); the controller reads nothing else from a connection until then. A
    blocking socket, TCP_NODELAY on TCP (one small frame each way per call: Nagle's delay would add ~40 ms)."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        pause = 0.001
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock.connect(address)
                break
            except BlockingIOError:  # a Unix socket's backlog is full (strangers, or many ranks at once): wait a bit
                if time.monotonic() + pause >= deadline:
                    raise TimeoutError(f"could not connect to {address!r} in {CONNECT_TIMEOUT_S} s: its backlog "
                                       f"stayed full") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
        sock.settimeout(None)
        send_frame(sock, secret + _RANK.pack(rank))
    except OSError as e:  # the controller hears of it as this rank's join failure: say where it tried
        sock.close()
        raise ConnectionError(f"rank {rank} could not connect to the controller's fast-path socket at {address!r} "
                              f"({type(e).__name__}: {e})") from e
    except BaseException:
        sock.close()
        raise
    return sock


class ChannelReply:
    """A fast-path call's reply on one rank, in the shape the call path expects of a ref: ``task_id().hex()`` (what
    cancellation names), awaitable (a fresh copy each time, as a ref's ``ray.get`` is), and ``out``, an asyncio
    future of the first copy. ``forwardable()`` is what a downstream call carries: the Output itself (it rides in
    the downstream call's arguments) or, for a reply the rank kept, the Ray ref of ``Host.take_result``."""

    __slots__ = ("call_id", "rank", "out", "payload", "ray_ref", "channel", "endpoint", "first")

    def __init__(self, call_id: str, rank: int, out: asyncio.Future, channel: Channel, endpoint: str = "") -> None:
        self.call_id, self.rank, self.out, self.channel, self.endpoint = call_id, rank, out, channel, endpoint
        self.payload: bytes | None = None
        self.ray_ref: Any = None
        # a done callback of ``out`` that the reply's arrival runs at once, in the same turn of the loop, instead of
        # scheduling it (the call's own bookkeeping: one turn of the loop and one scheduled callback less a reply)
        self.first: Callable[[asyncio.Future], None] | None = None

    def settle(self, value: Any, error: BaseException | None = None) -> None:
        """Complete ``out`` with ``value`` (or ``error``), running ``first`` at once when it is still registered."""
        first = self.first
        now = first is not None and self.out.remove_done_callback(first)
        if error is None:
            self.out.set_result(value)
        else:
            self.out.set_exception(error)
        if now:
            try:
                first(self.out)
            except Exception as e:  # noqa: BLE001 - reported as the loop reports a failed callback (asyncio's Handle)
                self.out.get_loop().call_exception_handler(
                    {"message": f"exception in the callback of fast-path reply {self.call_id}", "exception": e,
                     "future": self.out})

    def task_id(self) -> _backend.TaskId:
        return _backend.TaskId(self.call_id)

    async def _fetch(self) -> Any:
        await asyncio.shield(self.out)
        if self.ray_ref is not None:
            return await _replies.one(self.ray_ref)  # its frame read off the event loop
        return loads_frame(self.payload, private=True)  # each read its own buffers: the bytes are read again

    def __await__(self) -> Any:
        return self._fetch().__await__()

    async def forwardable(self, hurry: Callable[[], asyncio.Future] | None = None) -> Any:
        """What a reading call carries for this reply: once it is here, the reply itself (a fresh copy) or the ref
        of a kept one. ``hurry``: a future that is done when a later call of the reader's group waits for the
        reader to be sent; the reader then carries a Ray ref to the outcome instead (``Host.retain``: the rank
        keeps it for ``Host.retained``), so that it is sent now and holds back no later call (which the upstream
        call may be waiting for). Without ``hurry`` (or when the rank says the call is done) it waits."""
        if not self.out.done() and hurry is not None:
            later = hurry()
            await asyncio.wait({self.out, later}, return_when=asyncio.FIRST_COMPLETED)
            if not self.out.done():
                ref = await self.channel.ask(self)
                if ref is not None:
                    return ref
        await asyncio.shield(self.out)
        # unpickled again (from bytes every read copies first): only pickled into the reader's frame
        return self.ray_ref if self.ray_ref is not None else loads_frame(self.payload)

    def __repr__(self) -> str:
        return f"<ChannelReply {self.call_id} rank {self.rank}>"


class _Conn:
    """One rank's socket on the controller's loop: a write buffer drained when the socket can take more, and a
    read buffer cut into reply frames."""

    def __init__(self, channel: Channel, sock: socket.socket) -> None:
        self.channel, self.sock = channel, sock
        self.rank: int | None = None
        self.out = bytearray()
        self.inbuf = bytearray()
        self.writing = False
        self.deadline: asyncio.TimerHandle | None = None  # a stranger's time to prove the secret
        channel.loop.add_reader(sock.fileno(), self._on_read)

    def write(self, data: bytes) -> None:
        if self.writing or self.out:
            self.out += data
            return
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self.channel._lost(self, e)
            return
        if n < len(data):
            self.out += data[n:]
            self.writing = True
            self.channel.loop.add_writer(self.sock.fileno(), self._on_write)

    def _on_write(self) -> None:
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.channel._lost(self, e)
            return
        del self.out[:n]
        if not self.out:
            self.writing = False
            self.channel.loop.remove_writer(self.sock.fileno())
            self.channel._flushed(self)

    def _on_read(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.channel._lost(self, e)
            return
        if not data:
            self.channel._lost(self, None)
            return
        if not self.inbuf and self.rank is not None and len(data) > _LEN.size \
                and _LEN.unpack_from(data)[0] == len(data) - _LEN.size:  # one whole frame, the usual reply: as is
            self.channel._frame(self, data[_LEN.size:])
            return
        self.inbuf += data
        buf = self.inbuf
        while len(buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(buf)
            if self.rank is None and n != _HELLO_BYTES:  # nothing but a hello is read from a stranger
                self.channel._refuse(self, f"a first frame of {n} bytes, not a hello")
                return
            if len(buf) < _LEN.size + n:
                break
            body = bytes(buf[_LEN.size:_LEN.size + n])
            del buf[:_LEN.size + n]
            self.channel._frame(self, body)
            if self.sock.fileno() == -1:  # refused or lost while handling it
                return

    def close(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.sock.fileno() == -1:
            return
        loop = self.channel.loop
        if not loop.is_closed():
            loop.remove_reader(self.sock.fileno())
            if self.writing:
                loop.remove_writer(self.sock.fileno())
        self.sock.close()


class Channel:
    """The fast path of one group's ranks (see the module docstring). Made on the event loop that sends on it;
    ``call`` writes a frame and returns a ChannelReply; ``release`` lets the ranks' loops return after the frames
    already written (the channel then takes no new call); ``close`` ends it at once (the group is closing)."""

    def __init__(self, hosts: list[Any], group: str, remote: frozenset[int] = frozenset(),
                 node_ip: str | None = None,
                 on_join_failed: Callable[[Channel, int, BaseException], None] | None = None) -> None:
        """``remote``: the ranks on other nodes than the controller's, which join over TCP at ``node_ip`` (the
        address Ray uses for this node); the others join over a Unix socket. ``on_join_failed(rank, error)``: a
        rank could not join (the calls sent meanwhile went through Ray, or failed as run by no rank)."""
        self.loop = asyncio.get_running_loop()
        self.group = group
        self.n = len(hosts)
        self._hosts = list(hosts)
        self.open = True  # takes new calls
        self.closed = False
        self.sent = 0  # calls written (counted on rank 0's socket)
        self.secret = secrets.token_bytes(SECRET_BYTES)  # a rank proves with it that Ray sent it here
        self.key = f"chan-{_PREFIX}-{next(_ids)}"  # names this channel's session on each rank
        self._on_join_failed = on_join_failed
        self._dir: str | None = None
        self._path: str | None = None
        self._listeners: list[socket.socket] = []
        self.joined = False  # every rank has connected: frames are written from then on, never before
        self.join_error: BaseException | None = None
        # resent calls Ray could not deliver whose rank is still to hear they never ran: the retry timer, if waiting
        self._owed_tells: dict[tuple[int, str], asyncio.TimerHandle | None] = {}
        self._tells_ended = False  # closed with the group, or orphaned: nothing more is told from here
        addresses: list[Any] = [None] * self.n
        try:
            if len(remote) < self.n:
                self._dir = tempfile.mkdtemp(prefix="orc-fast-")  # 0700: this user's processes only
                _DIRS.add(self._dir)
                self._path = os.path.join(self._dir, "s")
                srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listeners.append(srv)
                srv.bind(self._path)  # OSError for a temp dir path too long for a Unix socket, a full disk ...
                for r in range(self.n):
                    addresses[r] = self._path
            if remote:
                if not node_ip:
                    raise OSError("no address of this node to listen on for ranks on other nodes")
                srv = socket.socket(socket.AF_INET6 if ":" in node_ip else socket.AF_INET, socket.SOCK_STREAM)
                self._listeners.append(srv)
                srv.bind((node_ip, 0))  # the node's own address (never every interface), a free port
                where = srv.getsockname()[:2]
                for r in remote:
                    addresses[r] = where
            for srv in self._listeners:
                srv.listen(self.n + 8)  # room for a stranger or two, refused once read
                srv.setblocking(False)
        except BaseException:
            self._stop_listening()
            self._remove_dir()
            raise
        self.tcp_address = where if remote else None
        self._conns: list[_Conn] = []  # accepted, rank not yet known
        self._by_rank: dict[int, _Conn] = {}
        # each rank's frames (call id, frame) sent before every rank joined, in call order
        self._queued: dict[int, list[tuple[str, bytes]]] = {r: [] for r in range(self.n)}
        self._pending: dict[str, ChannelReply] = {}
        self._pending_by_rank: dict[int, set[str]] = {r: set() for r in range(self.n)}
        self._done_ranks: set[int] = set()
        for srv in self._listeners:
            self.loop.add_reader(srv.fileno(), self._on_accept, srv)
        self._serves = [asyncio.wrap_future(h.serve_channel.remote(self.key, addresses[r], self.secret).future())
                        for r, h in enumerate(hosts)]
        for r, f in enumerate(self._serves):
            f.add_done_callback(lambda f, r=r: self._serve_ended(r, f))

    # -- sending --------------------------------------------------------------------------------------------------
    def call(self, rank: int, frame: bytes, call_id: str, endpoint: str = "") -> ChannelReply:
        """Send one call's frame (already pickled with ``dumps_frame``) to ``rank``: written once every rank has
        joined (so a rank that cannot join leaves the call run by no rank), at once after that."""
        if rank == 0:
            self.sent += 1
        reply = ChannelReply(call_id, rank, asyncio.Future(loop=self.loop), self, endpoint)
        self._pending[call_id] = reply
        self._pending_by_rank[rank].add(call_id)
        self._write(rank, call_id, frame)
        return reply

    async def ask(self, reply: ChannelReply) -> Any:
        """A Ray ref to ``reply``'s outcome, which its rank keeps for a reader (``Host.retain``/``retained``); None
        when the call already finished there (its reply is on its way here) or never ran (its reply fails)."""
        if reply.ray_ref is not None:  # its ranks could not join: the call went through Ray (_resend)
            return reply.ray_ref
        host = self._hosts[reply.rank]
        # both sent before any await: ``retained`` ends the rank's entry whatever happens to this task meanwhile
        ask = f"{reply.call_id}:{next(_ids)}"  # this reader's own request: several may read one call
        answer_ref = host.retain.remote(self.key, reply.call_id, ask)
        value_ref = host.retained.remote(ask)
        try:
            answer = await answer_ref
        except ray.exceptions.RayActorError as e:  # the rank is gone: its reply fails with it
            log.debug("group %r rank %d: retain of %s failed: %r", self.group, reply.rank, reply.call_id, e)
            return None
        return value_ref if answer == "retaining" else None

    @staticmethod
    def new_id() -> str:
        return f"fast-{_PREFIX}-{next(_ids)}"

    def _write(self, rank: int, call_id: str, frame: bytes) -> None:
        if not self.joined:
            self._queued.setdefault(rank, []).append((call_id, frame))
        elif rank in self._by_rank:
            self._by_rank[rank].write(_LEN.pack(len(frame)) + frame)
        else:  # lost a moment ago, in this same send (see _lost): its part of the call fails, the others' go out
            self._fail_rank(rank, _backend.RankDied(f"rank {rank}'s fast-path socket had closed"))

    def release(self) -> None:
        """Take no new call; every rank returns to the general path after the frames already written (its socket
        is shut for writing once they are out). A channel whose event loop ended is closed instead, released before
        or not: nothing would accept its ranks' connections or write their frames any more, and a rank waiting for
        them holds its compute lane."""
        if self.orphaned():  # made in an asyncio.run that ended (or a loop stopped): nothing reads here any more
            self.close()
            return
        if not self.open:
            return
        self.open = False
        if self.joined:  # else each rank's side is shut once every rank joined and its frames are out
            for conn in self._by_rank.values():
                if not conn.writing:
                    self._shut(conn)
        self._maybe_finish()

    def orphaned(self) -> bool:
        """Whether no event loop will serve this channel again: its loop is closed, or stopped while its group is
        used from another one (``run_until_complete`` without ``close``, then ``asyncio.run``)."""
        if self.loop.is_closed():
            return True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # sync code: the loop may still be run again
            return False
        return running is not self.loop and not self.loop.is_running()

    def close(self, error: BaseException | None = None) -> None:
        """End now: replies not yet in fail with ``error`` (the group closed or a rank died). On a channel closed
        already, it ends the tells it still owes (see ``_end_owed_tells``) once the group closes or its loop ended."""
        if self.closed:
            if self.owes_tells and (error is not None or self.orphaned()):
                self._end_owed_tells(error)
            return
        self.open = False
        self.closed = True
        try:
            if not self.loop.is_closed():  # futures of a closed loop cannot be failed (nobody can await them)
                for reply in list(self._pending.values()):
                    if not reply.out.done():
                        reply.out.set_exception(error or _backend.RankDied("the fast-path channel was closed"))
                        reply.out.exception()
            self._pending.clear()
        finally:
            try:
                self._stop_listening()
                for conn in [*self._conns, *self._by_rank.values()]:
                    conn.close()
            finally:
                self._remove_dir()
        if error is not None or self.orphaned():  # else (every reply in, the loop alive) what is owed goes on
            self._end_owed_tells(error)
        if error is None:  # the ranks live on (a loop that ended): results they keep for unread replies are dropped
            for rank, ids in self._pending_by_rank.items():
                if ids:
                    self._hosts[rank].discard_kept.remote(sorted(ids))  # Ray owns it; its reply carries nothing
                    self._hosts[rank].forget_session.remote(self.key)  # and readers waiting for them are told
                    ids.clear()

    @property
    def owes_tells(self) -> bool:
        """Whether a rank is still to hear that a resent call never ran (``_never_ran``): the channel's group keeps
        it until then, closed or not, so that a loop's end or the group's close ends them (``close``)."""
        return bool(self._owed_tells)

    def _stop_listening(self) -> None:
        listeners, self._listeners = self._listeners, []
        for srv in listeners:
            if not self.loop.is_closed():
                self.loop.remove_reader(srv.fileno())
            srv.close()
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            _DIRS.discard(self._dir)

    def _shut(self, conn: _Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError as e:  # the rank already went away: its end is reported by its serve call
            log.debug("group %r: fast path rank %s: shutdown: %r", self.group, conn.rank, e)

    def _flushed(self, conn: _Conn) -> None:
        if not self.open:
            self._shut(conn)

    # -- receiving ------------------------------------------------------------------------------------------------
    def _on_accept(self, srv: socket.socket) -> None:
        try:
            sock, _ = srv.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # e.g. out of file descriptors: the connection waits in the backlog, which stays
            # readable, so the listener rests a moment rather than failing the same accept on every turn of the loop
            log.warning("group %r: fast path: accept failed (%r); trying again in %s s", self.group, e,
                        ACCEPT_PAUSE_S)
            self.loop.remove_reader(srv.fileno())
            self.loop.call_later(ACCEPT_PAUSE_S, self._listen_again, srv)
            return
        try:
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:  # reset before it was set up: nothing to read from it
            log.debug("group %r: fast path: a connection ended as it was accepted: %r", self.group, e)
            sock.close()
            return
        if len(self._conns) >= self.n + MAX_STRANGERS:  # a flood of connections: the longest silent one goes
            self._refuse(self._conns[0], f"silent while more than {MAX_STRANGERS} others connected")
        conn = _Conn(self, sock)
        self._conns.append(conn)
        conn.deadline = self.loop.call_later(HELLO_TIMEOUT_S, self._too_slow, conn)

    def _listen_again(self, srv: socket.socket) -> None:
        if srv in self._listeners:  # still listening (not everyone joined, not closed)
            self.loop.add_reader(srv.fileno(), self._on_accept, srv)

    def _too_slow(self, conn: _Conn) -> None:
        if conn.rank is None and conn in self._conns:
            self._refuse(conn, f"no hello within {HELLO_TIMEOUT_S} s")

    def _refuse(self, conn: _Conn, why: str) -> None:
        """A connection that is not one of this channel's ranks (no secret, a wrong one, a rank already in): closed
        without reading anything more from it."""
        try:
            peer = conn.sock.getpeername()
        except OSError:
            peer = "?"
        log.warning("group %r: fast path: refused a connection from %r (%s)", self.group, peer or "a local process",
                    why)
        if conn in self._conns:
            self._conns.remove(conn)
        conn.close()

    def _hello(self, conn: _Conn, body: bytes) -> None:
        """A connection's first frame: the channel's secret and the rank's number."""
        if len(body) != _HELLO_BYTES or not hmac.compare_digest(body[:SECRET_BYTES], self.secret):
            self._refuse(conn, "without this channel's secret")
            return
        (rank,) = _RANK.unpack_from(body, SECRET_BYTES)
        if rank >= self.n or rank in self._by_rank or self.join_error is not None or self.closed:
            self._refuse(conn, f"rank {rank}, which has no place here now")
            return
        conn.rank = rank
        if conn.deadline is not None:
            conn.deadline.cancel()
            conn.deadline = None
        self._conns.remove(conn)
        self._by_rank[rank] = conn
        if len(self._by_rank) < self.n:
            return
        self._stop_listening()  # everyone is in: nobody else may connect
        for stranger in self._conns:  # connected, never proved anything: they hold nothing more here
            stranger.close()
        self._conns.clear()
        self.joined = True
        for r, c in list(self._by_rank.items()):  # a write that finds a rank gone removes it meanwhile
            for _, frame in self._queued.pop(r, []):
                c.write(_LEN.pack(len(frame)) + frame)
            if not self.open and not c.writing:
                self._shut(c)

    def _frame(self, conn: _Conn, body: bytes) -> None:
        if conn.rank is None:
            self._hello(conn, body)
            return
        call_id, kind, payload = pickle.loads(body)
        reply = self._pending.pop(call_id, None)
        if reply is None:
            return
        self._pending_by_rank[reply.rank].discard(call_id)
        if reply.out.done():  # the call ended first (cancel, deadline): a rank's kept result is still taken
            if kind == "kept":
                self._take(reply, conn.rank, call_id, discard=True)
            return
        if kind in ("ok", "err"):
            try:
                value = loads_frame(payload, private=True)  # the first copy: later reads unpickle ``payload`` again
            except Exception as e:  # noqa: BLE001 - e.g. a class the controller cannot import: this call fails
                reply.settle(None, _backend.ReplyUnreadable(e))
                return
            if kind == "ok":
                reply.payload = payload
                reply.settle(value)
            else:
                reply.settle(None, value)
        else:  # "kept": too large for a frame; the rank stores it as usual when asked on its control lane
            self._take(reply, conn.rank, call_id)

    def _take(self, reply: ChannelReply, rank: int, call_id: str, discard: bool = False) -> None:
        ref = self._hosts[rank].take_result.remote(call_id, discard)
        if discard:
            asyncio.wrap_future(ref.future()).add_done_callback(_retrieve)
            return
        self._watch_ref(reply, ref)

    @staticmethod
    def _watch_ref(reply: ChannelReply, ref: Any, unreached: Callable[[], None] | None = None) -> None:
        """``reply`` comes by Ray: ``ref`` is its general-path reply (a kept result, or a call resent through Ray).
        ``unreached`` is called if Ray could not reach the rank (``ActorUnavailableError``: the call may not have
        run, and the rank may live on)."""
        reply.ray_ref = ref
        wrapped = _replies.one(ref)  # its frame (``Host._reply``, ``Host._snapshot``), read off the event loop

        def copy(f: asyncio.Future) -> None:
            if reply.out.done():
                _retrieve(f)
            elif f.cancelled():
                reply.out.cancel()
            elif f.exception() is not None:
                reply.out.set_exception(f.exception())
            else:
                reply.out.set_result(f.result())
            if unreached is not None and not f.cancelled() and isinstance(f.exception(),
                                                                           ray.exceptions.ActorUnavailableError):
                unreached()
        wrapped.add_done_callback(copy)

    def _lost(self, conn: _Conn, error: BaseException | None) -> None:
        """A rank's socket ended: after a release that is its loop returning; otherwise the rank is gone."""
        rank = conn.rank
        conn.close()
        if rank is None:
            if conn in self._conns:
                self._conns.remove(conn)
            return
        self._by_rank.pop(rank, None)
        self._done_ranks.add(rank)
        if not self.joined:  # its process died, or its loop failed: its serve call says which (_serve_ended)
            log.debug("group %r: fast path rank %d: socket closed before every rank joined (%r)", self.group, rank,
                      error)
            return
        ids = self._pending_by_rank.get(rank, set())
        if ids:
            self._fail_rank(rank, _backend.RankDied(
                f"rank {rank}'s fast-path socket closed with {len(ids)} call(s) unanswered"
                f"{f' ({error!r})' if error else ''}"))
        # A rank left: no new call may take the channel, and the others' loops return. Their sockets are shut on the
        # next turn of the loop, not now: a write that found this rank gone may be in the middle of sending one
        # call to every rank (or of writing what was queued while ranks joined), and the ranks after it must still
        # get their frame (else that call would run on some live ranks and not on others).
        self.open = False
        self.loop.call_soon(self._after_loss)

    def _after_loss(self) -> None:
        for conn in list(self._by_rank.values()):
            if not conn.writing:
                self._shut(conn)
        self._maybe_finish()

    def _fail_rank(self, rank: int, error: BaseException) -> None:
        """Fail every call of ``rank`` still waiting for its reply."""
        ids = self._pending_by_rank.get(rank, set())
        if ids:
            self._forget([rank])
        for call_id in list(ids):
            reply = self._pending.pop(call_id, None)
            if reply is not None and not reply.out.done():
                reply.out.set_exception(error)
                reply.out.exception()
        ids.clear()

    def _forget(self, ranks: list[int]) -> None:
        """Tell ``ranks`` that calls of this channel failed here without running there: a reader that asked one of
        them for such a call's outcome (``Host.retain``) is told it never runs, instead of waiting for it."""
        for r in ranks:
            ref = self._hosts[r].forget_session.remote(self.key)
            if not self.loop.is_closed():
                asyncio.wrap_future(ref.future()).add_done_callback(_retrieve)  # a dead rank's refusal is no news

    def _serve_ended(self, rank: int, f: asyncio.Future) -> None:
        """A rank's serve loop returned (after a release) or failed (it died, or could not connect)."""
        if f.cancelled():
            return
        e = f.exception()
        if e is None and not self.joined:  # its socket was closed before it proved the secret (too slow, or pushed
            # out by a flood of strangers), so its loop saw the end of the stream: it can no longer join
            e = ConnectionError("its connection was closed before it had said which rank it is (no hello within "
                                f"{HELLO_TIMEOUT_S} s, or pushed out by more than {MAX_STRANGERS} other "
                                f"connections)")
        if e is not None and not self.joined:
            # only a death is one: an unavailable actor may come back, and then the calls run through Ray
            self._join_failed(rank, e, died=isinstance(e, ray.exceptions.ActorDiedError))
        elif e is not None:
            self._fail_rank(rank, e)
            self.release()  # the other ranks' loops return: their compute lanes are free for Ray calls again
            if not isinstance(e, _DIED):
                log.error("group %r rank %d: the fast-path loop failed: %r", self.group, rank, e)
        self._done_ranks.add(rank)
        self._maybe_finish()

    def _join_failed(self, rank: int, error: BaseException, died: bool = False) -> None:
        """``rank`` could not join (its loop failed before it connected or before every rank had: its serve call
        failed): no frame was written to any rank, and the ranks already in see their socket shut at once.

        The calls sent meanwhile then run through Ray (``_resend``) when the channel is still open: no call of the
        group went through Ray since they were made, so each rank still runs the group's calls in the order they
        were made. Otherwise they fail as sent to no rank. ``died``: the rank's process is gone; each call fails
        with WorkerDiedError naming it, as on the general path, and the fast path stays on. Else the group hears
        of it (it turns its fast path off: a firewall between nodes would fail every later channel too)."""
        if self.join_error is not None or self.closed:
            return
        self.join_error = error
        cause = getattr(error, "cause", None) or error  # a Ray task error: the rank's own exception
        resend = self.open and not died
        waiting = [r for r, q in self._queued.items() if q]  # ranks with calls written to none of them
        if resend:
            log.warning("group %r: rank %d could not join the fast path (%s: %s); the calls sent meanwhile go "
                        "through Ray", self.group, rank, type(cause).__name__, cause)
            self._resend()
        for reply in list(self._pending.values()):
            if reply.out.done() or reply.ray_ref is not None:
                continue
            if died:
                reply.out.set_exception(WorkerDiedError(
                    f"the worker process of rank {rank} died before the call was sent to any rank ({cause}); check "
                    f"the worker's log for an OOM kill or crash, then recreate the group", group=self.group,
                    rank=rank, endpoint=reply.endpoint or None, exc_type="WorkerDied"))
            else:
                reply.out.set_exception(WorkerError(
                    f"rank {rank} could not join the fast path ({type(cause).__name__}: {cause}); the call was sent "
                    f"to no rank (its channel had been released: the group's later calls go through Ray, and this one "
                    f"must not run after them). The group's calls now go through Ray. If ranks on other nodes cannot "
                    f"reach this node's ephemeral ports, allow it or set ORCHESTRA_FAST_PATH=0", group=self.group,
                    rank=rank,
                    endpoint=reply.endpoint or None, exc_type="FastPathJoinError"))
            reply.out.exception()
        self._pending.clear()
        for ids in self._pending_by_rank.values():
            ids.clear()
        self._queued.clear()
        if not resend:
            self._forget(waiting)
        self._stop_listening()
        self.open = False
        for conn in self._by_rank.values():
            self._shut(conn)
        if self._on_join_failed is not None and not died:
            self._on_join_failed(self, rank, error)
        self._maybe_finish()

    def _resend(self) -> None:
        """Send each call written to no rank as a Ray call of its rank's ``Host.run_fast_call`` (the same frame,
        run under the same call id: its cancellation still reaches it), rank by rank in the order they were made;
        its reply then comes as a kept one's does (``reply.ray_ref``). One that Ray could not deliver is named to
        its rank as never run (``Host.forget_calls``): a reader in another group waiting for its outcome there would
        wait forever."""
        for rank, queued in self._queued.items():
            live = [(c, f, reply) for c, f in queued
                    if (reply := self._pending.get(c)) is not None and not reply.out.done()]
            for i, (call_id, frame, reply) in enumerate(live):
                # the last one ends the rank's session there (its serve loop, which got no frame, left it open)
                ref = self._hosts[rank].run_fast_call.remote(self.key, frame, i == len(live) - 1)
                self._watch_ref(reply, ref, unreached=functools.partial(self._never_ran, rank, call_id))

    def _never_ran(self, rank: int, call_id: str, tries: int = 0) -> None:
        """Tell ``rank`` that resent call ``call_id`` did not reach it (``Host.forget_calls``), so that a reader
        waiting there for its outcome is answered; retried while Ray cannot reach the rank either (the same
        outage), until it lands or the rank is found dead (a reader on a dead rank fails with it). The channel owns
        the tell until it lands: ``close`` ends what is still owed (see there)."""
        log.debug("group %r rank %d: fast-path call %s resent through Ray could not reach the rank (try %d)",
                  self.group, rank, call_id, tries)
        if self._tells_ended:
            return
        key = (rank, call_id)
        self._owed_tells[key] = None
        try:
            ref = self._hosts[rank].forget_calls.remote(self.key, [call_id])
        except Exception as e:  # noqa: BLE001 - Ray itself going down: the reader goes with it
            del self._owed_tells[key]
            log.warning("group %r rank %d: could not say that fast-path call %s never ran (%r)", self.group, rank,
                        call_id, e)
            return

        def landed(f: concurrent.futures.Future) -> None:  # on Ray's thread: the channel's state is the loop's
            e = None if f.cancelled() else f.exception()
            # the loop ended: the tell stays owed, and ``close`` sends it once more (twice told is harmless: the
            # rank's Sessions.never keeps its first answer)
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._tell_landed, rank, call_id, tries, e)
        ref.future().add_done_callback(landed)

    def _tell_landed(self, rank: int, call_id: str, tries: int, error: BaseException | None) -> None:
        """A ``forget_calls`` of ``_never_ran`` ended: done, or tried again later while Ray says "unavailable"."""
        key = (rank, call_id)
        if key not in self._owed_tells:  # the channel closed meanwhile, dropping it
            return
        if isinstance(error, ray.exceptions.ActorUnavailableError) and tries < _NEVER_RAN_TRIES:
            self._owed_tells[key] = self.loop.call_later(min(0.1 * 2 ** tries, 5.0), self._never_ran, rank, call_id,
                                                         tries + 1)
            return
        del self._owed_tells[key]
        if isinstance(error, ray.exceptions.ActorUnavailableError):
            log.warning("group %r rank %d: Ray could not reach the rank to say that fast-path call %s never ran, "
                        "%d times; a reader in another group waiting there for its outcome waits until that rank dies",
                        self.group, rank, call_id, tries + 1)
        elif error is not None:  # the rank died (a reader there fails with it), or Ray is going down
            log.debug("group %r rank %d: forget_calls: %r", self.group, rank, error)

    def _end_owed_tells(self, error: BaseException | None) -> None:
        """At close: the group closing (``error``) kills the ranks, and a reader waiting on one fails with it, so
        what is still owed is dropped. A channel closed because its loop ended sends each owed tell once more, Ray
        owning it (no loop of this channel will retry)."""
        owed, self._owed_tells = self._owed_tells, {}
        self._tells_ended = True
        by_rank: dict[int, list[str]] = {}
        for (rank, call_id), timer in owed.items():
            if timer is not None:
                timer.cancel()
            by_rank.setdefault(rank, []).append(call_id)
        for rank, ids in by_rank.items():
            if error is not None:
                log.debug("group %r rank %d: not telling it that fast-path calls %s never ran: the channel closed "
                          "(%r)", self.group, rank, ids, error)
                continue
            try:
                self._hosts[rank].forget_calls.remote(self.key, sorted(ids))  # Ray owns it; its reply carries nothing
            except Exception as e:  # noqa: BLE001 - Ray itself going down: the reader goes with it
                log.warning("group %r rank %d: could not say that fast-path calls %s never ran (%r)", self.group,
                            rank, ids, e)

    def _maybe_finish(self) -> None:
        if not self.open and not self._pending and len(self._done_ranks) == self.n and not self.closed:
            self.close()


_DIED = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)  # a rank's process is gone

_NEVER_RAN_TRIES = 12  # tries to say a resent call never ran: ~35 s of backoff, as long as Ray says "unavailable"

_DIRS: set[str] = set()  # socket directories of channels not yet closed: removed at exit at the latest


@atexit.register
def _remove_dirs() -> None:
    for d in list(_DIRS):
        shutil.rmtree(d, ignore_errors=True)



def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()
