"""`OpenAIService`: what the routes do, without HTTP: tenants, sampling parameters, running a
generation, and observing it. The routes (`routes.py`) only parse and hand over."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Sequence

from prometheus_client import Counter, Histogram

from ...engine import EngineDeadError, SamplingParams
from ...engine.process.engine_client import EngineClient
from ...handoff.params import HandoffParams, parse_params
from ...handoff.trust import HandoffTrust
from ...keys import HASH_SCHEME
from .generation import Generation
from .protocol import (
    DEFAULT_LIMITS,
    ChatCompletionRequest,
    CompletionRequest,
    InputLimits,
    bearer_tenant,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ApiError(Exception):
    """An answer other than success: HTTP status, OpenAI error message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


@dataclasses.dataclass
class Job:
    """A started generation and how to answer it."""

    generation: Generation
    body: CompletionRequest | ChatCompletionRequest
    kind: str  # "text" | "chat"
    response_id: str


class OpenAIService:
    """The server's logic over an engine (`InprocClient` or `CoreClient`) and a tokenizer.

    Parameters
    ----------
    engine : EngineClient
    tokenizer : ByteTokenizer or HFTokenizer
    model_name : str
        The id ``/v1/models`` reports first, and every response's ``model``.
    served_model_names : sequence of str
        Every name a request's ``model`` may give (``--served-model-name``, vLLM's rule:
        `model_name` is always one; another is a 404; none given: `model_name`).
    api_keys : dict, optional
        ``{key: tenant}``; the tenant is the prefix-cache salt. None: single tenant, no auth.
    max_waiting : int
        Requests that would wait for a running slot beyond this get 429.
    input_limits : InputLimits
        What one request may ask (log-probabilities, body size).
    admin_keys : iterable of str
        Keys that authenticate as admin (any tenant's flush and warm-up; no tenant salt of
        their own). Without `api_keys` everyone is admin (one tenant, no auth).
    tenant_names : iterable of str
        Tenants an admin may name besides those of `api_keys` (the policy's).
    handoff_secret : str, optional
        A prefill or decode engine's hand-off secret: a request that asks it for a hand-off
        (``kv_transfer_params.do_remote_*``) must carry the router's signature under it
        (`handoff_of`). None: no role, ``kv_transfer_params`` mean nothing here.
    """

    def __init__(self, engine: EngineClient, tokenizer, *, model_name: str,
                 served_model_names: Sequence[str] = (),
                 api_keys: dict[str, str] | None = None, max_waiting: int = 256,
                 input_limits: InputLimits = DEFAULT_LIMITS, admin_keys: Iterable[str] = (),
                 tenant_names: Iterable[str] = (), handoff_secret: str | None = None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.served_model_names = tuple(dict.fromkeys((model_name, *served_model_names)))
        self.api_keys, self.max_waiting = api_keys, max_waiting
        self.admin_keys = frozenset(admin_keys)
        self.tenant_names = frozenset({*tenant_names, *(api_keys or {}).values()})
        self.input_limits = input_limits
        self.handoff_trust = None if handoff_secret is None else HandoffTrust(handoff_secret)
        registry = engine.registry
        self.requests = Counter("paged_kv_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.ttft = Histogram("paged_kv_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("paged_kv_inter_token_latency_seconds",
                             "Gap between consecutive tokens of a sample",
                             buckets=_LATENCY_BUCKETS, registry=registry)

    # -- requests -------------------------------------------------------------------------
    def tenant(self, authorization: str) -> str | None:
        """The tenant of an ``Authorization`` header (None without api keys); 401 otherwise."""
        try:
            return bearer_tenant(self.api_keys, authorization)
        except PermissionError as exc:
            raise ApiError(401, str(exc)) from None

    def authenticate(self, authorization: str) -> tuple[str | None, bool]:
        """``(tenant, is_admin)`` of an ``Authorization`` header: an admin key has no tenant;
        without api keys everyone is admin of the one tenant (None); 401 otherwise."""
        if self.api_keys is None:
            return None, True
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() == "bearer" and key.strip() in self.admin_keys:
            return None, True
        return self.tenant(authorization), False

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        """The prompt's token ids; 400 for text the tokenizer refuses."""
        prompt = body.prompt
        if not isinstance(prompt, str):
            return prompt
        try:
            return self.tokenizer.encode(prompt)
        except ValueError as exc:  # (parse_body refuses lone surrogates, the known case)
            raise ApiError(400, f"prompt: the tokenizer refused it: {exc}",
                           param="prompt") from None

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template's prompt for the messages; 400 when the model has none, or its
        template refuses them (e.g. a system message)."""
        try:
            return self.tokenizer.apply_chat_template(
                [m.as_template_message() for m in body.messages])
        except ValueError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from None

    def sampling(self, body: CompletionRequest | ChatCompletionRequest, prompt: list[int],
                 kind: str) -> SamplingParams:
        """The engine's parameters for `body`, checked against the engine (400) and the
        queue (429) before anything reaches it."""
        self._check_model(body)
        if not prompt:
            raise ApiError(400, "prompt: empty; give at least one token or character",
                           param="prompt")
        self._check_logprobs(body)
        stop_ids = list(body.stop_token_ids or [])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if not body.ignore_eos and eos is not None:
            stop_ids.append(eos)
        try:
            params = SamplingParams(
                max_tokens=self._max_tokens(body, prompt, kind), temperature=body.temperature,
                top_p=body.top_p, top_k=max(body.top_k, 0), n=body.n, seed=body.seed,
                stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos,
                logprobs=body.num_logprobs, prompt_logprobs=prompt_logprobs(body, kind))
            self.engine.limits.check(prompt, params)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc), param=_param_of(str(exc), body, kind)) from None
        if self.engine.num_waiting >= self.max_waiting:
            raise ApiError(429, f"server busy: {self.engine.num_waiting} requests waiting "
                                f"(--max-waiting {self.max_waiting}); retry later",
                           headers={"Retry-After": "1"})
        return params

    def _check_model(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """404 for a ``model`` this server does not serve (vLLM's answer; before, any name
        was served as if it were this one). A request without ``model`` gets the first
        served name, as in vLLM: many clients leave it out (this repository's benchmarks
        and tests among them)."""
        if body.model is not None and body.model not in self.served_model_names:
            raise ApiError(404, f"The model `{body.model}` does not exist.", param="model")

    def _check_logprobs(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """400 naming the first field that asks for more top log-probabilities than
        ``--max-logprobs`` (vLLM's rule): the engine ships them for every token."""
        limit = self.input_limits.max_logprobs
        for name, asked in body.logprob_asks.items():
            if asked > limit:
                raise ApiError(400, f"{name}: {asked} is more than this server's limit of "
                                    f"{limit} (--max-logprobs); ask for at most {limit}",
                               param=name)

    def _max_tokens(self, body, prompt: list[int], kind: str) -> int:
        """The body's limit, or the default: OpenAI's 16 for completions; for chat, as much as
        the context and the pool allow."""
        asked = body.max_completion_tokens or body.max_tokens if kind == "chat" \
            else body.max_tokens
        if asked is not None:
            return asked
        if kind != "chat":
            return 16
        return self.engine.limits.room(len(prompt))

    def handoff_of(self, body, header: str | None, raw: bytes) -> HandoffParams | None:
        """The body's ``kv_transfer_params``; on a prefill or decode engine, a hand-off
        (``do_remote_decode`` / ``do_remote_prefill``) only with the router's signature of
        the `raw` body in `header` (`paged_kv.handoff.trust`): 403 otherwise, so a client
        can neither lease pages nor name where a decode engine pulls from."""
        params = parse_params(body.kv_transfer_params)
        if params is None or self.handoff_trust is None \
                or not (params.do_remote_decode or params.do_remote_prefill):
            return params
        error = self.handoff_trust.router_error(header, raw)
        if error is not None:
            raise ApiError(403, f"kv_transfer_params: a hand-off is the router's to ask "
                                f"for: {error}", param="kv_transfer_params")
        return params

    async def start(self, body, prompt: list[int], salt: str | None, kind: str,
                    handoff: HandoffParams | None = None) -> Job:
        """Validate and queue a generation (400 / 429 / 503 before anything runs);
        `handoff` is the body's checked ``kv_transfer_params`` (`handoff_of`)."""
        if self.engine.dead is not None:
            raise ApiError(503, f"engine dead: {self.engine.dead}")
        params = self.sampling(body, prompt, kind)
        generation = Generation(self.engine, self.tokenizer, prompt, params, body.stop_strings,
                                salt, priority=body.priority,
                                retention_seconds=body.retention_seconds,
                                handoff=handoff)
        try:
            await generation.start()
        except (TypeError, ValueError) as exc:  # what check_request could not foresee
            raise ApiError(400, str(exc)) from None
        except EngineDeadError as exc:
            raise ApiError(503, f"engine dead: {exc}") from None
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        return Job(generation, body, kind, response_id)

    def observe(self, generation: Generation) -> None:
        """Latency histograms of a finished generation (not of one the engine failed)."""
        if generation.output is None or generation.error is not None:
            return
        self.ttft.observe(generation.output.time_to_first_token)
        for gap in generation.output.token_latencies:
            self.itl.observe(gap)

    def models(self, created: int) -> dict:
        """``/v1/models``: every served name, the one responses report first."""
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "paged_kv"}
                                           for name in self.served_model_names]}

    def kv_events_info(self) -> dict | None:
        """``/kv_events``: the publisher's bound endpoints, pool size and how its hashes are
        made (a router computes the same keys from the prompt); None when events are off."""
        info = self.engine.limits.kv_events
        if info is None:
            return None
        return {**info, "num_blocks": self.engine.limits.cache_config.num_usable_blocks,
                "hash": HASH_SCHEME, "model": self.model_name}

    async def metrics_text(self) -> str:
        """Prometheus exposition: the engine's gauges as of now, the server's counters."""
        return await self.engine.metrics_text()


def prompt_logprobs(body: CompletionRequest | ChatCompletionRequest, kind: str) -> int | None:
    """How many top log-probabilities the engine computes per prompt token: what
    ``prompt_logprobs`` asks, or (``echo`` with ``logprobs``) what the echoed prompt's
    ``logprobs`` need, whichever is more; None when neither asks, so the engine computes
    none."""
    asks = [body.prompt_logprobs]
    if kind == "text" and body.echo:
        asks.append(body.logprobs)
    asked = [k for k in asks if k is not None]
    return max(asked) if asked else None


def _param_of(message: str, body: CompletionRequest | ChatCompletionRequest,
              kind: str) -> str | None:
    """The request field an engine check's message names (``"SamplingParams.n=..."``,
    ``"prompt (12) + max_tokens (9) ..."``), for OpenAI's ``param``; None if none."""
    name = message.removeprefix("SamplingParams.").split("=")[0].split(":")[0].split(" ")[0]
    if name == "prompt_token_ids":
        return "messages" if kind == "chat" else "prompt"
    if name == "prompt":
        return "max_tokens"  # (too long in all: the one a client can lower)
    return name if name in type(body).model_fields else None
