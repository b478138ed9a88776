"""The service workload's load generator: streamed completions over HTTP/1.1 whose requests
reach the server at their arrival times, as the in-process baseline's reach its engine.

Each request has a connection of its own, opened before the run starts (uvicorn times out
an idle connection only after a response), and its bytes made before it too; a thread
asleep until each arrival writes them to that socket itself. With a client library on the
event loop a request left ~0.75 ms after its arrival on this machine (the thread's hop to
the loop ~0.3 ms, aiohttp building and writing the request ~0.45 ms: a trace in
docs/benchmarks.md), time counted against the server that the in-process side never
pays. The event loop (uvloop where installed) only reads: httptools' C parser undoes the
chunked encoding and each ``data: {`` line is stamped when its last byte arrives, a few
µs of client CPU a token, which the two cores would otherwise take from the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httptools

_EVENT = b"data: {"  # a token's chunk (``data: [DONE]`` ends the stream)


def request_bytes(port: int, path: str, body: dict) -> bytes:
    """A whole ``POST path`` with `body` as JSON, ready to write to a kept-alive socket."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


class _Stream(asyncio.Protocol):
    """One connection's response: the arrival time of each of its SSE token events."""

    def __init__(self, done: asyncio.Future) -> None:
        self.times: list[float] = []
        self.status = 0
        self._done = done
        self._parser = httptools.HttpResponseParser(self)
        self._tail = b""  # a line cut by the reads, waiting for its end
        self._now = 0.0

    def data_received(self, data: bytes) -> None:
        self._now = time.perf_counter()
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_exception(ConnectionError(f"the server closed a stream: {exc}"))

    # httptools' callbacks
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        lines = (self._tail + body).split(b"\n")
        self._tail = lines.pop()
        self.times += [self._now for line in lines if line.startswith(_EVENT)]

    def on_message_complete(self) -> None:
        if not self._done.done():
            self._done.set_result(None)


async def stream_all(port: int, requests: list[bytes], arrivals: list[float],
                     ) -> tuple[float, list[list[float]]]:
    """Send each of `requests` (`request_bytes`) at its arrival (seconds from the start) on
    a connection of its own to 127.0.0.1:`port`; returns the start (``perf_counter``) and
    each request's token event times.

    Raises
    ------
    RuntimeError
        Naming a request answered with a status other than 200.
    ConnectionError
        The server closed a connection before its response ended.
    """
    loop = asyncio.get_running_loop()
    streams, links = [], []
    try:
        for _ in requests:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            done = loop.create_future()
            transport, stream = await loop.create_connection(lambda d=done: _Stream(d),
                                                             sock=sock)
            streams.append((stream, done))
            links.append((sock, transport))
        start = time.perf_counter()
        failures: list[BaseException] = []
        clock = threading.Thread(target=_release,
                                 args=(loop, links, requests, start, arrivals, failures))
        clock.start()
        try:
            await asyncio.gather(*(done for _, done in streams))
        finally:
            clock.join()
        if failures:
            raise failures[0]
    finally:
        for _, transport in links:
            transport.close()
    for i, (stream, _) in enumerate(streams):
        if stream.status != 200:
            raise RuntimeError(f"request {i}: HTTP {stream.status}, expected 200")
    return start, [stream.times for stream, _ in streams]


def _release(loop: asyncio.AbstractEventLoop, links: list[tuple[socket.socket, asyncio.Transport]],
             requests: list[bytes], start: float, arrivals: list[float],
             failures: list[BaseException]) -> None:
    """Write each request to its socket at its arrival, from this thread: no hop to the
    event loop (whose timers also round to the millisecond). A request the socket does not
    take whole (never seen: ~1 KB into an empty buffer) leaves the rest to the loop."""
    for i in sorted(range(len(requests)), key=arrivals.__getitem__):
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        sock, transport = links[i]
        try:
            sent = sock.send(requests[i])
        except BlockingIOError:
            sent = 0
        except OSError as exc:  # its stream fails as the connection closes
            failures.append(exc)
            loop.call_soon_threadsafe(transport.close)
            continue
        if sent < len(requests[i]):
            with contextlib.suppress(RuntimeError):  # (the loop closed: the run failed)
                loop.call_soon_threadsafe(transport.write, requests[i][sent:])
