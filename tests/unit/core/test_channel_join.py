"""How ranks join a fast-path channel (orchestra._channel), without Ray: the test plays the ranks. A connection is
read only after it proves, with the channel's secret, that Ray sent it; no frame is written to any rank until every
rank has joined, so a rank that cannot join leaves the calls sent meanwhile run by no rank; ranks on other nodes
join over TCP on the node's own address."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
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


def _rank_side(address, secret: bytes, rank: int) -> tuple[socket.socket, bytes | None]:
    """Join as ``rank`` and read the first frame (None: the controller shut its side first)."""
    sock = _channel.connect(address, secret, rank)
    return sock, _channel.recv_frame(sock)


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


async def test_no_frame_is_written_until_every_rank_joined_and_a_rank_that_cannot_join_fails_every_call():
    failed = []
    hosts = [_Host(), _Host()]
    ch = _channel.Channel(hosts, "g", on_join_failed=lambda rank, e: failed.append((rank, e)))
    try:
        replies = [_call(ch, 0), _call(ch, 1)]
        _, address, secret = hosts[0].serve_channel.args
        sock0 = await anyio.to_thread.run_sync(_channel.connect, address, secret, 0)
        await _until(lambda: 0 in ch._by_rank)
        assert not ch.joined
        hosts[1].serve_channel.fut.set_exception(ConnectionRefusedError("rank 1 cannot reach the socket"))
        # rank 0 sees its socket shut without any frame: the call ran on no rank
        assert await anyio.to_thread.run_sync(_channel.recv_frame, sock0) is None
        sock0.close()
        for r, reply in enumerate(replies):
            with pytest.raises(WorkerError) as e:
                with anyio.fail_after(30):
                    await reply.out
            assert e.value.rank == 1 and e.value.endpoint == "step" and e.value.group == "g"
            assert "sent to no rank" in str(e.value) and "cannot reach the socket" in str(e.value)
        assert [r for r, _ in failed] == [1] and not ch.open
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
        assert await anyio.to_thread.run_sync(_channel.recv_frame, s1) is None  # the rank's loop would return
        s0.close()
        s1.close()
    finally:
        ch.close()
