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

**Recurrent layers** (Mamba, gated delta nets, short convolutions: a state, not a page per
token) are served from a prefix only where a *state checkpoint* sits: the states after the
leading group's block ``K``, indexed under ``K`` plus the state group's number (33 bytes,
as a window group's block). A checkpoint is published with the optional fields vLLM added
for its hybrid models' groups, in their array positions, ``group_idx`` (9) and
``kv_cache_spec_kind`` (10), of kind ``"mamba"`` (`STATE_KIND`, vLLM's kind of every
recurrent state group, `MambaSpec`):

- ``["BlockStored", [checkpoint keys], None, [], block_size, None, medium, None, None,
  group, "mamba"]``: checkpoints now servable. The parent is None: vLLM's parent is the
  block before the first one in the same group's chain, which a sparse checkpoint does not
  have (the block it follows is its key's first 32 bytes; its position is that block's end).
  It has no tokens of its own (the block it follows carries them);
- ``["BlockRemoved", [checkpoint keys], medium, group]``: checkpoints evicted.

And every batch of a replica whose model has recurrent layers opens with one store of no
blocks per state group, ``["BlockStored", [], None, [], block_size, None, medium, None,
None, group, "mamba"]``: valid under vLLM's schema (it stores nothing) and how a router
learns, before any checkpoint and from any batch it happens to see first (a replay buffer
forgets the oldest), that this replica's blocks alone serve nothing: its prefix hits end at
a checkpoint. ``AllBlocksCleared`` clears blocks, not checkpoints: the cache's reset keeps
them (they serve again once their blocks are back), and their own ``BlockRemoved`` says
when they go. A consumer that reads neither field (llm-d before it classified groups)
sees checkpoints as 33-byte blocks that no prompt's 32-byte keys reach: harmless.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..keys import KEY_BYTES, BlockEvent

MEDIUM_DEVICE = "GPU"  # vLLM's name for the engine's own pool, whichever device holds it
STATE_KIND = "mamba"  # vLLM's `KVCacheSpecKind` of a recurrent state group (`MambaSpec`)
# where vLLM's optional fields sit in its array form (its structs' field order)
STORED_GROUP, STORED_KIND = 9, 10  # BlockStored's group_idx, kv_cache_spec_kind
REMOVED_GROUP = 3  # BlockRemoved's group_idx


def to_wire(events: Iterable[BlockEvent], *, block_size: int, medium: str = MEDIUM_DEVICE,
            token_ids: bool = False, state_groups: Iterable[int] = ()) -> list[list]:
    """vLLM event arrays for the index events among `events` (others are skipped).

    A stored event whose blocks come from several sequences becomes one ``BlockStored`` per
    chain; an evicted or removed one a ``BlockRemoved``; a state checkpoint's event the
    same of its state group (see the module's docstring).

    Parameters
    ----------
    events : iterable of BlockEvent
        A step's cache events (`PagedKVCache.take_events`), in order.
    block_size : int
    medium : str
        The tier the blocks live in.
    token_ids : bool
        Whether stored blocks carry their token ids.
    state_groups : iterable of int
        The model's recurrent state groups (none: attention only). With any, a batch
        that says anything opens with their declarations.
    """
    out: list[list] = []
    for event in events:
        if event.kind == "stored":
            out.extend(_stored(event, block_size, medium, token_ids))
        elif event.kind in ("evicted", "removed"):
            out.append(["BlockRemoved", list(event.keys), medium])
        elif event.kind == "cleared":
            out.append(["AllBlocksCleared"])
        elif event.kind == "state_stored":
            out.extend(_checkpoints(event.keys, block_size, medium))
        elif event.kind == "state_removed":
            out.extend(["BlockRemoved", keys, medium, group]
                       for group, keys in _by_group(event.keys).items())
    if out and state_groups:
        out[:0] = [_state_store([], group, block_size, medium) for group in state_groups]
    return out


def _state_store(keys: list[bytes], group: int, block_size: int, medium: str) -> list:
    """A ``BlockStored`` of state group `group`'s checkpoints `keys` (none: the group's
    declaration). lora_id, lora_name and extra_keys are None, as vLLM sends them."""
    return ["BlockStored", keys, None, [], block_size, None, medium, None, None, group,
            STATE_KIND]


def _checkpoints(keys: Iterable[bytes], block_size: int, medium: str) -> list[list]:
    return [_state_store(group_keys, group, block_size, medium)
            for group, group_keys in _by_group(keys).items()]


def _by_group(keys: Iterable[bytes]) -> dict[int, list[bytes]]:
    """Checkpoint keys by their state group (the byte after the leading group's key), in
    order (a model has one state group today; the wire allows more)."""
    groups: dict[int, list[bytes]] = {}
    for key in keys:
        groups.setdefault(key[KEY_BYTES], []).append(key)
    return groups


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
    # the optional group fields a consumer keys its index by (checkpoints, declarations)
    group_at = STORED_GROUP if event[0] == "BlockStored" else REMOVED_GROUP
    if len(event) > group_at and not (event[group_at] is None
                                      or type(event[group_at]) is int):
        raise ValueError(f"KV event {event[0]}: group_idx must be an int or None, got "
                         f"{event[group_at]!r}")
    if event[0] == "BlockStored" and len(event) > STORED_KIND \
            and not (event[STORED_KIND] is None or isinstance(event[STORED_KIND], str)):
        raise ValueError(f"KV event BlockStored: kv_cache_spec_kind must be a str or None, "
                         f"got {event[STORED_KIND]!r}")
