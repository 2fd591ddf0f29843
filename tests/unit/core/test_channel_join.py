"""How ranks join a fast-path channel (orchestra._channel), without Ray: the test plays the ranks. A connection is
read only after it proves, with the channel's secret, that Ray sent it; no frame is written to any rank until every
rank has joined, so a rank that cannot join leaves the calls sent meanwhile run by no rank; ranks on other nodes
join over TCP on the node's own address."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import socket
import struct
from types import SimpleNamespace

import anyio
import pytest

from orchestra import WorkerError, _channel, _frame


class _Serve:
    """A rank's ``serve_channel`` as the channel calls it: records its arguments, its outcome set by the test."""

    def __init__(self) -> None:
        self.args: tuple = ()
        self.fut: concurrent.futures.Future = concurrent.futures.Future()

    def remote(self, *args):
        self.args = args
        return SimpleNamespace(future=lambda: self.fut)


class _Host:
    def __init__(self) -> None:
        self.serve_channel = _Serve()
        self.discard_kept = SimpleNamespace(remote=lambda ids: None)
        self.resent: list[str] = []  # the call ids sent through Ray's run_fast_call, in order
        self.run_fast_call = SimpleNamespace(remote=self._run_fast_call)
        self.forgotten: list[str] = []  # sessions the controller said will not run
        self.forget_session = SimpleNamespace(remote=self._forget_session)
        self.never: list[tuple[str, list[str]]] = []  # calls the controller said will not run
        self.forget_calls = SimpleNamespace(remote=self._forget_calls)
        self.unreachable = False  # Ray cannot deliver run_fast_call (ActorUnavailableError)
        self.unreachable_tells = 0  # how many forget_calls Ray cannot deliver either before one lands
        self.lasts: list[bool] = []  # run_fast_call's ``last``, in order

    def _run_fast_call(self, path: str, frame: bytes, last: bool = False):
        call_id = pickle.loads(frame)[0]
        self.resent.append((path, call_id))
        self.lasts.append(last)
        if self.unreachable:
            return _unavailable()
        return _done(("by ray", call_id))

    def _forget_calls(self, path: str, ids: list[str]):
        if self.unreachable_tells:
            self.unreachable_tells -= 1
            return _unavailable()
        self.never.append((path, ids))
        return _done(None)

    def _forget_session(self, path: str):
        self.forgotten.append(path)
        return _done(None)


def _unavailable():
    import ray

    fut = concurrent.futures.Future()
    fut.set_exception(ray.exceptions.ActorUnavailableError("the connection to the actor was lost", None))
    return SimpleNamespace(future=lambda: fut)


def _done(value):
    fut = concurrent.futures.Future()
    fut.set_result(value)
    return SimpleNamespace(future=lambda: fut)


def _recv(sock: socket.socket) -> bytes | None:
    """One frame of ``sock`` (None at its end), read through a raw file of it: no byte past the frame is taken."""
    with sock.makefile("rb", buffering=0) as f:
        return _channel.recv_frame(f)


def _rank_side(address, secret: bytes, rank: int) -> tuple[socket.socket, bytes | None]:
    """Join as ``rank`` and read the first frame (None: the controller shut its side first)."""
    sock = _channel.connect(address, secret, rank)
    return sock, _recv(sock)


def _reply(sock: socket.socket, frame: bytes) -> None:
    call_id, _role, _name, _blob = pickle.loads(frame)
    _channel.send_frame(sock, pickle.dumps((call_id, "ok", _frame.dumps_frame(("done", call_id)))))


async def _until(cond) -> None:
    with anyio.fail_after(30):  # bounds a broken build only
        while not cond():
            await asyncio.sleep(0.001)


def _call(ch: _channel.Channel, rank: int) -> _channel.ChannelReply:
    call_id = ch.new_id()
    return ch.call(rank, pickle.dumps((call_id, "w", "step", _frame.NO_ARGUMENTS)), call_id, "step")


async def test_a_connection_without_the_secret_is_refused_unread_and_the_rank_still_joins(caplog):
    hosts = [_Host()]
    ch = _channel.Channel(hosts, "g")
    try:
        key, address, secret = hosts[0].serve_channel.args
        assert key == ch.key and isinstance(address, str) and secret == ch.secret and len(secret) == 32
        def stranger(data: bytes) -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(address)
            s.sendall(data)
            return s

        strangers = [await anyio.to_thread.run_sync(stranger, data) for data in (
            struct.pack("!I", 36) + b"x" * len(secret) + struct.pack("!I", 0),  # a wrong secret
            struct.pack("!I", 36) + pickle.dumps(0).ljust(36, b"."),  # a pickle: never unpickled here
            struct.pack("!I", 1 << 30))]  # announces 1 GiB: refused before any of it is buffered
        with caplog.at_level(logging.WARNING, logger="orchestra"):
            for s in strangers:
                assert await anyio.to_thread.run_sync(s.recv, 1) == b""  # closed by the controller
                s.close()
        assert sum("refused a connection" in r.getMessage() for r in caplog.records) == 3
        assert not ch._by_rank and not ch.joined
        silent = await anyio.to_thread.run_sync(stranger, b"")  # connects, never says a word
        await _until(lambda: len(ch._conns) == 1)
        reply = _call(ch, 0)
        sock, frame = await anyio.to_thread.run_sync(_rank_side, address, secret, 0)
        assert ch.joined and frame is not None
        assert await anyio.to_thread.run_sync(silent.recv, 1) == b"" and not ch._conns  # closed once all joined
        silent.close()
        _reply(sock, frame)
        with anyio.fail_after(30):
            assert await reply == ("done", reply.call_id)
        sock.close()
    finally:
        ch.close()


async def test_no_frame_is_written_until_every_rank_joined_and_a_rank_that_cannot_join_sends_them_through_ray():
    """The calls sent while the ranks joined went to no rank: when one cannot join, each rank runs them through
    Ray, in the order they were made, and the group hears of it (it turns its fast path off)."""
    failed = []
    hosts = [_Host(), _Host()]
    ch = _channel.Channel(hosts, "g", on_join_failed=lambda ch, rank, e: failed.append((rank, e)))
    try:
        replies = [[_call(ch, r) for r in (0, 1)] for _ in range(3)]  # three calls to both ranks
        _, address, secret = hosts[0].serve_channel.args
        sock0 = await anyio.to_thread.run_sync(_channel.connect, address, secret, 0)
        await _until(lambda: 0 in ch._by_rank)
        assert not ch.joined
        hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
        # rank 0 sees its socket shut without any frame: its loop returns before the Ray calls run
        assert await anyio.to_thread.run_sync(_recv, sock0) is None
        sock0.close()
        for r in (0, 1):  # under the channel's session: a reader that asked a rank for one gets its outcome
            assert hosts[r].resent == [(ch.key, call[r].call_id) for call in replies]
        assert hosts[0].forgotten == hosts[1].forgotten == []
        with anyio.fail_after(30):
            for call in replies:
                for reply in call:
                    assert await reply == ("by ray", reply.call_id)
                    assert await reply.forwardable() is reply.ray_ref  # a reader carries the Ray reply
        assert [r for r, _ in failed] == [1] and not ch.open
    finally:
        ch.close()


async def test_a_rank_that_cannot_join_after_the_channel_was_released_fails_the_calls_as_sent_to_no_rank():
    """Released before the join failed: a call of the group went through Ray after these, so they cannot run now
    (they would run after it): each fails, naming the rank, as run by no rank."""
    failed = []
    hosts = [_Host(), _Host()]
    ch = _channel.Channel(hosts, "g", on_join_failed=lambda ch, rank, e: failed.append((rank, e)))
    try:
        replies = [_call(ch, 0), _call(ch, 1)]
        ch.release()  # the next call of the group goes through Ray
        hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
        for reply in replies:
            with pytest.raises(WorkerError) as e:
                with anyio.fail_after(30):
                    await reply.out
            assert e.value.rank == 1 and e.value.endpoint == "step" and e.value.group == "g"
            assert "sent to no rank" in str(e.value) and "cannot reach the socket" in str(e.value)
        assert hosts[0].resent == hosts[1].resent == []
        assert hosts[0].forgotten == hosts[1].forgotten == [ch.key]  # a reader that asked for one is told
        assert [r for r, _ in failed] == [1]
    finally:
        ch.close()


async def test_ranks_on_other_nodes_join_over_tcp_on_the_nodes_own_address():
    hosts = [_Host(), _Host()]
    ch = _channel.Channel(hosts, "g", remote=frozenset({1}), node_ip="127.0.0.1")
    try:
        (_, local, secret), (_, remote, secret1) = hosts[0].serve_channel.args, hosts[1].serve_channel.args
        assert isinstance(local, str) and secret1 == secret
        assert remote == ch.tcp_address and remote[0] == "127.0.0.1" and remote[1] > 0  # never every interface
        replies = [_call(ch, 0), _call(ch, 1)]
        (s0, f0), (s1, f1) = await asyncio.gather(anyio.to_thread.run_sync(_rank_side, local, secret, 0),
                                                 anyio.to_thread.run_sync(_rank_side, remote, secret, 1))
        assert s1.family == socket.AF_INET and s1.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert ch._by_rank[1].sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        _reply(s0, f0)
        _reply(s1, f1)
        with anyio.fail_after(30):
            assert [await r for r in replies] == [("done", r.call_id) for r in replies]
        with pytest.raises(ConnectionRefusedError):  # everyone is in: the port is closed
            socket.create_connection(remote, timeout=5).close()
        ch.release()
        assert await anyio.to_thread.run_sync(_recv, s1) is None  # the rank's loop would return
        s0.close()
        s1.close()
    finally:
        ch.close()


async def _joined(n: int, **kw) -> tuple[_channel.Channel, list[_Host], list[socket.socket]]:
    hosts = [_Host() for _ in range(n)]
    ch = _channel.Channel(hosts, "g", **kw)
    _, address, secret = hosts[0].serve_channel.args
    socks = [await anyio.to_thread.run_sync(_channel.connect, address, secret, r) for r in range(n)]
    await _until(lambda: ch.joined)
    return ch, hosts, socks


async def test_a_rank_found_gone_while_a_call_is_sent_fails_its_part_only_and_the_ranks_after_it_still_get_theirs():
    ch, _, socks = await _joined(3)
    try:
        socks[1].close()  # rank 1's process is gone; the controller has not read its end yet
        replies = [_call(ch, r) for r in range(3)]  # one call to every rank, sent with no turn of the loop between
        for r in (0, 2):  # the ranks after the lost one got their frame: the call did not run on rank 0 alone
            frame = await anyio.to_thread.run_sync(_recv, socks[r])
            assert frame is not None and pickle.loads(frame)[0] == replies[r].call_id
            _reply(socks[r], frame)
        with anyio.fail_after(30):
            assert await replies[0] == ("done", replies[0].call_id)
            assert await replies[2] == ("done", replies[2].call_id)
            with pytest.raises(_channel._backend.RankDied, match="rank 1"):
                await replies[1].out
        assert not ch.open  # no new call takes the channel; the live ranks' loops return after their frames
        for r in (0, 2):
            assert await anyio.to_thread.run_sync(_recv, socks[r]) is None
    finally:
        for s in socks:
            s.close()
        ch.close()


async def test_a_rank_found_gone_while_the_queued_frames_go_out_does_not_cost_the_others_theirs():
    hosts = [_Host() for _ in range(3)]
    ch = _channel.Channel(hosts, "g")
    socks = []
    try:
        replies = [_call(ch, r) for r in range(3)]  # queued: no rank has joined
        _, address, secret = hosts[0].serve_channel.args
        socks = [await anyio.to_thread.run_sync(_channel.connect, address, secret, r) for r in range(2)]
        await _until(lambda: len(ch._by_rank) == 2)
        # rank 0 stops reading after its hello (a write to it fails; nothing is readable on its socket yet), then
        # rank 2 joins: the frames queued meanwhile are written, and the write to rank 0 finds it gone
        socks[0].shutdown(socket.SHUT_RD)
        socks.append(await anyio.to_thread.run_sync(_channel.connect, address, secret, 2))
        for r in (1, 2):
            frame = await anyio.to_thread.run_sync(_recv, socks[r])
            assert frame is not None and pickle.loads(frame)[0] == replies[r].call_id
            _reply(socks[r], frame)
        with anyio.fail_after(30):
            assert [await replies[r] for r in (1, 2)] == [("done", replies[r].call_id) for r in (1, 2)]
            with pytest.raises(_channel._backend.RankDied, match="rank 0"):
                await replies[0].out
    finally:
        for s in socks:
            s.close()
        ch.close()


async def test_a_rank_that_dies_before_every_rank_joined_fails_the_calls_as_died_and_leaves_the_fast_path_on():
    import ray

    failed = []
    hosts = [_Host(), _Host()]
    ch = _channel.Channel(hosts, "g", on_join_failed=lambda ch, rank, e: failed.append(rank))
    try:
        replies = [_call(ch, 0), _call(ch, 1)]
        _, address, secret = hosts[0].serve_channel.args
        sock1 = await anyio.to_thread.run_sync(_channel.connect, address, secret, 1)
        await _until(lambda: 1 in ch._by_rank)
        sock1.close()  # rank 1's process dies after its hello: Ray then reports its serve call failed
        await _until(lambda: 1 not in ch._by_rank)
        hosts[1].serve_channel.fut.set_exception(ray.exceptions.ActorDiedError())
        for reply in replies:
            with pytest.raises(WorkerError) as e:
                with anyio.fail_after(30):
                    await reply.out
            assert type(e.value).__name__ == "WorkerDiedError" and e.value.rank == 1
            assert "sent to any rank" in str(e.value) and "ORCHESTRA_FAST_PATH" not in str(e.value)
        assert failed == []  # a death is no reason to believe the network refuses the fast path
        assert not ch.open
    finally:
        ch.close()


async def test_a_silent_connection_is_closed_after_the_hello_deadline_and_a_flood_evicts_the_longest_silent(
        monkeypatch):
    monkeypatch.setattr(_channel, "HELLO_TIMEOUT_S", 0.2)
    monkeypatch.setattr(_channel, "MAX_STRANGERS", 2)
    hosts = [_Host()]
    ch = _channel.Channel(hosts, "g")
    strangers = []
    try:
        _, address, secret = hosts[0].serve_channel.args

        def connect() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(address)
            return s

        for i in range(3):  # one per rank plus MAX_STRANGERS may wait; the fourth pushes out the first
            strangers.append(await anyio.to_thread.run_sync(connect))
            await _until(lambda: len(ch._conns) == i + 1)
        strangers.append(await anyio.to_thread.run_sync(connect))
        assert await anyio.to_thread.run_sync(strangers[0].recv, 1) == b""
        await _until(lambda: len(ch._conns) == 3)
        for s in strangers[1:]:  # none proves anything: each is closed at its deadline
            assert await anyio.to_thread.run_sync(s.recv, 1) == b""
        await _until(lambda: not ch._conns)
        sock = await anyio.to_thread.run_sync(_channel.connect, address, secret, 0)  # the rank still joins
        await _until(lambda: ch.joined)
        assert ch._by_rank[0].deadline is None  # a rank's socket has no deadline
        sock.close()
    finally:
        for s in strangers:
            s.close()
        ch.close()


async def test_an_accept_out_of_file_descriptors_rests_the_listener_instead_of_spinning(caplog, monkeypatch):
    import resource

    monkeypatch.setattr(_channel, "ACCEPT_PAUSE_S", 0.05)
    hosts = [_Host()]
    ch = _channel.Channel(hosts, "g")
    _, address, secret = hosts[0].serve_channel.args
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowest_free = os.dup(0)  # the descriptor the next open would get
        os.close(lowest_free)
        with caplog.at_level(logging.WARNING, logger="orchestra"):
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor in this process
            try:
                client.setblocking(False)
                client.connect(address)  # waits in the backlog: the listener is readable, accept() fails
                for _ in range(200):  # turns of the loop: a listener that stayed registered fails on each
                    await asyncio.sleep(0)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        failures = [r for r in caplog.records if "accept failed" in r.getMessage()]
        assert len(failures) == 1 and "Too many open files" in failures[0].getMessage()
        client.setblocking(True)
        client.sendall(struct.pack("!I", 36) + secret + struct.pack("!I", 0))  # it was accepted once rested
        await _until(lambda: ch.joined)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.close()
        ch.close()


async def test_a_rank_waits_for_room_when_the_sockets_backlog_is_full(monkeypatch):
    monkeypatch.setattr(_channel, "CONNECT_TIMEOUT_S", 0.3)
    hosts = [_Host()]
    ch = _channel.Channel(hosts, "g")
    fillers = []
    try:
        _, address, secret = hosts[0].serve_channel.args
        while True:  # no turn of the loop here: nothing is accepted until the backlog is full
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            fillers.append(s)
            try:
                s.connect(address)
            except BlockingIOError:
                break
        with pytest.raises(ConnectionError, match="backlog stayed full"):  # nothing is accepted while it waits here
            _channel.connect(address, secret, 0)
        monkeypatch.setattr(_channel, "CONNECT_TIMEOUT_S", 30)
        sock = await anyio.to_thread.run_sync(_channel.connect, address, secret, 0)  # the loop accepts meanwhile
        await _until(lambda: ch.joined)
        sock.close()
    finally:
        for s in fillers:
            s.close()
        ch.close()


async def test_a_rank_closed_before_its_hello_cannot_join_and_the_calls_go_through_ray(monkeypatch):
    """A rank too slow to prove the secret (or pushed out by a flood) has its connection closed; its loop then sees
    the end of the stream and returns without an error. That is a failure to join too: before, nothing failed and
    nothing ran, and the calls waited forever."""
    monkeypatch.setattr(_channel, "HELLO_TIMEOUT_S", 0.1)
    failed = []
    hosts = [_Host()]
    ch = _channel.Channel(hosts, "g", on_join_failed=lambda ch, rank, e: failed.append(rank))
    try:
        reply = _call(ch, 0)
        _, address, _ = hosts[0].serve_channel.args
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await anyio.to_thread.run_sync(slow.connect, address)
        assert await anyio.to_thread.run_sync(slow.recv, 1) == b""  # closed at its deadline, before its hello
        slow.close()
        hosts[0].serve_channel.fut.set_result(0)  # its loop read the end of the stream and returned
        with anyio.fail_after(30):  # bounds a broken build only: the call would wait forever
            assert await reply == ("by ray", reply.call_id)
        assert hosts[0].resent == [(ch.key, reply.call_id)] and failed == [0] and ch.closed
    finally:
        ch.close()


async def test_a_join_failure_of_an_older_channel_leaves_the_groups_current_channel_to_its_next_call():
    """A released channel whose rank still tried to connect fails to join after the group opened a newer one: the
    group's fast path is turned off, but the newer channel is not released there (no call went through Ray after its
    calls, so if it cannot join either, they may still go through Ray); the group's next call releases it."""
    from orchestra._group import _Shared

    old, current = SimpleNamespace(), SimpleNamespace()
    released = []
    shared = SimpleNamespace(closed=None, fast_path_off=False, channel=current, name="g",
                             before_ray_compute=lambda: released.append(shared.channel))
    _Shared._fast_join_failed(shared, old, 1, ConnectionError("firewall"))
    assert shared.fast_path_off and released == [] and shared.channel is current
    _Shared._fast_join_failed(shared, current, 1, ConnectionError("firewall"))
    assert released == [current]


async def test_a_rank_unavailable_while_joining_is_not_taken_for_dead_and_the_calls_go_through_ray():
    """Ray's ActorUnavailableError may pass (the actor restarts, a network blip): the calls go through Ray, which
    runs them once it is back or fails them if it died, instead of reporting a death nobody saw."""
    import ray

    failed = []
    hosts = [_Host(), _Host()]
    ch = _channel.Channel(hosts, "g", on_join_failed=lambda ch, rank, e: failed.append(rank))
    try:
        replies = [_call(ch, 0), _call(ch, 1)]
        hosts[1].serve_channel.fut.set_exception(ray.exceptions.ActorUnavailableError("restarting", None))
        with anyio.fail_after(30):
            assert [await r for r in replies] == [("by ray", r.call_id) for r in replies]
        assert failed == [1]
    finally:
        ch.close()


async def _released_before_joining(hosts: list[_Host]) -> _channel.Channel:
    """A channel with one call per rank, released (the group went through Ray) before any rank joined it."""
    ch = _channel.Channel(hosts, "g")
    _call(ch, 0), _call(ch, 1)
    ch.release()
    return ch


def test_a_released_channel_whose_event_loop_ended_is_closed_by_the_next_release():
    """Released before its ranks joined, in an ``asyncio.run`` that then returned: no loop will accept the ranks or
    write their frames, and each rank waiting for them holds its compute lane. Releasing it again (the group does
    on its next call, from any loop) closes it: its socket goes, and the ranks hear the calls will not run."""
    hosts = [_Host(), _Host()]

    ch = asyncio.run(_released_before_joining(hosts))
    assert not ch.open and not ch.closed and os.path.isdir(ch._dir)
    ch.release()
    assert ch.closed and not os.path.exists(ch._dir)
    assert hosts[0].forgotten == hosts[1].forgotten == [ch.key]


async def test_a_call_resent_through_ray_that_cannot_reach_its_rank_is_named_to_the_rank_as_never_run():
    """Ray could not deliver the resent call (ActorUnavailableError: it may not have run, the rank may live on): the
    call fails with Ray's error, and its rank hears it will not run (``Host.forget_calls``), so that a reader in
    another group that asked the rank for its outcome is not left waiting for a call that never comes."""
    import ray

    hosts = [_Host(), _Host()]
    hosts[0].unreachable = True
    ch = _channel.Channel(hosts, "g")
    try:
        replies = [_call(ch, 0), _call(ch, 1)]
        hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
        with anyio.fail_after(30):
            with pytest.raises(ray.exceptions.ActorUnavailableError):
                await replies[0].out
            assert await replies[1].out == ("by ray", replies[1].call_id)
        assert hosts[0].never == [(ch.key, [replies[0].call_id])] and hosts[1].never == []
    finally:
        ch.close()


async def test_telling_a_rank_a_call_never_ran_is_retried_while_ray_cannot_reach_it_and_fails_no_reply():
    """The outage that lost the resent call loses the first ``forget_calls`` too: it is retried until it lands (a
    reader waiting on the rank would wait forever otherwise). And whatever telling does, the call's own reply is
    settled first: a ``forget_calls`` that raises at once (Ray shutting down) left it unresolved, its caller hung."""
    import ray

    hosts = [_Host(), _Host()]
    hosts[0].unreachable, hosts[0].unreachable_tells = True, 2
    ch = _channel.Channel(hosts, "g")
    try:
        replies = [_call(ch, 0), _call(ch, 1)]
        hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
        with anyio.fail_after(30):
            with pytest.raises(ray.exceptions.ActorUnavailableError):
                await replies[0].out
            await _until(lambda: hosts[0].never)
        assert hosts[0].never == [(ch.key, [replies[0].call_id])] and hosts[0].unreachable_tells == 0
    finally:
        ch.close()

    def boom(path, ids):
        raise ray.exceptions.RaySystemError("core worker is shutting down")

    hosts = [_Host(), _Host()]
    hosts[0].unreachable = True
    hosts[0].forget_calls = SimpleNamespace(remote=boom)
    ch = _channel.Channel(hosts, "g")
    try:
        reply = _call(ch, 0)
        hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
        with anyio.fail_after(30):
            with pytest.raises(ray.exceptions.ActorUnavailableError):
                await reply.out
    finally:
        ch.close()


async def _owing_a_tell(hosts: list[_Host]) -> tuple[_channel.Channel, asyncio.TimerHandle, str]:
    """A channel whose call resent to rank 0 could not reach it, nor could the tell that it never ran: the tell
    waits on its retry timer (rank 1 could not join, so the calls went through Ray)."""
    import ray

    hosts[0].unreachable, hosts[0].unreachable_tells = True, 1_000
    ch = _channel.Channel(hosts, "g")
    reply = _call(ch, 0)
    hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
    with anyio.fail_after(30):
        with pytest.raises(ray.exceptions.ActorUnavailableError):
            await reply.out
    await _until(lambda: any(t is not None for t in ch._owed_tells.values()))
    (timer,) = ch._owed_tells.values()
    return ch, timer, reply.call_id


async def test_a_tell_still_owed_when_the_group_closes_is_dropped_with_its_retry_timer():
    """The channel owns the retries of ``forget_calls``: closing the group (its ranks are killed, a reader waiting
    on one fails with it) cancels the one waiting, and nothing more is sent."""
    hosts = [_Host(), _Host()]
    ch, timer, _ = await _owing_a_tell(hosts)
    ch.close(RuntimeError("the group was closed"))
    assert timer.cancelled() and ch._owed_tells == {} and hosts[0].never == []
    ch._never_ran(0, "late")  # a Ray reply settling after the close tells nothing either
    assert ch._owed_tells == {} and hosts[0].never == []


def test_a_tell_still_owed_when_its_loop_ended_is_sent_once_more_when_the_channel_is_closed():
    """The ``asyncio.run`` retrying the tell returned: no loop of the channel will retry it, so closing the orphaned
    channel (the group's next call does) sends it once more, Ray owning it."""
    hosts = [_Host(), _Host()]
    ch, _, call_id = asyncio.run(_owing_a_tell(hosts))
    hosts[0].unreachable_tells = 0  # Ray reaches the rank again
    ch.release()
    assert ch.closed and ch._owed_tells == {}
    assert hosts[0].never == [(ch.key, [call_id])]


def test_a_tell_owed_by_a_channel_closed_before_its_loop_ended_is_sent_when_it_is_released_again():
    """Every reply in, the channel closes itself while a tell is still retried on its loop; then the loop ends.
    The group keeps such a channel (``owes_tells``), and releasing it from a later loop sends the tell once more
    (the review found it lost: the channel was closed, so nothing looked at it again)."""
    hosts = [_Host(), _Host()]

    async def closed_owing():
        ch, timer, call_id = await _owing_a_tell(hosts)
        ch.close()  # as _maybe_finish does: the loop is alive, so the retries go on
        assert ch.closed and ch.owes_tells and not timer.cancelled()
        return ch, call_id

    ch, call_id = asyncio.run(closed_owing())
    hosts[0].unreachable_tells = 0
    ch.release()
    assert not ch.owes_tells and hosts[0].never == [(ch.key, [call_id])]


async def test_the_last_call_resent_to_a_rank_ends_its_session_there():
    """A rank whose serve loop got no frame leaves its session open for the controller; the resent calls' last one
    ends it (open sessions are never dropped: one per join failure stayed on every rank for good)."""
    hosts = [_Host(), _Host()]
    ch = _channel.Channel(hosts, "g")
    try:
        replies = [_call(ch, 0), _call(ch, 1), _call(ch, 0), _call(ch, 1)]
        cancelled = _call(ch, 0)
        cancelled.out.cancel()  # ended before the join failed: not resent, so the one before it is the last
        hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
        with anyio.fail_after(30):
            for r in replies:
                await r.out
        assert hosts[0].lasts == hosts[1].lasts == [False, True]
    finally:
        ch.close()


def test_a_released_channel_whose_loop_stopped_is_closed_when_its_group_is_used_from_another_loop():
    """``loop.run_until_complete`` without ``loop.close()``, then ``asyncio.run``: the first loop is not closed,
    but nothing runs it; its channel is as orphaned as one of a closed loop."""
    hosts = [_Host(), _Host()]

    loop = asyncio.new_event_loop()
    try:
        ch = loop.run_until_complete(_released_before_joining(hosts))
        ch.release()  # from sync code: that loop may still be run again
        assert not ch.closed

        async def later():
            ch.release()

        asyncio.run(later())
        assert ch.closed and not os.path.exists(ch._dir)
    finally:
        loop.close()
