"""`CheckpointExport`: the state group's checkpoints as the tiers, the hand-off and KV
events see them — block-sized values under chunk keys (`state_values`), and the events
announcing them. A part of `StateGroup` (`paged_kv.core.groups.state_group`) of its own:
it reads the group's slots, slab and block size, and changes the slots only to adopt a
checkpoint that came from elsewhere.
"""

from __future__ import annotations

import torch

from ...keys import KEY_BYTES, BlockEvent
from . import state_values
from .checkpoints import DENSE
from .rules import group_key


class CheckpointExport:
    """Methods of `StateGroup` over its ``slots`` (`StateSlots`), ``slab`` (`StateSlab`),
    ``index``, ``tables`` and ``block_nbytes`` (a lower tier's value: a pool block's
    bytes)."""

    def tier_keys(self, key: bytes) -> list[bytes]:
        """The chunk keys of the checkpoint after the leading group's block `key`: what a
        lower tier or a hand-off is asked for, after the blocks of the run it ends."""
        count = state_values.num_chunks(self.slab.slot_nbytes, self.block_nbytes)
        return state_values.chunk_keys(group_key(key, self.index), count)

    def owns_value(self, key: bytes) -> bool:
        """Whether `key` is a chunk key of this group's checkpoints."""
        return state_values.chunk_of(key, (self.index,)) is not None

    def take_events(self) -> list[BlockEvent]:
        """The checkpoints that became servable (``state_stored``: slots, keys, and each
        one's parent, the leading group's block it follows) or went (``state_removed``)
        since the last call, in order, runs of one kind in one event."""
        events: list[BlockEvent] = []
        for kind, slot, key in self.slots.events:
            kind = "state_" + kind
            parent = (key[:KEY_BYTES],) if kind == "state_stored" else ()
            if events and events[-1].kind == kind:
                last = events[-1]
                events[-1] = BlockEvent(kind, (*last.block_ids, slot), (*last.keys, key),
                                        (*last.parents, *parent))
            else:
                events.append(BlockEvent(kind, (slot,), (key,), parent))
        self.slots.events.clear()
        return events

    def stored_values(self, events: list[BlockEvent]) -> tuple[list[bytes], torch.Tensor]:
        """The checkpoints `events` stored that the slab still holds, as a lower tier
        keeps them: chunk keys and ``[len(keys), block_nbytes]`` uint8 values (a slot
        evicted and taken again since is skipped: its bytes are another's now). Only
        those the policy ranks above `DENSE` now — a row's newest, the sparse interval, a
        junction: a state is the K/V of hundreds of tokens, and copying one out at every
        block boundary a long prompt passes would cost the tiers that much per 16 tokens."""
        keys, values = [], []
        for event in events:
            if event.kind != "state_stored":
                continue
            for slot, key in zip(event.block_ids, event.keys, strict=True):
                if self.slots.written_key(slot) != key \
                        or self.slots.policy.tier_of(slot) == DENSE:
                    continue
                rows = state_values.encode(self.slots.position_of(slot),
                                           self.slab.read_bytes(slot), self.block_nbytes)
                keys += state_values.chunk_keys(key, len(rows))
                values.append(rows)
        empty = torch.zeros((0, self.block_nbytes), dtype=torch.uint8)
        return keys, torch.cat(values) if values else empty

    def values_at(self, key: bytes) -> torch.Tensor | None:
        """The written checkpoint after the leading group's block `key` as `stored_values`
        gives it (``[chunks, block_nbytes]`` uint8, under `tier_keys(key)`), or None."""
        slot = self.slots.find(group_key(key, self.index))
        if slot is None:
            return None
        return state_values.encode(self.slots.position_of(slot), self.slab.read_bytes(slot),
                                   self.block_nbytes)

    def load_values(self, keys: list[bytes], values: torch.Tensor) -> int:
        """Index the checkpoints whose every chunk is in `keys` (`values`: ``[len(keys),
        block_nbytes]`` uint8, verified by the tier), each in a slot the policy gives
        (`StateSlots.adopt`: none when the key is held already or every checkpoint ranks
        higher); returns the chunks of the checkpoints loaded."""
        count = state_values.num_chunks(self.slab.slot_nbytes, self.block_nbytes)
        loaded, i = 0, 0
        while i + count <= len(keys):
            key = state_values.checkpoint_key(keys[i])
            if keys[i:i + count] != state_values.chunk_keys(key, count):
                i += 1
                continue
            position, states = state_values.decode(values[i:i + count],
                                                   self.slab.slot_nbytes)
            size = self.tables.block_size
            slot = (self.slots.adopt(key, position) if position > 0 and position % size == 0
                    else None)
            if slot is not None:
                self.slab.write_bytes(slot, states)
                loaded += count
            i += count
        return loaded
