"""A rank reads fast-path frames with ``_channel.recv_frame`` from a file of its socket (``sock.makefile("rb")``, whose
buffer cuts what one ``recv`` brings into frames): each frame whole and in order, however the stream's bytes arrive
— several frames in one ``recv``, one frame over many, a length split in two — and None at the stream's end, also
inside a frame; from a raw file (``buffering=0``) too, which reads no byte past a frame. Ray-free: a socket pair."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from orchestra import _channel

_LEN = struct.Struct("!I")


def _stream(frames: list[bytes]) -> bytes:
    return b"".join(_LEN.pack(len(f)) + f for f in frames)


def _read_all(data: bytes, pieces: list[int], buffering: int = -1) -> list[bytes | None]:
    """Write ``data`` cut into ``pieces`` (each by its own ``sendall``, the rest after them), then close; read frames
    until the end through a file of the socket of ``buffering`` (2 and 7 bytes: every frame over many reads; 0: raw)."""
    a, b = socket.socketpair()
    got: list[bytes | None] = []

    def write() -> None:
        at = 0
        for n in [*pieces, len(data)]:
            a.sendall(data[at:at + n])
            at += n
            if at >= len(data):
                break
        a.close()

    t = threading.Thread(target=write)
    t.start()
    with b.makefile("rb", buffering=buffering) as f:
        while True:
            frame = _channel.recv_frame(f)
            got.append(frame)
            if frame is None:
                break
    t.join()
    b.close()
    return got


FRAMES = [b"x" * 10, b"", b"\x00" * 3, bytes(range(256)) * 300, b"end"]


@pytest.mark.parametrize("pieces", [[], [1], [2, 3], [4], [5, 1, 1, 1], [14, 4, 4]],
                         ids=["at once", "one byte", "length split", "length alone", "body by bytes", "frames cut"])
@pytest.mark.parametrize("buffering", [0, 2, 7, -1])
def test_every_frame_comes_whole_and_in_order_however_the_bytes_arrive(pieces, buffering):
    assert _read_all(_stream(FRAMES), pieces, buffering) == [*FRAMES, None]


@pytest.mark.parametrize("cut", [1, 3, 4, 6])
@pytest.mark.parametrize("buffering", [0, -1])
def test_a_stream_that_ends_inside_a_frame_ends_the_reading(cut, buffering):
    data = _stream([b"whole", b"cut short"])
    assert _read_all(data[:len(_LEN.pack(5)) + 5 + cut], [], buffering) == [b"whole", None]


def test_a_raw_file_reads_no_byte_past_its_frame():
    """A frame read through a raw file, made and closed per frame, leaves the next frame in the socket."""
    a, b = socket.socketpair()
    a.sendall(_stream([b"one", b"two"]))
    a.close()
    frames = []
    for _ in range(3):
        with b.makefile("rb", buffering=0) as f:
            frames.append(_channel.recv_frame(f))
    assert frames == [b"one", b"two", None]
    b.close()
