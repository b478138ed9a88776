"""`CacheStats`: where every block and byte of the pool is, as one frozen value.

Every block is in exactly one state: live (owned), cached (reusable prefix, evictable),
free, or the reserved null block. Live and cached are never folded together: a pool full
of reusable prefixes is not "free", and it is not "used" either.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .allocator import BlockAllocator
from .batch import SeqId
from .page_table import PageTables


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceStats:
    """One sequence's share of the pool.

    ``num_shared_blocks`` counts its blocks with other owners too; ``num_empty_slots`` the
    unfilled slots of its last block; ``is_swapped`` that its blocks sit in the host pool.
    """

    seq_id: SeqId
    num_tokens: int
    num_blocks: int
    num_shared_blocks: int
    num_empty_slots: int
    is_swapped: bool


@dataclasses.dataclass(frozen=True, slots=True)
class CacheStats:
    """Accounting of a `PagedKVCache` at one instant.

    Attributes
    ----------
    num_blocks : int
        Blocks in the pool, the null block included.
    num_live_blocks, num_cached_blocks, num_free_blocks : int
        Blocks with owners / holding an evictable prefix / empty; they sum to
        ``num_blocks - 1``.
    num_shared_blocks : int
        Live blocks with more than one owner.
    total_bytes : int
        The pool's ``nbytes``, and the state slab's (``state_bytes``) when there is one.
    live_bytes, cached_bytes : int
        Bytes of live / cached blocks.
    num_live_tokens : int
        Tokens held in live blocks, each physical slot counted once.
    num_empty_slots : int
        Allocated but unfilled slots of live blocks (internal fragmentation).
    bytes_saved_by_sharing : int
        Bytes that unshared copies of the shared blocks would take: ``sum(refcount - 1)``
        blocks.
    prefix_query_tokens, prefix_hit_tokens : int
        Prompt tokens looked up in the prefix index, and those found cached (cumulative).
    num_swap_outs : int
        Sequences moved to the host pool (cumulative). An engine's preemptions are its own
        count (``Scheduler.num_preemptions``): a recompute preemption is a `free` here.
    num_swapped_blocks : int
        Host-pool blocks holding swapped-out sequences.
    sequences : tuple of SequenceStats
        Per-sequence breakdown, in insertion order.
    blocks_by_kind : tuple of (str, int)
        A hybrid layout's blocks held by sequences' rows, per layer kind (``"full"``,
        ``"sliding:512"``, ...); empty for a uniform one.
    num_given_back, bytes_given_back : int
        Blocks (and their bytes) window and chunked rows gave back to the pool as their
        window moved on (cumulative; 0 for a uniform layout).
    state_bytes : int
        Bytes of the recurrent layers' state slab (0 without recurrent layers).
    num_live_states : int
        Slab slots holding a resident sequence's live state (one per sequence).
    num_checkpoints, checkpoint_bytes : int
        Slab slots holding a prefix checkpoint (a sequence's states at a block boundary),
        and their bytes; evictable, as cached blocks are.
    checkpoints_written, checkpoints_hit, checkpoints_evicted : int
        Checkpoints taken at block boundaries (less those a failed step never wrote),
        copied into an admitted sequence's live state, and evicted for another slot
        (cumulative).
    """

    num_blocks: int
    num_live_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    num_shared_blocks: int
    total_bytes: int
    live_bytes: int
    cached_bytes: int
    num_live_tokens: int
    num_empty_slots: int
    bytes_saved_by_sharing: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_swap_outs: int
    num_swapped_blocks: int
    sequences: tuple[SequenceStats, ...]
    blocks_by_kind: tuple[tuple[str, int], ...] = ()
    num_given_back: int = 0
    bytes_given_back: int = 0
    state_bytes: int = 0
    num_live_states: int = 0
    num_checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoints_written: int = 0
    checkpoints_hit: int = 0
    checkpoints_evicted: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        queries = self.prefix_query_tokens
        return self.prefix_hit_tokens / queries if queries else 0.0

    @property
    def waste_fraction(self) -> float:
        """Empty slots as a fraction of live slots (the paper's internal fragmentation)."""
        live_slots = self.num_live_tokens + self.num_empty_slots
        return self.num_empty_slots / live_slots if live_slots else 0.0

    @property
    def usage(self) -> float:
        """Live blocks over usable blocks; cached blocks do not count as used or as free."""
        return self.num_live_blocks / (self.num_blocks - 1)


def compute_stats(*, allocator: BlockAllocator, tables: PageTables, block_size: int,
                  bytes_per_block: int, total_bytes: int, num_swap_outs: int) -> CacheStats:
    """Assemble `CacheStats` from the owners' read-only views."""
    refcount = allocator.refcount
    rows = tables.rows()
    resident = rows[~tables.swapped[rows]]
    empty = empty_slots_per_block(tables.block_ids[resident], tables.num_blocks[resident],
                                  tables.num_tokens[resident], block_size)
    num_empty_slots = sum(empty.values())
    num_live = allocator.num_live_blocks
    sequences = []
    for seq_id, row in tables.row_of.items():
        blocks = tables.block_ids[row, : tables.num_blocks[row]]
        swapped = bool(tables.swapped[row])
        num_tokens, num_blocks = int(tables.num_tokens[row]), int(blocks.size)
        sequences.append(SequenceStats(
            seq_id=seq_id, num_tokens=num_tokens, num_blocks=num_blocks,
            num_shared_blocks=0 if swapped else int((refcount[blocks] > 1).sum()),
            num_empty_slots=num_blocks * block_size - num_tokens, is_swapped=swapped))
    return CacheStats(
        num_blocks=allocator.num_blocks,
        num_live_blocks=num_live,
        num_cached_blocks=allocator.num_cached_blocks,
        num_free_blocks=allocator.num_free_blocks,
        num_shared_blocks=int((refcount > 1).sum()),
        total_bytes=total_bytes,
        live_bytes=num_live * bytes_per_block,
        cached_bytes=allocator.num_cached_blocks * bytes_per_block,
        num_live_tokens=num_live * block_size - num_empty_slots,
        num_empty_slots=num_empty_slots,
        bytes_saved_by_sharing=int(np.maximum(refcount - 1, 0).sum()) * bytes_per_block,
        prefix_query_tokens=allocator.prefix_query_tokens,
        prefix_hit_tokens=allocator.prefix_hit_tokens,
        num_swap_outs=num_swap_outs,
        num_swapped_blocks=int(tables.num_blocks[rows[tables.swapped[rows]]].sum()),
        sequences=tuple(sequences),
    )


def empty_slots_per_block(block_ids: np.ndarray, num_blocks: np.ndarray, num_tokens: np.ndarray,
                          block_size: int) -> dict[int, int]:
    """Unfilled slots of each sequence's last block, keyed by block (shared ones counted once).

    Parameters
    ----------
    block_ids : np.ndarray
        ``[B, width]`` block table rows of device-resident sequences.
    num_blocks, num_tokens : np.ndarray
        ``[B]`` blocks and tokens of each row.
    """
    has_blocks = num_blocks > 0
    last = block_ids[has_blocks, num_blocks[has_blocks] - 1]
    empty = num_blocks[has_blocks] * block_size - num_tokens[has_blocks]
    return dict(zip(last.tolist(), empty.tolist(), strict=True))
