"""`SwapSpace`: the swap area: the host pool's block ids, the sequences swapped into it,
and the swaps.

Preempted sequences that are still live wait here, whole, never evicted. It owns its own
`BlockAllocator` (no prefix index: a swapped sequence's blocks belong to it alone), the
prefix keys its swapped blocks had on the device (so they are indexed again when they come
back), and how many swap-outs it took. The tensors stay in `KVPool` (``pool.host``), which
moves the bytes and logs each move for tensor-parallel ranks.

Not to be confused with the host-RAM *cache tier* (`paged_kv.tiers.memory.HostStore`),
which keeps copies of indexed prefix blocks for later prompts and may drop them at will.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvariantError, OutOfBlocksError
from ..keys import encode_tokens
from .allocator import BlockAllocator
from .batch import SeqId
from .page_table import PageTables
from .pool import KVPool


class SwapSpace:
    """Swaps whole sequences between the device pool and `num_blocks` host blocks.

    Parameters
    ----------
    num_blocks : int
        Usable host blocks (``CacheConfig.num_host_blocks``).
    tables, allocator, pool : PageTables, BlockAllocator, KVPool
        The cache's owners: the rows it re-points, the device ids it frees and takes, the
        tensors it moves.
    host_allocator : BlockAllocator, optional
        The host pool's ids, when several swap spaces share the host pool (a hybrid
        layout's layer groups); default its own.

    A row's null entries (the columns a window row gave back) stay null both ways.
    """

    def __init__(self, num_blocks: int, tables: PageTables, allocator: BlockAllocator,
                 pool: KVPool, host_allocator: BlockAllocator | None = None) -> None:
        self.allocator = host_allocator or BlockAllocator(num_blocks + 1,
                                                          enable_prefix_caching=False)
        self._tables, self._device_allocator, self._pool = tables, allocator, pool
        self._keys: dict[SeqId, list[bytes | None]] = {}  # device prefix keys of swapped blocks
        self.num_swap_outs = 0

    def is_swapped(self, seq_id: SeqId) -> bool:
        """Whether `seq_id`'s blocks are in the host pool."""
        return seq_id in self._keys

    def swap_out(self, seq_id: SeqId) -> None:
        """Move a resident sequence's blocks here and release its device blocks."""
        block_ids = self._tables.blocks(seq_id)
        keys = [self._device_allocator.block_hash(b) for b in block_ids.tolist()]
        self._move(seq_id, block_ids, self.allocator, self._device_allocator,
                   "swap_out() host pool")
        self._keys[seq_id] = keys
        self.num_swap_outs += 1

    def swap_in(self, seq_id: SeqId) -> None:
        """Bring a swapped-out sequence back into fresh device blocks, indexed again under
        the keys they had."""
        block_ids = self._move(seq_id, self._tables.blocks(seq_id), self._device_allocator,
                               self.allocator, "swap_in()")
        row = self._tables.row_of[seq_id]
        token_ids, size = self._tables.token_ids[row], self._tables.block_size
        # the first block chains from the row's salted root, as at its admission: a tenant
        # policy reads the tenant from it
        parent = self._tables.root(row) or b""
        for j, key in enumerate(self._keys.pop(seq_id)):
            if key is not None:
                block_tokens = encode_tokens(token_ids[j * size:(j + 1) * size])
                self._device_allocator.register(int(block_ids[j]), key, block_tokens, parent)
            parent = key or b""

    def _move(self, seq_id: SeqId, src_ids: np.ndarray, dst: BlockAllocator,
              src: BlockAllocator, what: str) -> np.ndarray:
        """Copy a sequence's blocks `src_ids` (of `src`) into fresh blocks of `dst`, free
        the old ones and re-point its row; returns the new ids. The one swap, both ways:
        which pool is the host's follows from `dst`."""
        real = src_ids != 0  # given-back columns of a window row: nothing to move
        count = int(real.sum())
        if not dst.can_allocate(count):
            raise OutOfBlocksError(count, dst.num_obtainable_blocks, what)
        dst_ids = np.zeros_like(src_ids)
        dst_ids[real] = dst.allocate(count)
        to_host = dst is self.allocator
        (self._pool.swap_out if to_host else self._pool.swap_in)(src_ids[real], dst_ids[real])
        src.free(src_ids[real], unique=True)
        self._tables.set_swapped(seq_id, dst_ids, to_host)
        return dst_ids

    def drop(self, seq_id: SeqId, host_ids: np.ndarray) -> None:
        """Forget a swapped sequence that is being freed; its host blocks return here."""
        self.allocator.free(host_ids[host_ids != 0], unique=True)
        del self._keys[seq_id]

    def check(self, owners: np.ndarray | None = None) -> None:
        """Raise `InvariantError` if host refcounts or the swapped set disagree with the rows
        (`owners`: the host blocks' owners over every space sharing the host pool; default
        this space's rows')."""
        tables = self._tables
        if owners is None:
            owners = tables.owners(self.allocator.num_blocks, swapped=True)
        owners[0] = 0  # a window row's null entries
        self.allocator.check_invariants(owners)
        swapped = {s for s in tables.seq_ids if tables.swapped[tables.row_of[s]]}
        if swapped != set(self._keys):
            raise InvariantError("swapped sequences and their saved prefix keys disagree")

    def snapshot(self) -> tuple:
        """Comparable copy of the tier's state (allocator, saved keys, counter)."""
        return (self.allocator.snapshot(), tuple((k, tuple(v)) for k, v in self._keys.items()),
                self.num_swap_outs)
