"""`Router`: a request's keys, the choice of replica, and the forwarding with retries."""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import ValidationError
from starlette.responses import Response

from ..server.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    bearer_tenant,
    error_response,
)
from ..server.http.tokenizer import ChatTemplateRefused
from .index import prompt_keys
from .policy import Choice, choose
from .relay import RelayEnd, RelayResponse, RetryElsewhere, no_more, response_headers, retry_after
from .replicas import Replica, ReplicaSet

logger = logging.getLogger("paged_kv.router")

RETRY_STATUSES = frozenset({429, 502, 503, 504})  # the replica cannot take it: try another
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class RouterError(Exception):
    """An answer the router gives itself: HTTP status, message, the body field it names
    (OpenAI's ``param``) and headers (``Retry-After``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


class Router:
    """Chooses a replica for each request and forwards it, streaming the answer back.

    Parameters
    ----------
    replicas : ReplicaSet
    tokenizer : ByteTokenizer or HFTokenizer
        The replicas' tokenizer: the router computes the keys they index.
    policy : {"cache", "round_robin", "least_load"}
    api_keys : dict, optional
        ``{key: tenant}``, the replicas' file: the tenant salts the keys, as there.
    balance_abs, balance_rel, load_tokens : int, float, float
        The imbalance guard and the cost of a request in flight (see
        `paged_kv.router.policy.choose`).
    max_connections : int, optional
        Connections to the replicas at most, all together (each request in flight holds
        one); None: no limit, the replicas' own queues (``--max-waiting``) refuse what they
        cannot take.
    pool_timeout : float
        Seconds a request waits for a connection when `max_connections` are in use, then
        the router answers 503.
    """

    def __init__(self, replicas: ReplicaSet, tokenizer, *, policy: str = "cache",
                 api_keys: dict[str, str] | None = None, balance_abs: int = 8,
                 balance_rel: float = 1.5, load_tokens: float = 512.0,
                 max_connections: int | None = None, pool_timeout: float = 10.0) -> None:
        self.replicas, self.tokenizer, self.policy = replicas, tokenizer, policy
        self.api_keys, self.balance = api_keys, (balance_abs, balance_rel)
        self.load_tokens = load_tokens
        self._turn = itertools.count()
        # httpx's default pool (100 connections, waited for without end) would cap the
        # router at 100 requests in flight in total, whatever the replicas could run
        self.max_connections = max_connections
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=2.0, pool=pool_timeout),
            limits=httpx.Limits(max_connections=max_connections))
        self._template_errors = _template_errors()
        self.registry = registry = CollectorRegistry()
        self.decisions = Counter("paged_kv_router_decisions", "Routing decisions by reason",
                                 ["reason"], registry=registry)
        self.prompt_tokens = Counter("paged_kv_router_prompt_tokens",
                                     "Prompt tokens of routed requests", registry=registry)
        self.hit_tokens = Counter("paged_kv_router_prefix_hit_tokens",
                                  "Prompt tokens the chosen replica held, by the index",
                                  registry=registry)
        self.retries = Counter("paged_kv_router_retries",
                               "Requests sent again to another replica", ["reason"],
                               registry=registry)
        self.requests = Counter("paged_kv_router_requests", "HTTP requests by endpoint and "
                                "status", ["endpoint", "status"], registry=registry)
        self.lag = Histogram("paged_kv_router_event_lag_seconds", "KV event publication to "
                             "index", buckets=_LAG_BUCKETS, registry=registry)
        self._gauges = {name: Gauge(f"paged_kv_router_{name}", doc, labels, registry=registry)
                        for name, doc, labels in _GAUGES}

    def on_batch(self, replica: Replica, stamp: float, events: list[list]) -> None:
        """A replica's batch of events: into the index (on a subscriber's thread)."""
        self.replicas.index.apply(replica.url, events)
        self.lag.observe(max(time.time() - stamp, 0.0))

    # -- a request ------------------------------------------------------------------------
    def tenant(self, authorization: str) -> str | None:
        """The tenant of an ``Authorization`` header (None without api keys)."""
        try:
            return bearer_tenant(self.api_keys, authorization)
        except PermissionError as exc:
            raise RouterError(401, str(exc)) from None

    def prompt(self, path: str, body: bytes) -> list[int]:
        """The prompt's token ids as a replica computes them (empty when the body is not a
        valid request: a replica answers it with the right 400).

        Raises
        ------
        RouterError
            400 when the body is not JSON (a replica could only say the same) or the chat
            template refuses the messages (a jinja2 error).
        """
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:  # also over-long integer literals
            raise RouterError(400, f"body: not valid JSON: {_first_line(exc)}") from None
        try:
            if path.endswith("/chat/completions"):
                request = ChatCompletionRequest.model_validate(data)
                return self._render([m.as_template_message() for m in request.messages])
            prompt = CompletionRequest.model_validate(data).prompt
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except (ValueError, ValidationError, KeyError, TypeError):
            return []

    def _render(self, messages: list[dict]) -> list[int]:
        try:
            return list(self.tokenizer.apply_chat_template(messages))
        except self._template_errors as exc:  # e.g. a template that refuses a system role
            raise RouterError(400, f"messages: the chat template refused them: "
                                   f"{_first_line(exc)}", param="messages") from None

    def pick(self, tokens: list[int], salt: str | None, exclude: set[str],
             keys_by_size: dict[int, list[bytes]] | None = None,
             ) -> tuple[Replica, Choice, list[bytes]] | None:
        """The replica for a prompt (None: none can take it), the decision, its keys
        (hashed once per block size: `keys_by_size` keeps them across a request's retries;
        replicas of different block sizes index different keys, so each is matched on its
        own)."""
        up = [r for r in self.replicas.up() if r.url not in exclude]
        if not up:
            return None
        keys_by_size = {} if keys_by_size is None else keys_by_size
        sizes = {r.url: r.block_size for r in up}
        for size in set(sizes.values()):
            if size not in keys_by_size:
                keys_by_size[size] = prompt_keys(tokens, size, salt)
        index, scores = self.replicas.index, {}
        if self.policy == "cache":
            for size in set(sizes.values()):
                scores.update(index.match(keys_by_size[size],
                                          [url for url, s in sizes.items() if s == size]))
        room = {r.url: r.capacity - index.count(r.url) for r in up}
        choice = choose(self.policy, list(sizes), {r.url: r.in_flight for r in up}, scores,
                        self._turn, num_tokens=len(tokens), block_size=sizes,
                        room=room, load_tokens=self.load_tokens,
                        balance_abs=self.balance[0], balance_rel=self.balance[1])
        replica = next(r for r in up if r.url == choice.replica)
        return replica, choice, keys_by_size[replica.block_size]

    async def forward(self, path: str, body: bytes, headers: dict[str, str],
                      tenant: str | None) -> Response:
        """Send the request to the chosen replica; one that fails before the first byte
        of its answer reaches the client is marked down and the next one is tried. When
        none takes it and some answered 429, so does the router, with the longest of their
        ``Retry-After``."""
        tokens = self.prompt(path, body)
        keys_by_size: dict[int, list[bytes]] = {}

        def pick(tried: set[str]) -> tuple[Replica, Callable[[], None]] | None:
            picked = self.pick(tokens, tenant, tried, keys_by_size)
            if picked is None:
                return None
            replica, choice, keys = picked
            return replica, lambda: self.count_choice(choice, keys, tokens, replica)

        return await self.relay(path, body, headers, pick, len(self.replicas.replicas))

    async def relay(self, path: str, body: bytes, headers: dict[str, str],
                    pick: Callable[[set[str]], tuple[Replica, Callable[[], None]] | None],
                    total: int) -> Response:
        """Stream `body`'s answer from the replica ``pick(tried)`` names (with what to run
        once it answers), the next one when it fails before its first byte.

        Raises
        ------
        RouterError
            429 (with the longest ``Retry-After``) when every replica tried was busy, 503
            when none of the `total` could take the request.
        """
        tried: set[str] = set()
        busy: list[float] = []  # the Retry-After of each replica that answered 429
        while (picked := pick(tried)) is not None:
            replica, chosen = picked
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                upstream, chunks, first = await self._open(replica, path, body, headers)
            except RetryElsewhere as exc:
                replica.in_flight -= 1
                self.retries.labels(reason=exc.reason).inc()
                if exc.retry_after is not None:
                    busy.append(exc.retry_after)
                continue
            except BaseException:  # the client left (cancelled) while the replica worked
                replica.in_flight -= 1
                raise
            chosen()
            return RelayResponse(first, chunks, RelayEnd(replica, upstream),
                                  status_code=upstream.status_code,
                                  headers=response_headers(upstream))
        if busy:
            raise RouterError(429, f"every replica that could take the request is busy "
                                   f"({len(busy)} answered 429); retry later",
                              headers={"Retry-After": str(math.ceil(max(busy)))})
        raise RouterError(503, f"no replica can take the request (tried {len(tried)} of "
                               f"{total})")

    async def _open(self, replica: Replica, path: str, body: bytes,
                    headers: dict[str, str],
                    ) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        request = self._client.build_request("POST", replica.url + path, content=body,
                                             headers=headers)
        upstream = None
        try:  # (a cancellation closes the upstream too: the replica then aborts the work)
            upstream = await self._client.send(request, stream=True)
            if upstream.status_code in RETRY_STATUSES:
                answer = await self.final_answer(upstream)
                if answer is not None:  # the request's own answer: relayed, not retried
                    return upstream, no_more(), answer
                await upstream.aclose()
                if upstream.status_code != 429:
                    self.replicas.mark_down(replica, f"answered {upstream.status_code}")
                    raise RetryElsewhere(str(upstream.status_code))
                raise RetryElsewhere("429", retry_after(upstream.headers.get("retry-after")))
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
            return upstream, chunks, first
        except httpx.PoolTimeout:  # the router's own limit, not the replica's fault
            raise RouterError(503, f"the router is busy: all {self.max_connections} "
                                   f"connections to the replicas in use (--max-connections)",
                              headers={"Retry-After": "1"}) from None
        except httpx.HTTPError as exc:
            if upstream is not None:
                await upstream.aclose()
            self.replicas.mark_down(replica, f"{type(exc).__name__}: {exc}")
            raise RetryElsewhere("connection") from None
        except BaseException:
            if upstream is not None:
                await upstream.aclose()
            raise

    async def final_answer(self, upstream: httpx.Response) -> bytes | None:
        """The body of an answer with a retry status (`RETRY_STATUSES`) that is the
        request's own answer rather than the replica's failure, to relay as it is; None:
        try another replica (here always; `DisaggRouter` relays a failed hand-off)."""
        return None

    def count_choice(self, choice: Choice, keys: list[bytes], tokens: list[int],
               replica: Replica) -> None:
        """Count a routing decision (and the prefix it was made for), and note the
        prompt's keys as held by `replica` until its own events say so."""
        self.decisions.labels(reason=choice.reason).inc()
        self.prompt_tokens.inc(len(tokens))
        self.hit_tokens.inc(min(round(choice.hit_blocks) * replica.block_size, len(tokens)))
        self.replicas.index.guess(replica.url, keys)

    @property
    def replica_sets(self) -> tuple[ReplicaSet, ...]:
        """Every set of replicas the router probes (here one: `replicas`)."""
        return (self.replicas,)

    @property
    def client(self) -> httpx.AsyncClient:
        """The connections to the replicas (the `max_connections` pool)."""
        return self._client

    async def start(self) -> None:
        """Probe the replicas once, then keep probing them in the background."""
        for replicas in self.replica_sets:
            await replicas.start()

    def health(self) -> tuple[str | None, dict]:
        """What ``/health`` says: why the router cannot serve (None: it can), and the
        replicas up."""
        up = len(self.replicas.up())
        return (None if up else "no replica is up"), {
            "status": "ok", "replicas_up": up, "replicas": len(self.replicas.replicas)}

    async def models(self, headers: dict[str, str]) -> Response:
        """``/v1/models`` of the first replica up."""
        for replica in (r for s in self.replica_sets for r in s.up()):
            try:
                answer = await self._client.get(f"{replica.url}/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            return Response(answer.content, answer.status_code,
                            media_type=answer.headers.get("content-type"))
        return error_response(503, "no replica is up", type_="server_error")

    def observe(self) -> None:
        """Gauges as of now (before a scrape)."""
        gauges = self._gauges
        for replica in (r for replicas in self.replica_sets for r in replicas.replicas):
            url = replica.url
            gauges["in_flight"].labels(replica=url).set(replica.in_flight)
            gauges["replica_up"].labels(replica=url).set(int(replica.up))
            gauges["index_blocks"].labels(replica=url).set(
                len(self.replicas.index.blocks_of(url)))
            counts = {} if replica.subscriber is None else replica.subscriber.counts
            for outcome in ("batches", "gaps", "replayed", "missed", "malformed", "resets"):
                gauges["event_batches"].labels(replica=url, outcome=outcome).set(
                    counts.get(outcome, 0))

    async def close(self) -> None:
        """Stop probing and following the replicas; close the connections to them."""
        for replicas in self.replica_sets:
            await replicas.close()
        await self._client.aclose()


_GAUGES = (("in_flight", "Requests in flight at each replica", ["replica"]),
           ("replica_up", "1 while the replica answers /health", ["replica"]),
           ("index_blocks", "Blocks the replica holds, by its KV events", ["replica"]),
           ("event_batches", "KV event batches from each replica since it was followed, by "
                             "outcome (batches applied, gaps, replayed, missed, malformed)",
            ["replica", "outcome"]))


def _template_errors() -> tuple[type[Exception], ...]:
    """What a chat template's refusal raises: `HFTokenizer`'s own error, or jinja2's from
    a tokenizer that lets it through (jinja2 comes with the hf extra)."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        return (ChatTemplateRefused,)
    return (ChatTemplateRefused, TemplateError)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
