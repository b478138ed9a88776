"""vLLM's KV-event schema, array-like msgpack (``vllm/distributed/kv_events.py``).

A batch is ``[timestamp, [event, ...]]`` (its trailing ``data_parallel_rank`` left out, as
vLLM omits defaults); an event is an array whose first item is its type name:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
  - the hashes form one chain, each the parent of the next; the parent is None where the
  chain starts (or where this replica does not know it);
- ``["BlockRemoved", block_hashes, medium]``;
- ``["AllBlocksCleared"]``.

Hashes are this cache's 32-byte chained sha256 keys (tenant salt at the root), as bytes.
A hybrid layout (layers of several kinds: `paged_kv.core.groups`) indexes each further layer
group's blocks under the same key with the group's number appended as a 33rd byte, so a
consumer tells a window group's blocks (gone from its window, or evicted on their own)
from the leading group's: a prompt hits only as far as every group still holds it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..keys import BlockEvent

MEDIUM_DEVICE = "GPU"  # vLLM's name for the engine's own pool, whichever device holds it


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
