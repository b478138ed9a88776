"""The routes that run are the routes `routes.router` declares: the request counter labels
every declared route by its own path (not "other"), and the fast path serves exactly the
declared POST routes, calling their functions as FastAPI would."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel

from paged_kv.server.http import routes
from paged_kv.server.http.app import fast_routes

from ..conftest import prometheus_value
from .test_openai_semantics import make_client

COUNTER = "paged_kv_http_requests_total"


def _declared() -> list[APIRoute]:
    return [route for route in routes.router.routes if isinstance(route, APIRoute)]


def test_every_declared_route_is_counted_under_its_own_path():
    declared = _declared()
    paths = {route.path for route in declared}
    assert {"/kv_events", "/v1/completions", "/metrics"} <= paths, paths  # not vacuous
    statuses = {}
    with make_client() as client:
        for route in declared:
            method = "POST" if "POST" in route.methods else "GET"
            # a POST with an empty object is a 400 (no prompt): counted all the same
            response = client.request(method, route.path, json={} if method == "POST" else None)
            statuses[route.path] = response.status_code
        assert client.get("/nowhere").status_code == 404
        text = client.get("/metrics").text
    assert statuses["/kv_events"] == 404, "KV events are off in this app"
    for path, status in statuses.items():
        labels = f'{{endpoint="{path}",status="{status}"}}'
        assert prometheus_value(text, COUNTER, labels) >= 1, f"{path} is not counted as itself"
    assert prometheus_value(text, COUNTER, '{endpoint="other",status="404"}') == 1


def test_the_fast_path_serves_the_declared_post_routes():
    post = {route.path: route.endpoint for route in _declared() if "POST" in route.methods}
    assert post == {"/v1/completions": routes.completions,
                    "/v1/chat/completions": routes.chat}
    assert fast_routes(routes.router) == post


def test_a_post_route_that_fastapi_would_parse_is_refused_by_the_fast_path():
    class Body(BaseModel):
        prompt: str

    router = APIRouter()

    @router.post("/v1/raw")
    async def raw(request: Request) -> None:
        return None

    @router.post("/v1/parsed")
    async def parsed(body: Body) -> None:
        return None

    with pytest.raises(TypeError, match=r"POST /v1/parsed: .*parsed takes \['body'\]"):
        fast_routes(router)
    router.routes.remove(next(r for r in router.routes if r.path == "/v1/parsed"))
    assert fast_routes(router) == {"/v1/raw": raw}
