"""The cache's side of the tiers: which blocks a step stored, and blocks loaded back.

Functions over the cache's owners (allocator, pool): the tiers' manager reads which blocks
a step stored (`stored_blocks`, read only) and copies their bytes out after the step that
wrote them; fetched blocks come back through `PagedKVCache.load_cached` (`load_blocks`),
into fresh device blocks, indexed and cached, where the next admission finds them as any
prefix hit. (A recurrent state group's checkpoints travel beside them as block-sized values
under chunk keys, `paged_kv.core.groups.state_values`: the cache splits a fetched run into
the blocks and the checkpoints.) Nothing here knows a store, a file or a socket.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..keys import BlockEvent, encode_tokens, split_blocks
from .allocator import BlockAllocator
from .pool import KVPool


def stored_blocks(allocator: BlockAllocator, events: Iterable[BlockEvent],
                  ) -> tuple[np.ndarray, list[bytes]]:
    """The blocks `events` stored that are still indexed now, with their keys.

    Returns
    -------
    block_ids : np.ndarray
        ``[n]`` int64, each block once, in the order they were stored.
    keys : list of bytes
        Each block's chained key (as indexed now: a block stored, evicted and stored again
        under another key in the same events is read with its present key).
    """
    ids = dict.fromkeys(b for event in events if event.kind == "stored"
                        for b in event.block_ids)
    indexed = [(b, allocator.block_hash(b)) for b in ids]
    indexed = [(b, key) for b, key in indexed if key is not None]
    return (np.array([b for b, _ in indexed], dtype=np.int64), [key for _, key in indexed])


def load_blocks(allocator: BlockAllocator, pool: KVPool, keys: list[bytes],
                token_ids: np.ndarray, payload: torch.Tensor, parent_key: bytes) -> int:
    """Put fetched blocks into the device pool as cached blocks under their keys
    (`PagedKVCache.load_cached`).

    Parameters
    ----------
    allocator, pool : BlockAllocator, KVPool
        The cache's owners.
    keys : list of bytes
        The blocks' chained keys, a prompt's consecutive full blocks in order.
    token_ids : np.ndarray
        ``[len(keys) * block_size]`` the blocks' token ids.
    payload : torch.Tensor
        ``[len(keys), pool.block_nbytes]`` uint8, the blocks as `KVPool.read_blocks` gave them.
    parent_key : bytes
        The key the first block chains from (the device's last block of the prompt, or the
        root): its `stored` event names it as the parent, as for a block computed here.

    Returns
    -------
    int
        Blocks loaded (0 when the pool cannot spare them; nothing changed then). A key the
        device has indexed meanwhile keeps its block; the copy is freed.
    """
    n = len(keys)
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
            or tuple(payload.shape) != (n, pool.block_nbytes) or len(token_ids) % max(n, 1):
        raise ValueError(f"load_cached(): expected {n} keys, uint8 payload [{n}, "
                         f"{pool.block_nbytes}] and their blocks' token ids, got payload "
                         f"{getattr(payload, 'dtype', type(payload).__name__)} "
                         f"{tuple(getattr(payload, 'shape', ()))}, {len(token_ids)} tokens")
    if n == 0 or not allocator.enable_prefix_caching or not allocator.can_allocate(n):
        return 0
    block_ids = allocator.allocate(n)
    pool.write_blocks(block_ids, payload)
    pieces = split_blocks(encode_tokens(token_ids), n)
    parents = [parent_key, *keys[:-1]]
    for block_id, key, piece, parent in zip(block_ids.tolist(), keys, pieces, parents,
                                            strict=True):
        allocator.register(block_id, key, piece, parent)
    allocator.free(block_ids, unique=True)  # cached, the tail evicted first
    return n

