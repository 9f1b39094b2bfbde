"""Length-prefixed msgpack frames over a stream socket (the forkserver's and the zygote's protocol).

A frame is a 4-byte big-endian length followed by one msgspec-encoded message. Both ends use this
module: `frame(msg)` to write, a FrameReader to turn received bytes back into typed messages.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

from hotstart.messages import encoder

HEADER = struct.Struct("!I")
MAX_FRAME = 16 << 20  # an engine config is a few KB: anything near this is a corrupt stream


class FrameError(Exception):
    """The byte stream is not a sequence of valid frames (a bug or a foreign peer)."""


def frame(msg: Any) -> bytes:
    data = encoder.encode(msg)
    return HEADER.pack(len(data)) + data


def send(sock: socket.socket, msg: Any, timeout: float | None = None) -> None:
    """Write one frame, whatever the socket's mode: blocking until sent, or raising TimeoutError (an
    OSError) after TIMEOUT seconds (a peer that stopped reading: its buffer is full)."""
    data = frame(msg)
    mode = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        sock.sendall(data)
    finally:
        sock.settimeout(mode)


class FrameReader:
    """Accumulates received bytes; feed() returns the complete messages so far, decoded as TYPE."""

    def __init__(self, type_: Any):
        self._decoder = msgspec.msgpack.Decoder(type_)
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise FrameError(f"frame of {n} bytes (limit {MAX_FRAME})")
            if len(self._buf) < HEADER.size + n:
                break
            body = bytes(self._buf[HEADER.size:HEADER.size + n])
            del self._buf[:HEADER.size + n]
            try:
                out.append(self._decoder.decode(body))
            except msgspec.DecodeError as e:
                raise FrameError(str(e)) from None
        return out
