"""The router's FastAPI app: OpenAI routes forwarded, plus its own ``/health`` and
``/metrics``."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..server.protocol import error_response
from .proxy import Router, RouterError, forward_headers

logger = logging.getLogger("paged_kv.router")


def create_router_app(router: Router) -> FastAPI:
    """The app over `router` (its replicas probed and followed while the app runs)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.replicas.start()
        yield
        await router.replicas.close()
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
        up = len(router.replicas.up())
        if not up:
            return error_response(503, "no replica is up", type_="server_error")
        return JSONResponse({"status": "ok", "replicas_up": up,
                             "replicas": len(router.replicas.replicas)})

    @app.get("/metrics")
    async def metrics() -> Response:
        router.observe()
        return PlainTextResponse(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _forward(router: Router, request: Request, path: str) -> Response:
    """A request to a replica (or the router's own error), counted by status."""
    try:
        tenant = router.tenant(request.headers.get("authorization", ""))
        response = await router.forward(path, await request.body(),
                                        forward_headers(dict(request.headers)), tenant)
    except RouterError as exc:
        kind = "authentication_error" if exc.status == 401 else "server_error"
        response = error_response(exc.status, exc.message, type_=kind)
    router.requests.labels(endpoint=path, status=str(response.status_code)).inc()
    return response
