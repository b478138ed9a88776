"""Length-prefixed frames over a Unix domain stream socket: what the API server processes and
the engine core say to each other (`messages.py`'s msgpack, unchanged) travels as a 4-byte
little-endian length followed by that many bytes.

A plain Unix socket and not ZMQ: a DEALER/ROUTER hop wakes four threads (each side's I/O
thread and its main thread), a Unix socket's one (the reader): a round trip between two
processes under uvloop took 17 µs against ZMQ's 70-88 µs here, on the way of every first
token (docs/benchmarks.md, "HTTP first token over a Unix socket").
"""

from __future__ import annotations

import struct

_HEADER = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
MAX_FRAME = 1 << 31  # a length past this is a broken stream, not a message (2 GiB)


def unix_path(address: str) -> str:
    """The socket's path in `address`: ``ipc://PATH`` (ZMQ's spelling, as the core's
    address was), ``unix://PATH`` or the bare path."""
    for prefix in ("ipc://", "unix://"):
        if address.startswith(prefix):
            return address[len(prefix):]
    return address


def frame(payload: bytes) -> bytes:
    """`payload` with its length in front, ready to write."""
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Cuts a byte stream into the payloads of its frames, however the reads split them.

    ``feed(data)`` returns the payloads `data` completed (maybe none); a frame cut short
    waits in the buffer for the rest. The common read (exactly one whole frame, nothing
    left over) costs one slice and no buffer.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of the frames that `data` completes, in order.

        Raises
        ------
        ValueError
            A frame's length is past `MAX_FRAME` (the stream is broken: close it).
        """
        buffer = self._buffer
        if not buffer and len(data) >= HEADER_SIZE:
            (size,) = _HEADER.unpack_from(data)
            if len(data) == HEADER_SIZE + size:  # one whole frame: no copy into the buffer
                return [data[HEADER_SIZE:]]
        buffer += data
        payloads, start, end = [], 0, len(buffer)
        while end - start >= HEADER_SIZE:
            (size,) = _HEADER.unpack_from(buffer, start)
            if size > MAX_FRAME:
                raise ValueError(f"frame length {size} is past the limit of {MAX_FRAME} "
                                 "bytes: the stream is out of step; close it")
            stop = start + HEADER_SIZE + size
            if stop > end:
                break
            payloads.append(bytes(buffer[start + HEADER_SIZE:stop]))
            start = stop
        del buffer[:start]
        return payloads
