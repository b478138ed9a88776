"""How the router hands a replica's answer to its client: the headers each way (not the
hop-by-hop ones), a busy replica's ``Retry-After``, the retry signal, and the streamed relay
that counts the request out of flight however it ends. `Router` (`proxy`) chooses and
forwards; this module is the pipe."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import httpx
from starlette.responses import StreamingResponse

from .replicas import Replica

_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "date",
                          "server"})


def retry_after(value: str | None, default: float = 1.0) -> float:
    """A ``Retry-After`` header's seconds (`default` when absent, a date, or nonsense)."""
    try:
        seconds = float(value) if value is not None else default
    except ValueError:
        return default
    return seconds if math.isfinite(seconds) and seconds >= 0 else default


class RetryElsewhere(Exception):
    """The replica cannot take the request now: try another (`retry_after`: it was busy,
    and said when to come back)."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


async def no_more() -> AsyncIterator[bytes]:
    """No chunk after the first (an answer read whole)."""
    return
    yield


class RelayEnd:
    """The end of a relayed answer, whichever way it comes (finished, the client gone,
    or the response never started): once, one request fewer in flight and the upstream
    closed."""

    def __init__(self, replica: Replica, upstream: httpx.Response) -> None:
        self.replica, self.upstream, self.done = replica, upstream, False

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.replica.in_flight -= 1
            await self.upstream.aclose()


class RelayResponse(StreamingResponse):
    """The replica's answer streamed through. A generator's ``finally`` runs only once it
    has started, so the end is also run when the response itself ends: a client that
    leaves before the first byte is sent does not leave a request counted in flight."""

    def __init__(self, first: bytes, chunks: AsyncIterator[bytes], done: RelayEnd,
                 **kwargs) -> None:
        super().__init__(_relay(first, chunks, done), **kwargs)
        self._done = done

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._done()


async def _relay(first: bytes, chunks: AsyncIterator[bytes],
                 done: RelayEnd) -> AsyncIterator[bytes]:
    """The answer's bytes; `done` runs however the relay ends (finished, client gone)."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    finally:
        await done()


def response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}


def forward_headers(headers: dict[str, str]) -> dict[str, str]:
    """The client's headers a replica should see (not the hop-by-hop ones)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
