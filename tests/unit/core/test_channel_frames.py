"""The controller's side of a fast-path socket cuts what it reads into reply frames (``_channel._Conn._on_read``):
one whole frame in a read (the usual reply) is handed over as is; several in one read, or one split over reads,
are cut at their length prefixes; a stranger's first frame that is not a hello is refused."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Iterator

from orchestra import _channel

_LEN = struct.Struct("!I")


class _Recorder:
    """What ``_Conn`` asks of its channel, recorded."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.frames: list[bytes] = []
        self.refused: list[str] = []
        self.lost: list[object] = []

    def _frame(self, conn: _channel._Conn, body: bytes) -> None:
        assert type(body) is bytes  # (a private copy: not a view of the connection's buffer)
        self.frames.append(body)

    def _refuse(self, conn: _channel._Conn, why: str) -> None:
        self.refused.append(why)
        conn.close()

    def _lost(self, conn: _channel._Conn, error: object) -> None:
        self.lost.append(error)
        conn.close()


def _framed(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


@contextlib.contextmanager
def _connected(loop: asyncio.AbstractEventLoop) -> Iterator[tuple[_channel._Conn, _Recorder, socket.socket]]:
    """A ``_Conn`` over one end of a socket pair (read by hand: one read per ``_on_read``), its recording channel,
    and the other end, the rank's."""
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        channel = _Recorder(loop)
        conn = _channel._Conn(channel, ours)  # type: ignore[arg-type]
        loop.remove_reader(ours.fileno())
        yield conn, channel, theirs
    finally:
        ours.close()
        theirs.close()


async def test_replies_are_cut_at_their_frames_however_the_reads_fall():
    with _connected(asyncio.get_running_loop()) as (conn, channel, theirs):
        conn.rank = 2
        theirs.sendall(_framed(b"one"))
        conn._on_read()
        assert channel.frames == [b"one"]
        theirs.sendall(_framed(b"two") + _framed(b"three"))  # two in one read
        conn._on_read()
        assert channel.frames == [b"one", b"two", b"three"]
        whole = _framed(b"four" * 10)
        theirs.sendall(whole[:2])  # a split length prefix
        conn._on_read()
        theirs.sendall(whole[2:9])
        conn._on_read()
        assert channel.frames == [b"one", b"two", b"three"] and conn.inbuf
        theirs.sendall(whole[9:] + _framed(b"five")[:5])  # the rest, and the start of the next
        conn._on_read()
        assert channel.frames[3:] == [b"four" * 10] and conn.inbuf
        theirs.sendall(_framed(b"five")[5:])
        conn._on_read()
        assert channel.frames[4:] == [b"five"] and not conn.inbuf
        theirs.sendall(_framed(b""))  # an empty body is a frame too
        conn._on_read()
        assert channel.frames[5:] == [b""] and not channel.refused and not channel.lost
        theirs.close()
        conn._on_read()
        assert channel.lost == [None]


async def test_a_strangers_first_whole_frame_that_is_no_hello_is_refused():
    with _connected(asyncio.get_running_loop()) as (conn, channel, theirs):
        theirs.sendall(_framed(b"x" * (_channel._HELLO_BYTES + 1)))  # rank not known yet: only a hello is read
        conn._on_read()
        assert channel.frames == [] and len(channel.refused) == 1 and "not a hello" in channel.refused[0]
