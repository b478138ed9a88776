"""The messages between API server processes and the engine-core process: msgpack (msgspec),
each in a length-prefixed frame (`frames.py`) over the core's Unix socket, one connection
per API server.

An API server sends requests, aborts and metrics queries; the core answers with one
`Outputs` message per step per API server (every token that step made for that server's
requests, and the queue's length), never one per token.
"""

from __future__ import annotations

import msgspec

from ...handoff.params import HandoffParams
from .. import RequestOutput, SamplingParams, StepOutput


class Add(msgspec.Struct, array_like=True, tag=0):
    """Queue a request; ``request_id`` is the API server's own (unique per server)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    salt: str | None
    priority: int | None = None  # soft retention (None: the tenant's defaults)
    retention_seconds: float | None = None
    handoff: HandoffParams | None = None  # its kv_transfer_params (a prefill / decode role)


class Abort(msgspec.Struct, array_like=True, tag=1):
    """Stop a request and free its blocks."""

    request_id: int


class MetricsQuery(msgspec.Struct, array_like=True, tag=2):
    """Ask for the engine's prometheus exposition (answered by `MetricsText`)."""

    token: int


class Flush(msgspec.Struct, array_like=True, tag=4):
    """An admin's flush of a tenant's cached blocks, or with ``retention_only`` the end of
    their soft retention (answered by `Reply`: how many blocks)."""

    token: int
    tenant: str | None
    retention_only: bool


class CachedQuery(msgspec.Struct, array_like=True, tag=5):
    """How many tokens of the prompt's full blocks the prefix cache holds for ``salt``
    now (answered by `Reply`; changes nothing: a warm-up's answer)."""

    token: int
    prompt_token_ids: list[int]
    salt: str | None


class Arriving(msgspec.Struct, array_like=True, tag=6):
    """A generation request reached the API server: its `Add` follows once the route has
    read and checked it (a few hundred µs), or never when it is refused there. A hint, no
    more: the core holds a step about to start for it, briefly (`EngineCoreProc`)."""


class Outputs(msgspec.Struct, array_like=True, tag=10):
    """One step's outputs for one API server: ``(request_id, StepOutput)`` pairs (maybe
    none), the requests that would wait for a running slot after the step, whichever API
    server sent them, and how many `Add`s the core has taken from this one (those are in
    `waiting` already; the ones it sent since are not): what its 429s count. Every API
    server is sent one after each step that changed either number, so none keeps a count
    that no longer holds."""

    outputs: list[tuple[int, StepOutput]]
    waiting: int
    received: int


class MetricsText(msgspec.Struct, array_like=True, tag=11):
    """The engine's prometheus exposition, answering the `MetricsQuery` of the same token."""

    token: int
    text: str


class Reply(msgspec.Struct, array_like=True, tag=14):
    """The answer to the `Flush` or `CachedQuery` of the same token: a count, or the
    ValueError message the engine raised."""

    token: int
    value: int
    error: str | None = None


class Bye(msgspec.Struct, array_like=True, tag=12):
    """The core is stopping cleanly (drained on SIGTERM): the API servers stop too, exit 0."""


class Draining(msgspec.Struct, array_like=True, tag=13):
    """The core got SIGTERM: it finishes what it has and takes nothing new, so an API server
    answers new requests (and /health) 503, which routers retry elsewhere, not 500."""


# (tag 3 was `Hello`, an API server announcing itself to ZMQ's ROUTER: a connection does now)
ToCore = Add | Abort | MetricsQuery | Flush | CachedQuery | Arriving
FromCore = Outputs | MetricsText | Bye | Draining | Reply

encode = msgspec.msgpack.Encoder().encode
decode_to_core = msgspec.msgpack.Decoder(ToCore).decode
decode_from_core = msgspec.msgpack.Decoder(FromCore).decode


def failed_outputs(request_id: int, n: int, message: str) -> list[StepOutput]:
    """The step outputs of a request failed before or outside the engine: each of its `n`
    samples finishes with "error"; the last carries the `RequestOutput` naming `message`."""
    last = RequestOutput(request_id, [], [], True, 0, 0, 0.0, [], error=message)
    return [StepOutput(request_id, i, [], "error", last if i == n - 1 else None)
            for i in range(n)]
