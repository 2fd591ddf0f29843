"""The rank's reader of fast-path frames (``_channel.FrameReader``): each frame whole and in order, however the
stream's bytes arrive — several frames in one ``recv``, one frame over many, a length split in two — and None at the
stream's end, also inside a frame. Ray-free: a socket pair."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from orchestra import _channel

_LEN = struct.Struct("!I")


def _stream(frames: list[bytes]) -> bytes:
    return b"".join(_LEN.pack(len(f)) + f for f in frames)


def _read_all(data: bytes, pieces: list[int], chunk: int = 1 << 16) -> list[bytes | None]:
    """Write ``data`` cut into ``pieces`` (each by its own ``sendall``, the rest after them), then close; read frames
    until the end, ``chunk`` bytes a ``recv`` at most (1 and 7: every frame over many reads)."""
    a, b = socket.socketpair()
    got: list[bytes | None] = []
    reader = _channel.FrameReader(b, chunk=chunk)

    def write() -> None:
        at = 0
        for n in [*pieces, len(data)]:
            a.sendall(data[at:at + n] if n else b"")
            at += n
            if at >= len(data):
                break
        a.close()

    t = threading.Thread(target=write)
    t.start()
    while True:
        f = reader.frame()
        got.append(f)
        if f is None:
            break
    t.join()
    b.close()
    return got


FRAMES = [b"x" * 10, b"", b"\x00" * 3, bytes(range(256)) * 300, b"end"]


@pytest.mark.parametrize("pieces", [[], [1], [2, 3], [4], [5, 1, 1, 1], [14, 4, 4]],
                         ids=["at once", "one byte", "length split", "length alone", "body by bytes", "frames cut"])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_every_frame_comes_whole_and_in_order_however_the_bytes_arrive(pieces, chunk):
    assert _read_all(_stream(FRAMES), pieces, chunk) == [*FRAMES, None]


@pytest.mark.parametrize("cut", [1, 3, 4, 6])
def test_a_stream_that_ends_inside_a_frame_ends_the_reading(cut):
    data = _stream([b"whole", b"cut short"])
    assert _read_all(data[:len(_LEN.pack(5)) + 5 + cut], []) == [b"whole", None]


def test_what_recv_frame_reads_is_what_the_reader_reads():
    a, b = socket.socketpair()
    a.sendall(_stream([b"one", b"two"]))
    a.close()
    assert [_channel.recv_frame(b), _channel.recv_frame(b), _channel.recv_frame(b)] == [b"one", b"two", None]
