"""KV events: the cache's index changes, published in vLLM's wire format and followed.

`schema` turns the allocator's index events into vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` arrays (msgpack, array-like, as llm-d decodes them) and back, a
recurrent model's state checkpoints among them (vLLM's ``group_idx`` and
``kv_cache_spec_kind`` ``"mamba"``);
`publisher` sends one batch per step over ZMQ PUB with a replay socket; `subscriber`
follows one publisher in order, replaying gaps; `config` holds `KVEventsConfig`, where and
how a replica publishes. Sockets live here, never in the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import KVEventsConfig
from .schema import MEDIUM_DEVICE, decode_batch, encode_batch, to_wire

if TYPE_CHECKING:
    from .publisher import EventPublisher

__all__ = ["MEDIUM_DEVICE", "KVEventsConfig", "decode_batch", "encode_batch", "open_publisher",
           "to_wire"]


def open_publisher(config: KVEventsConfig | None, block_size: int, tiers=None,
                   state_groups: tuple[int, ...] = ()) -> EventPublisher | None:
    """A started publisher for `config` (None: events off), which also publishes the
    changes of `tiers` (a `TierManager`) when given, and declares `state_groups` (the
    model's recurrent layers' group) in every batch. pyzmq is imported only here."""
    if config is None:
        return None
    from .publisher import EventPublisher

    publisher = EventPublisher(config, block_size=block_size, state_groups=state_groups)
    if tiers is not None:
        tiers.watch(publisher.publish_tier)
    return publisher
