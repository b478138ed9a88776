"""vLLM's KV-event schema, array-like msgpack (``vllm/distributed/kv_events.py``).

A batch is ``[timestamp, [event, ...]]`` (its trailing ``data_parallel_rank`` left out, as
vLLM omits defaults); an event is an array whose first item is its type name:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
  - the hashes form one chain, each the parent of the next; the parent is None where the
  chain starts (or where this replica does not know it);
- ``["BlockRemoved", block_hashes, medium]``;
- ``["AllBlocksCleared"]``.

Hashes are this cache's 32-byte chained sha256 keys (tenant salt at the root), as bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from ..keys import BlockEvent

MEDIUM_DEVICE = "GPU"  # vLLM's name for the engine's own pool, whichever device holds it


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """Where and how a replica publishes its KV events.

    Parameters
    ----------
    endpoint : str
        ZMQ endpoint the PUB socket binds, e.g. ``tcp://*:5557`` (``tcp://127.0.0.1:*``
        picks a free port).
    replay_endpoint : str, optional
        Where the ROUTER socket that resends buffered batches binds; None: no replay.
    topic : str
        First frame of every message (llm-d reads ``kv@<replica>@<model>``).
    token_ids : bool
        Publish the stored blocks' token ids. They are the tenants' prompts: off unless
        the operator allows it (hashes alone let a router that tokenizes route).
    buffer_steps : int
        Batches kept for replay.
    max_queue : int
        Batches waiting for the publisher thread; past it a batch is dropped, which a
        subscriber sees as a gap in the sequence numbers.
    replay_max_batches : int
        Batches one replay request gets at most (the oldest from its start; a subscriber
        asks again from where the reply stopped).
    replay_rate, replay_burst : float, int
        Replay requests one client (ZMQ identity) may make per second over time, and at
        once; past them a request is answered with the end-of-replay marker alone.
    replay_total_rate : float
        Replay requests per second all clients together may make.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    token_ids: bool = False
    buffer_steps: int = 10_000
    max_queue: int = 10_000
    replay_max_batches: int = 1000
    replay_rate: float = 1.0
    replay_burst: int = 10
    replay_total_rate: float = 20.0

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(f"{name}: expected a ZMQ endpoint like tcp://HOST:PORT, "
                                 f"got {value!r}")
        for name in ("buffer_steps", "max_queue", "replay_max_batches", "replay_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, got {getattr(self, name)}")
        for name in ("replay_rate", "replay_total_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a rate > 0 per second, "
                                 f"got {getattr(self, name)}")


def to_wire(events: Iterable[BlockEvent], *, block_size: int, medium: str = MEDIUM_DEVICE,
            token_ids: bool = False) -> list[list]:
    """vLLM event arrays for the index events among `events` (others are skipped).

    A stored event whose blocks come from several sequences becomes one ``BlockStored`` per
    chain; an evicted or removed one a ``BlockRemoved``.
    """
    out: list[list] = []
    for event in events:
        if event.kind == "stored":
            out.extend(_stored(event, block_size, medium, token_ids))
        elif event.kind in ("evicted", "removed"):
            out.append(["BlockRemoved", list(event.keys), medium])
        elif event.kind == "cleared":
            out.append(["AllBlocksCleared"])
    return out


def _stored(event: BlockEvent, block_size: int, medium: str, with_tokens: bool) -> list[list]:
    keys, parents = event.keys, event.parents
    tokens = (np.frombuffer(event.token_ids, dtype="<i4").tolist() if with_tokens else [])
    chains, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or parents[i] != keys[i - 1]:  # a new chain starts at i
            chain_tokens = tokens[start * block_size:i * block_size]
            chains.append(["BlockStored", list(keys[start:i]), parents[start] or None,
                           chain_tokens, block_size, None, medium])
            start = i
    return chains


def encode_batch(timestamp: float, events: list[list]) -> bytes:
    """The msgpack payload of one batch."""
    import msgspec  # the events extra: only a replica that publishes needs it

    return msgspec.msgpack.encode([timestamp, events])


def decode_batch(payload: bytes) -> tuple[float, list[list]]:
    """``(timestamp, events)`` of a payload, each event checked against the schema.

    Raises
    ------
    ValueError
        Naming what is malformed (not msgpack, not a batch, an unknown or short event).
    """
    import msgspec

    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"KV event batch: not msgpack ({exc})") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list) \
            or not isinstance(batch[0], int | float):
        raise ValueError("KV event batch: expected [timestamp, [events...], ...]")
    for event in batch[1]:
        _check_event(event)
    return float(batch[0]), batch[1]


_MIN_FIELDS = {"BlockStored": 5, "BlockRemoved": 2, "AllBlocksCleared": 1}


def _check_event(event) -> None:
    if not isinstance(event, list) or not event or event[0] not in _MIN_FIELDS:
        kind = event[0] if isinstance(event, list) and event else type(event).__name__
        raise ValueError(f"KV event: unknown event {kind!r}")
    if len(event) < _MIN_FIELDS[event[0]]:
        raise ValueError(f"KV event {event[0]}: {len(event)} fields, expected at least "
                         f"{_MIN_FIELDS[event[0]]}")
    if event[0] != "AllBlocksCleared" and not (
            isinstance(event[1], list) and all(isinstance(h, bytes | int) for h in event[1])):
        raise ValueError(f"KV event {event[0]}: block_hashes must be a list of bytes or ints")
