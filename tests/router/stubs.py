"""Stub replicas and the router, served in-process by uvicorn on free 127.0.0.1 ports, in
the test's own event loop: cheap enough for a hundred open streams, and each stub does one
thing a real replica may do (stream and hold, answer 429, die after its headers...)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_kv.router import PrefixIndex
from paged_kv.router.app import create_router_app
from paged_kv.router.proxy import Router
from paged_kv.router.replicas import ReplicaSet
from paged_kv.server.http.tokenizer import ByteTokenizer

BOUND_S = 60.0  # no stub waits longer than this for anything: every test ends by itself


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (several run at once, in pytest)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@contextlib.asynccontextmanager
async def serving(app) -> AsyncIterator[str]:
    """Serve `app` on a free loopback port while the block runs; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + BOUND_S
        while not server.started:
            assert not task.done() and time.monotonic() < deadline, "server did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, BOUND_S)
        sock.close()


class StubReplica:
    """A replica answering ``/health``, ``/kv_events`` (`events`: its JSON; None: 404) and
    ``/v1/completions`` (and chat) by `mode`:

    - ``ok``: ``{"replica": name}`` at once;
    - ``stream``: one SSE event, then holds the stream until `release` is set;
    - ``hold``: waits for the client (the router) to leave, noting when in `left_at`;
    - ``busy``: 429 with ``Retry-After: retry_after``;
    - ``unavailable``: 503;
    - ``die``: sends its headers, then dies before the first byte of the body;
    - ``die_midway``: sends one SSE event, then dies.
    """

    def __init__(self, name: str, mode: str = "ok", *, events: dict | None = None,
                 retry_after: str = "1") -> None:
        self.name, self.mode, self.events, self.retry_after = name, mode, events, retry_after
        self.requests = 0
        self.release = asyncio.Event()
        self.left_at: float | None = None
        self.app = Starlette(routes=[Route("/health", self._health),
                                     Route("/kv_events", self._kv_events),
                                     Route("/v1/completions", self._complete,
                                           methods=["POST"]),
                                     Route("/v1/chat/completions", self._complete,
                                           methods=["POST"])])

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _kv_events(self, request: Request) -> Response:
        if self.events is None:
            return JSONResponse({"error": {"message": "KV events are off"}}, status_code=404)
        return JSONResponse(self.events)

    async def _complete(self, request: Request) -> Response:
        self.requests += 1
        await request.body()
        if self.mode == "busy":
            return JSONResponse({"error": {"message": "busy"}}, status_code=429,
                                headers={"Retry-After": self.retry_after})
        if self.mode == "unavailable":
            return JSONResponse({"error": {"message": "draining"}}, status_code=503)
        if self.mode == "hold":
            return await self._hold(request)
        if self.mode in ("stream", "die", "die_midway"):
            return StreamingResponse(self._events(), media_type="text/event-stream")
        return JSONResponse({"replica": self.name})

    async def _hold(self, request: Request) -> Response:
        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.left_at = time.monotonic()

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(gone(), BOUND_S)
        return JSONResponse({"replica": self.name})

    async def _events(self) -> AsyncIterator[bytes]:
        if self.mode == "die":
            await asyncio.sleep(0.05)  # the headers are on the wire
            raise ConnectionAbortedError("stub replica dies after its headers")
        yield f'data: {{"replica": "{self.name}"}}\n\n'.encode()
        if self.mode == "die_midway":
            await asyncio.sleep(0.05)
            raise ConnectionAbortedError("stub replica dies in the middle of its answer")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.release.wait(), BOUND_S)
        yield b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def stub_cluster(*replicas: StubReplica, tokenizer=None, **router_kwargs,
                       ) -> AsyncIterator[tuple[str, Router]]:
    """`replicas` served, and a router over them (probing every 0.2 s; the byte tokenizer
    unless `tokenizer`): yields its URL and the `Router` (to read its state)."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(r.app)) for r in replicas]
        router = Router(ReplicaSet(urls, PrefixIndex(), lambda *a: router.on_batch(*a),
                                   interval=0.2),
                        tokenizer or ByteTokenizer(), **router_kwargs)
        yield await stack.enter_async_context(serving(create_router_app(router))), router


def completion(prompt: str = "hello", **body) -> dict:
    """A completions request body."""
    return {"model": "stub", "prompt": prompt, "max_tokens": 4, **body}
