"""The router's FastAPI app: OpenAI routes forwarded, plus its own ``/health`` and
``/metrics``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from ..server.http.graceful import GracefulServer
from ..server.http.protocol import error_response, status_error
from .proxy import Router, RouterError
from .relay import forward_headers

logger = logging.getLogger("paged_kv.router")

CLIENT_GONE = 499  # nginx's "client closed request", as the replicas count it


def create_router_app(router: Router) -> FastAPI:
    """The app over `router` (its replicas probed and followed while the app runs)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="paged_kv router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(router, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _forward(router, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            router.tenant(request.headers.get("authorization", ""))
        except RouterError as exc:
            return error_response(exc.status, exc.message, type_="authentication_error")
        return await router.models(forward_headers(dict(request.headers)))

    @app.get("/health")
    async def health() -> Response:
        problem, info = router.health()
        if problem is not None:
            return error_response(503, problem, type_="server_error")
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.observe()
        return PlainTextResponse(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class RouterServer(GracefulServer):
    """The router's uvicorn server: exit 0 after SIGTERM, as ``paged-kv serve``."""

    logger = logger


async def _forward(router: Router, request: Request, path: str) -> Response:
    """A request to a replica (or the router's own error), counted by status."""
    try:
        tenant = router.tenant(request.headers.get("authorization", ""))
        body = await request.body()
        response = await _unless_client_leaves(request, router.forward(
            path, body, forward_headers(dict(request.headers)), tenant))
    except RouterError as exc:
        response = status_error(exc.status, exc.message, param=exc.param,
                                headers=exc.headers)
    except ClientDisconnect:  # gone while sending its body
        response = Response(status_code=CLIENT_GONE)
    router.requests.labels(endpoint=path, status=str(response.status_code)).inc()
    return response


async def _unless_client_leaves(request: Request, forwarding: Awaitable[Response],
                                ) -> Response:
    """`forwarding`'s response; if the client leaves first, the forwarding is cancelled
    (which closes the upstream request, so the replica aborts its work) and the answer is
    a 499 nobody reads. Until its first byte a replica's answer sends nothing to the
    client, so nothing else would notice the client gone: a non-streamed request would
    run to its end."""
    work = asyncio.ensure_future(forwarding)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # (also when this handler itself is cancelled)
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        logger.info("client left before the answer started: request to the replica "
                    "cancelled")
        return Response(status_code=CLIENT_GONE)
    return work.result()


async def _disconnected(receive) -> None:
    """Returns once the client has disconnected (its body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
