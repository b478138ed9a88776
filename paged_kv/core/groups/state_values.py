"""A state checkpoint as the tiers and the hand-off keep it: block-sized values under keys.

A lower tier stores values of one size (a block's bytes: `KVPool.block_nbytes`), fetched
as one run of keys (`paged_kv.tiers.fetcher`). A checkpoint's states are another size, so
it travels as ``ceil((8 + state bytes) / block bytes)`` values under *chunk keys*: the
checkpoint's group key (`group_key` of the leading group's block, as in the device's
index), then the chunk's number (2 bytes, little-endian). The first 8 bytes carry the
position (tokens the states consumed: the boundary after that block), so a checkpoint
loaded into another process is indexed where it was taken; the last chunk is padded with
zeros. Every value is verified and fingerprinted by the tiers' codec as a block is.

Nothing here knows a store: functions over bytes and tensors.
"""

from __future__ import annotations

import torch

from ...keys import KEY_BYTES

POSITION_BYTES = 8  # the checkpoint's position, int64 little-endian, before its states
CHUNK_BYTES = 2  # a chunk key's suffix: the chunk's number


def num_chunks(state_nbytes: int, block_nbytes: int) -> int:
    """Values one checkpoint of `state_nbytes` takes at `block_nbytes` each."""
    return -(-(POSITION_BYTES + state_nbytes) // block_nbytes)


def chunk_keys(key: bytes, count: int) -> list[bytes]:
    """The `count` chunk keys of the checkpoint indexed under `key`."""
    return [key + j.to_bytes(CHUNK_BYTES, "little") for j in range(count)]


def checkpoint_key(chunk_key: bytes) -> bytes:
    """The checkpoint's key a chunk key belongs to."""
    return chunk_key[:-CHUNK_BYTES]


def chunk_of(key: bytes, groups) -> int | None:
    """`key`'s chunk number when it is a chunk key of a checkpoint of one of `groups`
    (state group numbers), else None (a block's key)."""
    if len(key) != KEY_BYTES + 1 + CHUNK_BYTES or key[KEY_BYTES] not in groups:
        return None
    return int.from_bytes(key[KEY_BYTES + 1:], "little")


def encode(position: int, states: torch.Tensor, block_nbytes: int) -> torch.Tensor:
    """``[num_chunks, block_nbytes]`` uint8: `position` and ``[state_nbytes]`` uint8
    `states` (`StateSlab.read_bytes`), zero-padded to whole values."""
    count = num_chunks(states.numel(), block_nbytes)
    out = torch.zeros(count * block_nbytes, dtype=torch.uint8)
    out[:POSITION_BYTES] = torch.frombuffer(bytearray(position.to_bytes(POSITION_BYTES,
                                                                         "little")),
                                            dtype=torch.uint8)
    out[POSITION_BYTES:POSITION_BYTES + states.numel()] = states
    return out.view(count, block_nbytes)


def decode(rows: torch.Tensor, state_nbytes: int) -> tuple[int, torch.Tensor]:
    """`encode`'s ``[num_chunks, block_nbytes]`` uint8 back: the position and the
    ``[state_nbytes]`` uint8 states."""
    flat = rows.reshape(-1)
    position = int.from_bytes(bytes(flat[:POSITION_BYTES].tolist()), "little")
    return position, flat[POSITION_BYTES:POSITION_BYTES + state_nbytes]
