"""The HTTP routes: parse, hand over to the `OpenAIService` in ``app.state``, answer.

Module level (an `APIRouter`), so the app is wired in one place and the logic lives in the
service, testable without HTTP. The router is the one list of routes: the app reads its
fast path and its request counter's labels from it. The POST routes (the two generation
routes) take the raw `Request` and parse their body themselves (`parse_body`), so the app
calls them past FastAPI's per-request layers (`app.fast_routes`).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from ...handoff.trust import HEADER as HANDOFF_HEADER
from .metrics_scope import metrics_viewer, scoped_exposition
from .protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
)
from .responses import EventStream, error_body, error_status, final_body, stream_events
from .service import ApiError, Job, OpenAIService

router = APIRouter()
_Body = TypeVar("_Body", bound=BaseModel)


def service(request: Request) -> OpenAIService:
    """The app's service."""
    return request.app.state.service


def tenant(request: Request) -> str | None:
    """The tenant the auth middleware found for this request."""
    return getattr(request.state, "tenant", None)


async def parse_body(request: Request, model: type[_Body],
                     max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> _Body:
    """The request's JSON body as `model`, refused as FastAPI refuses a body parameter (the
    same `RequestValidationError`, so the same 400s), without FastAPI's per-request body and
    dependency machinery: a good part of a request's CPU in the API server, and of the
    time before it reaches the engine. Beyond FastAPI, what would have been a 500 is a 400
    naming the field: a body that is not UTF-8, an integer literal too long for Python (more
    than 4300 digits), a lone surrogate (``"\\ud800"``: valid JSON, not text); and a body
    past `max_bytes` is a 413 (`ApiError`) before it is read whole."""
    raw = request.state.raw_body = await read_body(request, max_bytes)  # (signatures)
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    data: Any = raw
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/")
                                      and kind.endswith("+json")):
        try:
            data = _JSON.decode(raw)
        except (msgspec.DecodeError, RecursionError):  # json's reading and errors, as before
            data = _json_loads(raw)
        if ESCAPED_SURROGATE.search(raw):  # (a cheap scan; most bodies have none)
            check_text(data)
    try:
        return model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from None


# msgspec's JSON decoder: the body's plain Python values, as json.loads gives them, in a
# fraction of its time (a 200-id prompt: ~3 us, not ~15). What it refuses (a lone surrogate,
# NaN, a number past float or 4300 digits, a BOM, malformed JSON, nesting past Python's
# recursion limit, as json's) json.loads reads or refuses as before.
_JSON = msgspec.json.Decoder()


def _json_loads(raw: bytes) -> Any:
    """``json.loads(raw)``, its refusals as the 400s `parse_body` names."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{
            "type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
            "input": {}, "ctx": {"error": exc.msg}}]) from None
    except ValueError as exc:  # not UTF-8, or an integer literal past 4300 digits
        raise RequestValidationError([json_value_error(raw, exc)]) from None
    except RecursionError:  # arrays or objects nested past Python's stack
        raise RequestValidationError([{
            "type": "json_invalid", "loc": ("body",), "input": {},
            "msg": "JSON nested too deeply"}]) from None


# a JSON escape of a UTF-16 surrogate: a lone one is valid JSON and not text (pairs are fine)
ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


class _LongInt:
    """An integer literal Python refuses to convert (more than 4300 digits)."""

    def __init__(self, literal: str) -> None:
        self.digits = len(literal.lstrip("-"))


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body; 413 (`ApiError`) as soon as it is known to pass `max_bytes`, from
    its Content-Length or while it arrives, so a huge body is neither kept nor parsed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"request body: {size} bytes or more, past this server's limit of "
                         f"{max_bytes} (--max-request-bytes); send a shorter prompt")


def json_value_error(raw: bytes, exc: ValueError) -> dict:
    """The validation error of a body `json.loads` refused other than as malformed JSON:
    bytes that are not UTF-8 (at the body), or an integer literal past Python's limit on
    digits (at the field that holds it, found by parsing again with a stand-in for it)."""
    if isinstance(exc, UnicodeDecodeError):
        return {"type": "json_invalid", "loc": ("body",), "input": {},
                "msg": f"not UTF-8 text (byte {exc.start}: {exc.reason})"}

    def parse_int(literal: str) -> int | _LongInt:
        try:
            return int(literal)
        except ValueError:
            return _LongInt(literal)

    found = _find(json.loads(raw, parse_int=parse_int), lambda v: isinstance(v, _LongInt))
    if found is None:  # not an integer after all: say what json said
        return {"type": "json_invalid", "loc": ("body",), "input": {}, "msg": str(exc)}
    path, value = found
    return {"type": "int_parsing", "loc": ("body", *path), "input": {},
            "msg": f"an integer literal of {value.digits} digits is out of range"}


def check_text(data: Any) -> None:
    """Refuse a string holding a lone surrogate anywhere in `data` (`RequestValidationError`
    at its field): no tokenizer can encode it, nor can a response quote it."""

    def lone_surrogate(value: Any) -> bool:
        if not isinstance(value, str):
            return False
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False

    found = _find(data, lone_surrogate)
    if found is not None:
        path, text = found
        where = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
        raise RequestValidationError([{
            "type": "string_unicode", "loc": ("body", *path), "input": {},
            "msg": f"a lone surrogate ({text[where]!a}) at character {where} is not "
                   f"text; send valid Unicode"}])


def _find(data: Any, match) -> tuple[tuple, Any] | None:
    """``(path, value)`` of the first value in nested lists and dicts that `match`es."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if match(value):
            return path, value
        if isinstance(value, dict):
            stack += reversed([((*path, key), item) for key, item in value.items()])
        elif isinstance(value, list):
            stack += reversed([((*path, i), item) for i, item in enumerate(value)])
    return None


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    svc = service(request)
    body = await parse_body(request, CompletionRequest, svc.input_limits.max_request_bytes)
    handoff = svc.handoff_of(body, request.headers.get(HANDOFF_HEADER), request.state.raw_body)
    job = await svc.start(body, svc.completion_prompt(body), tenant(request), "text", handoff)
    return await _answer(svc, job, request)


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    svc = service(request)
    body = await parse_body(request, ChatCompletionRequest, svc.input_limits.max_request_bytes)
    handoff = svc.handoff_of(body, request.headers.get(HANDOFF_HEADER), request.state.raw_body)
    job = await svc.start(body, svc.chat_prompt(body), tenant(request), "chat", handoff)
    return await _answer(svc, job, request)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return service(request).models(request.app.state.created)


@router.get("/health")
async def health(request: Request) -> Response:
    engine = service(request).engine
    if not engine.is_alive:
        return error_response(503, f"engine cannot serve: {engine.dead or 'draining or stopped'}",
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
    """Prometheus exposition; with API keys, tenants' series only for a key that may see
    them (`metrics_scope`: an admin's every tenant, a tenant's its own; 401 for an unknown
    key; none: the pool's series alone)."""
    svc = service(request)
    tenant, whole = metrics_viewer(svc, request.headers.get("authorization", ""))
    body = await svc.metrics_text()
    return PlainTextResponse(body if whole else scoped_exposition(body, tenant),
                             media_type=CONTENT_TYPE_LATEST)


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
        return JSONResponse(error_body(job.generation), status_code=error_status(job.generation))
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
