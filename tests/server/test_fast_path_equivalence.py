"""The API server's per-request and per-token shortcuts equal what they replace:
the routes' own body parsing against FastAPI's body parameter, the SSE chunk template
against dumping the whole chunk, and the first-token-first order of a step's outputs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.testclient import TestClient

from paged_kv.engine import StepOutput
from paged_kv.engine.limits import EngineLimits
from paged_kv.engine.process.core_client import CoreClient
from paged_kv.server.http.protocol import ChatCompletionRequest, CompletionRequest
from paged_kv.server.http.responses import _chunk_encoder
from paged_kv.server.http.routes import parse_body

BODIES = [
    (b"{not json", "application/json"), (b'{"prompt": 5}', "application/json"),
    (b"[1, 2]", "application/json"), (b'{"prompt": "x"}', None),
    (b'{"prompt": "x"}', "text/plain"), (b"", "application/json"),
    (b'{"prompt": "x", "n": 0}', "application/json"),
    (b'{"prompt": "x", "presence_penalty": 1}', "application/json"),
    (b'{"prompt": "x", "stream": true, "echo": true}', "application/json"),
    (b'{"prompt": "x"}', "application/vnd.api+json"),
    (b'{"prompt": "x"}', "application/json; charset=utf-8"),
    (b'{"messages": []}', "application/json"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', "application/json"),
]


def _errors_app() -> FastAPI:
    """Each model twice: as FastAPI's body parameter and through `parse_body`."""
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse([{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                             for e in exc.errors()], status_code=400)

    @app.post("/fastapi/completions")
    async def native_completions(body: CompletionRequest) -> dict:
        return body.model_dump()

    @app.post("/fastapi/chat")
    async def native_chat(body: ChatCompletionRequest) -> dict:
        return body.model_dump()

    @app.post("/ours/completions")
    async def our_completions(request: Request) -> dict:
        return (await parse_body(request, CompletionRequest)).model_dump()

    @app.post("/ours/chat")
    async def our_chat(request: Request) -> dict:
        return (await parse_body(request, ChatCompletionRequest)).model_dump()

    return app


@pytest.mark.parametrize(("body", "content_type"), BODIES)
def test_parse_body_answers_as_fastapis_body_parameter(body, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    with TestClient(_errors_app()) as client:
        for route in ("completions", "chat"):
            native = client.post(f"/fastapi/{route}", content=body, headers=headers)
            ours = client.post(f"/ours/{route}", content=body, headers=headers)
            assert (ours.status_code, ours.json()) == (native.status_code, native.json())


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_chunk_template_gives_the_bytes_of_the_whole_dump(kind):
    head = {"id": 'cmpl-"x"', "object": "o", "created": 1, "model": "m\u00e9"}
    encode = _chunk_encoder(head, kind)
    for delta in ["a", '"', "\u00e9\n", "\x00", "", "x\ufffd", "\\u0000"]:
        for index in (0, 3):
            for reason, extra in ((None, {}), ("length", {}), ("stop", {"token_ids": [1]})):
                text = ({"delta": {"content": delta} if delta else {}} if kind == "chat"
                        else {"text": delta})  # the OpenAI shapes, written out here
                choice = {"index": index, **text, "finish_reason": reason, "logprobs": None}
                want = f"data: {json.dumps({**head, 'choices': [{**choice, **extra}]})}\n\n"
                assert encode(index, delta, reason, extra) == want


def test_first_outputs_of_a_request_go_before_the_steps_other_outputs():
    limits = EngineLimits(model_config=None, max_num_seqs=1, cache_config=None)
    client = CoreClient("ipc:///nowhere", b"api-0", limits=limits, core_sentinel=-1)
    client._fresh = {7, 9}
    outputs = [(1, StepOutput(1, 0, [5], None)), (7, StepOutput(7, 0, [6], None)),
               (2, StepOutput(2, 0, [7], None)), (7, StepOutput(7, 1, [8], None)),
               (9, StepOutput(9, 0, [], "abort"))]
    ordered = client._first_tokens_first(outputs)
    assert [(i, out.index) for i, out in ordered] == [(7, 0), (7, 1), (9, 0), (1, 0), (2, 0)]
    assert client._fresh == set()
    assert client._first_tokens_first(outputs) == outputs  # nobody new: as the core sent it
