"""`DisaggRouter`: prefill on one set of replicas, decode on another (``paged-kv route
--prefill URL ... --decode URL ...``).

Each request goes first to a prefill replica, chosen cache-aware among the prefill
replicas exactly as `Router` chooses (their KV events feed the index), with
``max_tokens: 1``, ``stream: false`` and ``kv_transfer_params: {"do_remote_decode": true}``;
its answer's ``kv_transfer_params`` (where its pages wait, under a lease) go with the
client's original body to a decode replica (the least loaded, ties in rotation), whose
answer is streamed to the client unchanged. A prefill replica that fails (no connection,
5xx, 429) is replaced by another once; when none answers, the decode replica gets the
request without parameters: it counts a ``missing_params`` fallback and prefills itself,
so the split is never lost silently. A 4xx from the prefill replica is the client's
request at fault: it is the client's answer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable

import httpx
from prometheus_client import Counter, Histogram
from starlette.responses import Response

from ..handoff.config import ERROR_PREFIX as HANDOFF_ERROR
from ..handoff.trust import HEADER as SIGNATURE_HEADER
from ..handoff.trust import HandoffTrust
from .policy import choose
from .proxy import Router, RouterError
from .replicas import Replica, ReplicaSet

logger = logging.getLogger("paged_kv.router")

HANDOFF_OUTCOMES = ("ok", "prefill_failed", "no_prefill", "prefill_no_params",
                    "prefill_refused", "decode_failed", "decode_error", "client_gone")
PHASES = ("prefill", "decode_first_byte")
PREFILL_ATTEMPTS = 2  # the chosen prefill replica, then one other
TRANSFER_FIELD = "kv_transfer_params"  # vLLM's name for the hand-off parameters
# fields a one-token, unstreamed prefill request must not carry: stream_options is refused
# without a stream, and a chat's max_completion_tokens would outrank max_tokens
_NOT_FOR_PREFILL = ("stream_options", "max_completion_tokens", TRANSFER_FIELD)
_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Refused(Exception):
    """The prefill replica refused the request itself (a 4xx): the client's answer."""

    def __init__(self, answer: httpx.Response) -> None:
        super().__init__(answer.status_code)
        self.response = Response(answer.content, answer.status_code,
                                 media_type=answer.headers.get("content-type"))


def prefill_body(data: dict) -> dict:
    """The body a prefill replica gets: the client's, for one unstreamed token, marked for
    a hand-off to a decode replica."""
    body = {k: v for k, v in data.items() if k not in _NOT_FOR_PREFILL}
    body.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return body


def decode_body(data: dict, params: dict | None) -> dict:
    """The body a decode replica gets: the client's, with the prefill's parameters (and
    ``do_remote_prefill``); without them (no prefill answered) the client's as sent, less
    any ``kv_transfer_params`` of its own: that field is the router's."""
    body = {k: v for k, v in data.items() if k != TRANSFER_FIELD}
    if params is not None:
        body[TRANSFER_FIELD] = {**params, "do_remote_prefill": True}
    return body


class DisaggRouter(Router):
    """A `Router` over prefill replicas (`replicas`, cache-aware) that hands each request
    on to one of the `decode` replicas (least load, ties in rotation).

    Parameters
    ----------
    prefill, decode : ReplicaSet
        The prefill replicas (their KV events followed) and the decode replicas.
    tokenizer : ByteTokenizer or HFTokenizer
    secret : str
        The engines' hand-off secret: every body sent to them is signed with it
        (`paged_kv.handoff.trust`), as they take a hand-off from no one else.
    **kwargs
        As `Router` (policy, api_keys, balance, max_connections...): the policy chooses
        among the prefill replicas.
    """

    def __init__(self, prefill: ReplicaSet, decode: ReplicaSet, tokenizer, *, secret: str,
                 **kwargs) -> None:
        super().__init__(prefill, tokenizer, **kwargs)
        self.decode, self.trust = decode, HandoffTrust(secret)
        self._decode_turn = itertools.count()
        self.handoffs = Counter("paged_kv_router_handoffs", "Prefill-to-decode hand-offs by "
                                "outcome (ok: the decode replica got the prefill's "
                                "parameters and answered 200)", ["outcome"],
                                registry=self.registry)
        self.phase_seconds = Histogram(
            "paged_kv_router_handoff_phase_seconds", "Seconds per hand-off phase: the "
            "prefill call (retries included), and the decode call to its first byte (the "
            "pages' transfer included)", ["phase"], buckets=_PHASE_BUCKETS,
            registry=self.registry)
        for outcome in HANDOFF_OUTCOMES:  # every outcome exported from the start, at 0
            self.handoffs.labels(outcome=outcome)

    @property
    def replica_sets(self) -> tuple[ReplicaSet, ...]:
        """The prefill replicas, then the decode replicas."""
        return self.replicas, self.decode

    def health(self) -> tuple[str | None, dict]:
        """Serving needs a decode replica (without a prefill replica it prefills itself)."""
        prefill, decode = len(self.replicas.up()), len(self.decode.up())
        return (None if decode else "no decode replica is up"), {
            "status": "ok", "replicas_up": prefill + decode,
            "replicas": len(self.replicas.replicas) + len(self.decode.replicas),
            "prefill_up": prefill, "decode_up": decode}

    async def forward(self, path: str, body: bytes, headers: dict[str, str],
                      tenant: str | None) -> Response:
        """Prefill on a prefill replica, then stream the decode replica's answer.

        Raises
        ------
        RouterError
            400 for a body that is not a JSON object; 503 (or 429) when no decode replica
            takes the request.
        """
        tokens = self.prompt(path, body)
        data = json.loads(body)
        if not isinstance(data, dict):
            raise RouterError(400, "body: expected a JSON object")
        started = time.monotonic()
        try:
            params, outcome = await self._prefill(path, data, headers, tenant, tokens)
        except _Refused as exc:
            self.handoffs.labels(outcome="prefill_refused").inc()
            return exc.response
        except asyncio.CancelledError:
            self.handoffs.labels(outcome="client_gone").inc()
            raise
        self.phase_seconds.labels(phase="prefill").observe(time.monotonic() - started)
        return await self._decode(path, decode_body(data, params), headers, outcome)

    async def _prefill(self, path: str, data: dict, headers: dict[str, str],
                       tenant: str | None, tokens: list[int]) -> tuple[dict | None, str]:
        """The prefill's hand-off parameters (None: none to give) and the outcome so far."""
        content = json.dumps(prefill_body(data)).encode()
        headers = self.signed(headers, content)
        tried: set[str] = set()
        keys_by_size: dict[int, list[bytes]] = {}
        for _ in range(PREFILL_ATTEMPTS):
            picked = self.pick(tokens, tenant, tried, keys_by_size)
            if picked is None:
                break
            replica, choice, keys = picked
            tried.add(replica.url)
            answer = await self._ask_prefill(replica, path, content, headers)
            if answer is None:
                continue
            self.count_choice(choice, keys, tokens, replica)
            params = answer.get(TRANSFER_FIELD) if isinstance(answer, dict) else None
            if not isinstance(params, dict):
                logger.warning("prefill replica %s answered without %s: the decode replica "
                               "prefills itself (is it serving --role prefill?)",
                               replica.url, TRANSFER_FIELD)
                return None, "prefill_no_params"
            return params, "ok"
        if tried:
            logger.warning("prefill failed on %s: the decode replica prefills itself",
                           ", ".join(sorted(tried)))
        return None, "prefill_failed" if tried else "no_prefill"

    async def _ask_prefill(self, replica: Replica, path: str, content: bytes,
                           headers: dict[str, str]) -> object | None:
        """The prefill replica's JSON answer; None when it failed (marked down when it
        cannot be reached or answered 502-504, as `Router` marks them).

        Raises
        ------
        _Refused
            It answered a 4xx other than 429.
        """
        replica.in_flight += 1
        try:  # (a cancellation closes the request: the replica aborts the prefill)
            answer = await self.client.post(replica.url + path, content=content,
                                            headers=headers)
        except httpx.PoolTimeout:  # the router's own limit, not the replica's fault
            raise RouterError(503, f"the router is busy: all {self.max_connections} "
                                   f"connections to the replicas in use (--max-connections)",
                              headers={"Retry-After": "1"}) from None
        except httpx.HTTPError as exc:
            self.replicas.mark_down(replica, f"{type(exc).__name__}: {exc}")
            self.retries.labels(reason="connection").inc()
            return None
        finally:
            replica.in_flight -= 1
        status = answer.status_code
        if status == 429 or status >= 500:
            if status in (502, 503, 504):
                self.replicas.mark_down(replica, f"answered {status}")
            self.retries.labels(reason=str(status)).inc()
            return None
        if status != 200:
            raise _Refused(answer)
        try:
            return answer.json()
        except ValueError:  # a 200 that is no JSON: no parameters in it either
            return {}

    async def final_answer(self, upstream: httpx.Response) -> bytes | None:
        """A decode engine's 502 that says its hand-off failed (``--handoff-failure
        fail``) is the request's answer, not the replica's failure: relayed, the replica
        kept in routing (another would fail it too: the lease is gone)."""
        if upstream.status_code != 502:
            return None
        content = await upstream.aread()
        return content if HANDOFF_ERROR.encode() in content else None

    def signed(self, headers: dict[str, str], content: bytes) -> dict[str, str]:
        """`headers` with the router's signature of `content` (any the client sent is
        replaced: only the router signs)."""
        kept = {k: v for k, v in headers.items() if k.lower() != SIGNATURE_HEADER}
        return {**kept, SIGNATURE_HEADER: self.trust.router_header(content)}

    def _pick_decode(self, tried: set[str]) -> tuple[Replica, Callable[[], None]] | None:
        """The decode replica with the fewest requests in flight (ties in rotation)."""
        up = [r for r in self.decode.up() if r.url not in tried]
        if not up:
            return None
        choice = choose("least_load", [r.url for r in up], {r.url: r.in_flight for r in up},
                        {}, self._decode_turn)
        return next(r for r in up if r.url == choice.replica), lambda: None

    async def _decode(self, path: str, data: dict, headers: dict[str, str],
                      outcome: str) -> Response:
        """The decode replica's answer, relayed; the hand-off counted by `outcome` (or
        why the decode failed)."""
        started, content = time.monotonic(), json.dumps(data).encode()
        try:
            response = await self.relay(path, content, self.signed(headers, content),
                                        self._pick_decode, len(self.decode.replicas))
        except RouterError:
            self.handoffs.labels(outcome="decode_failed").inc()
            raise
        except asyncio.CancelledError:
            self.handoffs.labels(outcome="client_gone").inc()
            raise
        self.phase_seconds.labels(phase="decode_first_byte").observe(
            time.monotonic() - started)
        if outcome == "ok" and response.status_code != 200:
            outcome = "decode_error"
        self.handoffs.labels(outcome=outcome).inc()
        return response
