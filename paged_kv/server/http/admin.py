"""The cache routes: an admin's flush and unretain of a tenant's cached blocks, and a
tenant's warm-up (prefill and cache a prompt's full blocks without generating).

Served by FastAPI (not the fast path of the generation routes): ``app.create_app``
includes `router` beside `routes.router`. Who may call what:

- ``POST /v1/cache/flush`` ``{"tenant", "retention_only"}`` and ``POST /v1/cache/unretain``
  ``{"tenant"}``: an admin key only (403 otherwise); without ``--api-keys`` everyone is
  admin of the one tenant, and ``tenant`` is left out;
- ``POST /v1/cache/warm`` ``{"prompt"}`` or ``{"messages"}``: any key, under its own tenant
  (so it counts against that tenant's quota); an admin names the ``tenant``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ...engine import EngineDeadError
from .protocol import MAX_PRIORITY, ChatMessage, CompletionRequest, TokenId
from .responses import error_body
from .routes import parse_body, service, tenant
from .service import ApiError, OpenAIService

router = APIRouter()


class FlushRequest(BaseModel):
    """``POST /v1/cache/flush``: evict `tenant`'s cached blocks (its running requests keep
    theirs), or with `retention_only` only end their soft retention."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = None
    retention_only: Annotated[bool, Field(strict=True)] = False


class UnretainRequest(BaseModel):
    """``POST /v1/cache/unretain``: end the soft retention of `tenant`'s cached blocks."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = None


class WarmRequest(BaseModel):
    """``POST /v1/cache/warm``: a prompt (text or token ids) or chat messages to cache."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[TokenId] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tenant: str | None = None  # an admin's: whose cache to warm
    priority: Annotated[int, Field(strict=True, ge=0, le=MAX_PRIORITY)] | None = None
    retention_seconds: float | None = Field(default=None, ge=0, allow_inf_nan=False)


def is_admin(request: Request) -> bool:
    """Whether the auth middleware found an admin key (or no keys are configured)."""
    return bool(getattr(request.state, "admin", False))


def admin_target(request: Request, named: str | None) -> str | None:
    """The tenant an admin call acts on: 403 for a tenant's key; 400 at ``tenant`` for one
    missing (with API keys), unknown, or given to a server of one tenant."""
    svc = service(request)
    if not is_admin(request):
        raise ApiError(403, "this endpoint needs an admin key (admin_keys in the tenants "
                            "file)")
    if svc.api_keys is None:
        if named is not None:
            raise ApiError(400, f"tenant: this server has one tenant (no --api-keys); leave "
                                f"it out, got {named!r}", param="tenant")
        return None
    if named is None:
        raise ApiError(400, "tenant: required: name the tenant to act on", param="tenant")
    if named not in svc.tenant_names:
        raise ApiError(400, f"tenant: unknown tenant {named!r}", param="tenant")
    return named


@router.post("/v1/cache/flush")
async def flush(request: Request) -> Response:
    """Evict a tenant's cached blocks (or end their retention); ``{"tenant", "blocks"}``."""
    svc = service(request)
    body = await parse_body(request, FlushRequest, svc.input_limits.max_request_bytes)
    return await _flush(svc, admin_target(request, body.tenant), body.retention_only)


@router.post("/v1/cache/unretain")
async def unretain(request: Request) -> Response:
    """End the soft retention of a tenant's cached blocks; ``{"tenant", "blocks"}``."""
    svc = service(request)
    body = await parse_body(request, UnretainRequest, svc.input_limits.max_request_bytes)
    return await _flush(svc, admin_target(request, body.tenant), True)


async def _flush(svc: OpenAIService, target: str | None, retention_only: bool) -> Response:
    try:
        blocks = await svc.engine.flush_tenant(target, retention_only)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tenant") from None
    except EngineDeadError as exc:
        raise ApiError(503, f"engine dead: {exc}") from None
    return JSONResponse({"tenant": target, "blocks": blocks})


@router.post("/v1/cache/warm")
async def warm(request: Request) -> Response:
    """Prefill and cache a prompt's full blocks under the caller's tenant; answers
    ``{"prompt_tokens", "cached_tokens"}`` (tokens of its full blocks cached now)."""
    svc = service(request)
    body = await parse_body(request, WarmRequest, svc.input_limits.max_request_bytes)
    salt = _warm_tenant(request, body.tenant)
    prompt = warm_prompt(svc, body)
    # one token generated and dropped: the prompt's prefill is what fills the cache
    job = await svc.start(CompletionRequest(
        prompt=prompt, max_tokens=1, temperature=0, priority=body.priority,
        retention_seconds=body.retention_seconds), prompt, salt, "text")
    try:
        async for _ in job.generation.updates():
            pass
    finally:
        job.generation.abort()  # a no-op once finished; frees the blocks if the client left
    if job.generation.failed:
        return JSONResponse(error_body(job.generation), status_code=500)
    try:
        cached = await svc.engine.cached_tokens(prompt, salt)
    except EngineDeadError as exc:
        raise ApiError(503, f"engine dead: {exc}") from None
    return JSONResponse({"prompt_tokens": len(prompt), "cached_tokens": cached})


def _warm_tenant(request: Request, named: str | None) -> str | None:
    """A warm-up's salt: the caller's own tenant, or for an admin the one it names."""
    if is_admin(request):
        return admin_target(request, named)
    own = tenant(request)
    if named is not None and named != own:
        raise ApiError(403, "tenant: only an admin key may warm another tenant's cache",
                       param="tenant")
    return own


def warm_prompt(svc: OpenAIService, body: WarmRequest) -> list[int]:
    """The token ids to warm: the prompt's, or the chat messages rendered up to the end of
    the last one (no generation prompt), so the next turn's prompt starts with them."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "prompt: give either prompt or messages", param="prompt")
    if body.messages is None:
        return svc.completion_prompt(CompletionRequest(prompt=body.prompt))
    try:
        return svc.tokenizer.apply_chat_template(
            [m.as_template_message() for m in body.messages], add_generation_prompt=False)
    except ValueError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
