"""The FastAPI app: OpenAI's completions and chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving import SamplingParams
from .generation import Generation
from .loop import EngineLoop
from .protocol import ChatCompletionRequest, CompletionRequest, error_response
from .responses import final_body, stream_events

logger = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _ServerMetrics:
    """Request counters and latency histograms, in the engine's registry (one /metrics)."""

    def __init__(self, registry) -> None:
        self.requests = Counter("paged_kv_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.ttft = Histogram("paged_kv_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("paged_kv_inter_token_latency_seconds",
                             "Gap between consecutive tokens of a sample",
                             buckets=_LATENCY_BUCKETS, registry=registry)


class _CountRequests:
    """Counts responses by endpoint and status: plain ASGI, so streams and client
    disconnects pass through untouched (Starlette's BaseHTTPMiddleware wraps both)."""

    _PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                        "/metrics"})

    def __init__(self, app, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = ["500"]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:  # unknown paths share one label, so a scanner cannot grow the registry
            path = scope["path"] if scope["path"] in self._PATHS else "other"
            self.counter.labels(endpoint=path, status=status[0]).inc()


class _ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def create_app(loop: EngineLoop, tokenizer, *, model_name: str,
               api_keys: dict[str, str] | None = None, max_waiting: int = 256) -> FastAPI:
    """The server's app over a started-or-not `EngineLoop` (started and stopped with the app).

    Parameters
    ----------
    loop : EngineLoop
    tokenizer : ByteTokenizer or HFTokenizer
    model_name : str
        The id ``/v1/models`` reports.
    api_keys : dict, optional
        ``{key: tenant}``; with it every /v1 request needs ``Authorization: Bearer KEY`` and
        the tenant is the prefix-cache salt. Without it the server is single-tenant.
    max_waiting : int
        Requests queued beyond this get 429 with ``Retry-After``.
    """
    app = FastAPI(title="paged_kv", lifespan=_lifespan(loop))
    metrics = _ServerMetrics(loop.engine.metrics.registry)
    created = int(time.time())

    @app.exception_handler(_ApiError)
    async def api_error(request: Request, exc: _ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, headers=exc.headers,
                              type_="authentication_error" if exc.status == 401 else
                              "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, param=".".join(where) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), type_="not_found_error"
                              if exc.status_code == 404 else "invalid_request_error")

    app.add_middleware(_CountRequests, counter=metrics.requests)

    def tenant(request: Request) -> str | None:
        if api_keys is None:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in api_keys:
            raise _ApiError(401, "missing or unknown API key: send Authorization: Bearer KEY")
        return api_keys[key.strip()]

    def sampling(body, prompt: list[int], max_tokens: int | None) -> tuple[SamplingParams, list]:
        stop_ids = list(body.stop_token_ids or [])
        eos = getattr(tokenizer, "eos_token_id", None)
        if not body.ignore_eos and eos is not None:
            stop_ids.append(eos)
        if max_tokens is None:  # OpenAI's default: as much as the context allows, here 16
            max_tokens = 16
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                                    top_p=body.top_p, n=body.n, seed=body.seed,
                                    stop_token_ids=tuple(stop_ids))
            loop.engine.check_request(prompt, params)
        except (TypeError, ValueError) as exc:
            raise _ApiError(400, str(exc)) from None
        if loop.num_waiting >= max_waiting:
            raise _ApiError(429, f"server busy: {loop.num_waiting} requests waiting "
                                 f"(--max-waiting {max_waiting}); retry later",
                            headers={"Retry-After": "1"})
        return params, body.stop_strings

    async def run(body, prompt: list[int], max_tokens: int | None, salt: str | None,
                  kind: str, http_request: Request) -> Response:
        if not prompt:
            raise _ApiError(400, "prompt: empty; give at least one token or character",
                            param="prompt")
        params, stops = sampling(body, prompt, max_tokens)
        generation = Generation(loop, tokenizer, prompt, params, stops, salt)
        try:
            await generation.start()
        except (TypeError, ValueError) as exc:  # what check_request could not foresee
            raise _ApiError(400, str(exc)) from None
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(stream_events(generation, body, kind, response_id,
                                                   model_name, _observe),
                                     media_type="text/event-stream")
        if not await _until_done_or_gone(generation, http_request):
            return Response(status_code=499)  # nobody is listening any more
        _observe(generation)
        return JSONResponse(final_body(generation, body, kind, response_id, model_name))

    def _observe(generation: Generation) -> None:
        if generation.output is None:
            return
        metrics.ttft.observe(generation.output.time_to_first_token)
        for gap in generation.output.token_latencies:
            metrics.itl.observe(gap)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        salt = tenant(request)
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        return await run(body, prompt, body.max_tokens, salt, "text", request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        salt = tenant(request)
        try:
            prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        except ValueError as exc:
            raise _ApiError(400, str(exc), param="messages") from None
        return await run(body, prompt, body.max_completion_tokens or body.max_tokens, salt,
                         "chat", request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        tenant(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "paged_kv"}]}

    @app.get("/health")
    async def health() -> Response:
        if not loop.is_alive:
            return error_response(503, "engine thread stopped", type_="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        engine = loop.engine

        def text() -> str:  # on the engine thread: gauges as of now, even when idle
            engine.metrics.observe(engine.cache, engine.scheduler, 0)
            return engine.metrics_text()

        body = await asyncio.wrap_future(loop.submit(text))
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    return app


async def _until_done_or_gone(generation: Generation, request: Request) -> bool:
    """Collect the whole generation; False (and the request aborted) if the client left."""

    async def consume() -> None:
        async for _ in generation.updates():
            pass

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return False
        task.result()
        return True
    finally:
        generation.abort()  # a no-op once finished; frees the blocks otherwise


def _lifespan(loop: EngineLoop):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not loop.is_alive:
            loop.start()
        yield
        loop.stop()

    return lifespan
