"""The HTTP routes: parse, hand over to the `OpenAIService` in ``app.state``, answer.

Module level (an `APIRouter`), so the app is wired in one place and the logic lives in the
service, testable without HTTP.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from .protocol import ChatCompletionRequest, CompletionRequest, error_response
from .responses import EventStream, error_body, final_body, stream_events
from .service import Job, OpenAIService

router = APIRouter()
_Body = TypeVar("_Body", bound=BaseModel)


def service(request: Request) -> OpenAIService:
    """The app's service."""
    return request.app.state.service


def tenant(request: Request) -> str | None:
    """The tenant the auth middleware found for this request."""
    return getattr(request.state, "tenant", None)


async def parse_body(request: Request, model: type[_Body]) -> _Body:
    """The request's JSON body as `model`, refused as FastAPI refuses a body parameter (the
    same `RequestValidationError`, so the same 400s), without FastAPI's per-request body and
    dependency machinery: a good part of a request's CPU in the API server, and of the
    time before it reaches the engine."""
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    data: Any = raw
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/")
                                      and kind.endswith("+json")):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{
                "type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                "input": {}, "ctx": {"error": exc.msg}}]) from None
    try:
        return model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from None


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    svc = service(request)
    job = await svc.start(body, svc.completion_prompt(body), tenant(request), "text")
    return await _answer(svc, job, request)


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    svc = service(request)
    job = await svc.start(body, svc.chat_prompt(body), tenant(request), "chat")
    return await _answer(svc, job, request)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return service(request).models(request.app.state.created)


@router.get("/health")
async def health(request: Request) -> Response:
    loop = service(request).loop
    if not loop.is_alive:
        return error_response(503, f"engine cannot serve: {loop.dead or 'draining or stopped'}",
                              type_="server_error")
    return JSONResponse({"status": "ok"})


@router.get("/kv_events")
async def kv_events(request: Request) -> Response:
    """Where this replica publishes its KV events, for routers to subscribe (404: off)."""
    info = service(request).kv_events_info()
    if info is None:
        return error_response(404, "KV events are off: start the server with --kv-events",
                              type_="not_found_error")
    return JSONResponse(info)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await service(request).metrics_text()
    return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)


async def _answer(svc: OpenAIService, job: Job, request: Request) -> Response:
    """A stream of events, or the whole response once done (499 if the client left, 500 if
    the engine failed the request)."""
    model = svc.model_name
    if job.body.stream:
        return EventStream(stream_events(job, model, svc.observe))
    if not await _until_done_or_gone(job, request):
        return Response(status_code=499)  # nobody is listening any more
    svc.observe(job.generation)
    if job.generation.failed:
        return JSONResponse(error_body(job.generation), status_code=500)
    return JSONResponse(final_body(job, model, svc.tokenizer))


async def _until_done_or_gone(job: Job, request: Request) -> bool:
    """Collect the whole generation; False (and the request aborted) if the client left."""

    async def consume() -> None:
        async for _ in job.generation.updates():
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
        job.generation.abort()  # a no-op once finished; frees the blocks otherwise
