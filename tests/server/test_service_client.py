"""The service workload's load generator (`paged_kv.bench.workloads.service_client`):
requests leave at their arrivals, every SSE token event is stamped once however the bytes
are cut, and a refused request fails the run."""

from __future__ import annotations

import asyncio
import itertools
import time

import httptools
import pytest

from paged_kv.bench.workloads.service_client import request_bytes, stream_all

EVENT = b'data: {"choices": [{"text": "x"}]}\n\n'


def _chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


class _Request:
    """httptools' request callbacks: the body and whether the message ended."""

    def __init__(self) -> None:
        self.body, self.complete, self.url = b"", False, b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def _server(events: int, status: int, cut: int, seen: list[tuple[float, bytes]]):
    """A server answering each request with `events` token events (and ``[DONE]``),
    chunked, written `cut` bytes at a time (with a pause, so reads split them)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = _Request()
        parser = httptools.HttpRequestParser(request)
        while not request.complete:
            parser.feed_data(await reader.read(1 << 16))
        seen.append((time.perf_counter(), request.body))
        if status != 200:
            body = b'{"error": "busy"}'
            writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s"
                         % (status, len(body), body))
        else:
            data = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                    + _chunked([EVENT] * events + [b"data: [DONE]\n\n"]))
            for i in range(0, len(data), cut):
                writer.write(data[i:i + cut])
                await writer.drain()
                await asyncio.sleep(0.001)
        await writer.drain()
        await reader.read()  # until the client closes

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("cut", [1, 7, 1 << 16])
def test_every_event_stamped_once_however_the_reads_cut_it(cut):
    seen: list[tuple[float, bytes]] = []

    async def run():
        server = await _server(3, 200, cut, seen)
        port = server.sockets[0].getsockname()[1]
        bodies = [request_bytes(port, "/v1/completions", {"prompt": [i, 2]}) for i in range(3)]
        try:
            return await stream_all(port, bodies, [0.0, 0.02, 0.04])
        finally:
            server.close()

    start, times = asyncio.run(run())
    assert [len(t) for t in times] == [3, 3, 3], f"cut={cut}: {times}"
    assert all(a <= b for t in times for a, b in itertools.pairwise([start, *t]))
    assert sorted(body for _, body in seen) == [b'{"prompt": [%d, 2]}' % i for i in range(3)]


def test_requests_leave_at_their_arrivals():
    seen: list[tuple[float, bytes]] = []
    arrivals = [0.0, 0.05, 0.1]

    async def run():
        server = await _server(1, 200, 1 << 16, seen)
        port = server.sockets[0].getsockname()[1]
        bodies = [request_bytes(port, "/v1/completions", {"prompt": [i]}) for i in range(3)]
        try:
            return await stream_all(port, bodies, arrivals)
        finally:
            server.close()

    start, _ = asyncio.run(run())
    received = {body: t - start for t, body in seen}
    # never early, and in the order of their arrivals (how late is the machine's: no bound)
    order = [received[b'{"prompt": [%d]}' % i] for i in range(3)]
    for i, (due, at) in enumerate(zip(arrivals, order, strict=True)):
        assert at >= due, f"request {i} reached the server {(due - at) * 1e3:.2f} ms early"
    assert order == sorted(order), order


def test_a_refused_request_fails_the_run():
    async def run():
        server = await _server(1, 429, 1 << 16, [])
        port = server.sockets[0].getsockname()[1]
        try:
            return await stream_all(port, [request_bytes(port, "/v1/completions", {})], [0.0])
        finally:
            server.close()

    with pytest.raises(RuntimeError, match="request 0: HTTP 429"):
        asyncio.run(run())


def test_request_bytes_are_one_whole_post():
    raw = request_bytes(8000, "/v1/completions", {"prompt": [1, 2, 3], "stream": True})
    request = _Request()
    httptools.HttpRequestParser(request).feed_data(raw)
    assert request.complete and request.url == b"/v1/completions"
    assert request.body == b'{"prompt": [1, 2, 3], "stream": true}'
