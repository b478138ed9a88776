"""`HostTier`: the host pool's block ids, the sequences swapped into it, and the swaps.

The first tier behind the device pool. It owns its own `BlockAllocator` (no prefix index:
a swapped sequence's blocks belong to it alone), the prefix keys its swapped blocks had on
the device (so they are indexed again when they come back), and how many swap-outs it took.
The tensors stay in `KVPool` (``pool.host``), which moves the bytes and logs each move for
tensor-parallel ranks. Further tiers (disk, a shared store) stand behind this one and speak
the same language: block ids in, keys kept, `check` and counters of their own.
"""

from __future__ import annotations

import numpy as np

from .allocator import BlockAllocator
from .errors import InvariantError, OutOfBlocksError
from .keys import encode_tokens
from .page_table import PageTables
from .pool import KVPool
from .step.batch import SeqId


class HostTier:
    """Swaps whole sequences between the device pool and `num_blocks` host blocks.

    Parameters
    ----------
    num_blocks : int
        Usable host blocks (``CacheConfig.num_host_blocks``).
    tables, allocator, pool : PageTables, BlockAllocator, KVPool
        The cache's owners: the rows it re-points, the device ids it frees and takes, the
        tensors it moves.
    """

    def __init__(self, num_blocks: int, tables: PageTables, allocator: BlockAllocator,
                 pool: KVPool) -> None:
        self.allocator = BlockAllocator(num_blocks + 1, enable_prefix_caching=False)
        self._tables, self._device, self._pool = tables, allocator, pool
        self._keys: dict[SeqId, list[bytes | None]] = {}  # device prefix keys of swapped blocks
        self.num_swap_outs = 0

    def is_swapped(self, seq_id: SeqId) -> bool:
        """Whether `seq_id`'s blocks are in the host pool."""
        return seq_id in self._keys

    def swap_out(self, seq_id: SeqId) -> None:
        """Move a resident sequence's blocks here and release its device blocks."""
        block_ids = self._tables.blocks(seq_id)
        if not self.allocator.can_allocate(block_ids.size):
            raise OutOfBlocksError(block_ids.size, self.allocator.num_obtainable_blocks,
                                   "swap_out() host pool")
        host_ids = self.allocator.allocate(block_ids.size)
        self._pool.swap_out(block_ids, host_ids)
        self._keys[seq_id] = [self._device.block_hash(b) for b in block_ids.tolist()]
        self._device.free(block_ids, unique=True)
        self._tables.set_swapped(seq_id, host_ids, True)
        self.num_swap_outs += 1

    def swap_in(self, seq_id: SeqId) -> None:
        """Bring a swapped-out sequence back into fresh device blocks, indexed again under
        the keys they had."""
        host_ids = self._tables.blocks(seq_id)
        if not self._device.can_allocate(host_ids.size):
            raise OutOfBlocksError(host_ids.size, self._device.num_obtainable_blocks,
                                   "swap_in()")
        block_ids = self._device.allocate(host_ids.size)
        self._pool.swap_in(host_ids, block_ids)
        self.allocator.free(host_ids, unique=True)
        self._tables.set_swapped(seq_id, block_ids, False)
        token_ids = self._tables.token_ids[self._tables.row_of[seq_id]]
        size = self._tables.block_size
        parent = b""  # events report the first block's parent as unknown
        for j, key in enumerate(self._keys.pop(seq_id)):
            if key is not None:
                block_tokens = encode_tokens(token_ids[j * size:(j + 1) * size])
                self._device.register(int(block_ids[j]), key, block_tokens, parent)
            parent = key or b""

    def drop(self, seq_id: SeqId, host_ids: np.ndarray) -> None:
        """Forget a swapped sequence that is being freed; its host blocks return here."""
        self.allocator.free(host_ids, unique=True)
        del self._keys[seq_id]

    def check(self) -> None:
        """Raise `InvariantError` if host refcounts or the swapped set disagree with the rows."""
        tables = self._tables
        self.allocator.check_invariants(tables.owners(self.allocator.num_blocks, swapped=True))
        swapped = {s for s in tables.seq_ids if tables.swapped[tables.row_of[s]]}
        if swapped != set(self._keys):
            raise InvariantError("swapped sequences and their saved prefix keys disagree")

    def snapshot(self) -> tuple:
        """Comparable copy of the tier's state (allocator, saved keys, counter)."""
        return (self.allocator.snapshot(), tuple((k, tuple(v)) for k, v in self._keys.items()),
                self.num_swap_outs)
