"""The FastAPI app: wiring only. The routes are in `routes.py`, the logic in `service.py`.

The routes that run are the routes `routes.router` declares: the fast path's table and the
request counter's endpoint labels are both read from it, so there is one list of routes.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import Counter
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine.process.engine_client import EngineClient
from .admin import router as admin_router
from .dashboard import router as dashboard_router
from .protocol import DEFAULT_LIMITS, InputLimits, error_response, status_error
from .routes import router
from .service import ApiError, OpenAIService


def create_app(engine: EngineClient, tokenizer, *, model_name: str,
               served_model_names: Sequence[str] = (),
               api_keys: dict[str, str] | None = None, max_waiting: int = 256,
               input_limits: InputLimits = DEFAULT_LIMITS, admin_keys: Iterable[str] = (),
               tenant_names: Iterable[str] = (), handoff_secret: str | None = None) -> FastAPI:
    """The server's app over a started-or-not `InprocClient` or `CoreClient` (started and
    stopped with the app); the arguments are `OpenAIService`'s. With `api_keys`, every /v1
    request needs ``Authorization: Bearer KEY`` (a tenant's, or one of `admin_keys`),
    checked before its body is read. The admin and warm-up routes (`admin.router`) are
    served by FastAPI, not the fast path."""
    service = OpenAIService(engine, tokenizer, model_name=model_name, api_keys=api_keys,
                            served_model_names=served_model_names,
                            max_waiting=max_waiting, input_limits=input_limits,
                            admin_keys=admin_keys, tenant_names=tenant_names,
                            handoff_secret=handoff_secret)
    app = FastAPI(title="paged_kv", lifespan=_lifespan(engine))
    app.state.service, app.state.created = service, int(time.time())
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # innermost: after auth, before FastAPI's routing
    app.add_middleware(_FastPath, routes=fast_routes(router), engine=engine)
    app.add_middleware(_Authenticate, service=service)  # runs after counting
    app.add_middleware(_CountRequests, counter=service.requests,
                       paths=frozenset(route.path for declared in (router, admin_router,
                                                                   dashboard_router)
                                       for route in declared.routes))
    app.include_router(router)
    app.include_router(admin_router)
    app.include_router(dashboard_router)  # GET /dashboard: the live page of the pool
    return app


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return status_error(exc.status, exc.message, param=exc.param, headers=exc.headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return error_response(400, f"{'.'.join(where) or 'body'}: {message}",
                          param=".".join(where) or None)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), type_="not_found_error"
                          if exc.status_code == 404 else "invalid_request_error")


def fast_routes(router: APIRouter) -> dict[str, Callable]:
    """``{path: route function}`` of the POST routes `router` declares (the two generation
    routes), which the fast path (`_FastPath`) calls as FastAPI would.

    Raises
    ------
    TypeError
        Naming a POST route whose function takes more than the raw request: FastAPI would
        parse its parameters, the fast path cannot (a route parses its body itself, with
        `routes.parse_body`).
    """
    found = {}
    for route in router.routes:
        if isinstance(route, APIRoute) and "POST" in route.methods:
            parameters = list(inspect.signature(route.endpoint).parameters)
            if parameters != ["request"]:
                raise TypeError(f"POST {route.path}: its function {route.endpoint.__name__} "
                                f"takes {parameters}; the fast path passes only the raw "
                                "request (parse the body with routes.parse_body)")
            found[route.path] = route.endpoint
    return found


class _FastPath:
    """The declared POST routes (``/v1/completions``, ``/v1/chat/completions``) straight to
    their route functions, answering their errors with the app's handlers: FastAPI's
    exception, exit stack, routing and dependency layers, passed on every request and (the
    exception layer) on every token's send, are most of the API server's time before a
    request reaches the engine core. Anything else, and these paths with other methods, goes
    to FastAPI. Each generation request is announced to the engine (`announce`, where the
    client has it) before its body is read, so that a step about to start waits for it."""

    def __init__(self, app, routes: dict[str, Callable], engine: EngineClient) -> None:
        self.app, self.routes = app, routes
        self.announce = getattr(engine, "announce", None)

    async def __call__(self, scope, receive, send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if self.announce is not None:
            self.announce()
        request = Request(scope, receive)
        try:
            response = await route(request)
        except ApiError as exc:
            response = await _api_error(request, exc)
        except RequestValidationError as exc:
            response = await _invalid(request, exc)
        await response(scope, receive, send)


class _Authenticate:
    """Checks the API key of every /v1 request before anything reads its body, so an
    unauthenticated caller learns nothing about request validation (401 first)."""

    def __init__(self, app, service: OpenAIService) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            try:
                tenant, admin = self.service.authenticate(
                    headers.get(b"authorization", b"").decode())
            except ApiError as exc:
                response = error_response(exc.status, exc.message, type_="authentication_error")
                return await response(scope, receive, send)
            scope.setdefault("state", {}).update(tenant=tenant, admin=admin)
        await self.app(scope, receive, send)


class _CountRequests:
    """Counts responses by endpoint and status: plain ASGI, so streams and client
    disconnects pass through untouched (Starlette's BaseHTTPMiddleware wraps both).
    `paths` are the declared routes' own labels; any other path is "other"."""

    def __init__(self, app, counter: Counter, paths: frozenset[str]) -> None:
        self.app, self.counter, self.paths = app, counter, paths

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
            path = scope["path"] if scope["path"] in self.paths else "other"
            self.counter.labels(endpoint=path, status=status[0]).inc()


def _lifespan(engine: EngineClient):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    return lifespan
