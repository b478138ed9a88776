"""`LayerGroup`: one group of same-kind layers, its block tables, and what its kind gives
back; the machinery every kind shares (the rules that differ by kind are each kind's class
in `paged_kv.core.groups.kinds`).

Every group's tables hold the same sequences in the same rows (they see the same adds,
forks and removals in the same order), each row the same token count: only the block ids
differ, and a window group's row holds the null block 0 at the columns its window has
left (``released[row]`` of them, all leading).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from ...config import CacheConfig, LayerKind
from ...keys import encode_tokens
from ..allocator import BlockAllocator
from ..batch import SeqId
from ..page_table import PageTables
from ..pool import KVPool
from ..step.commit import StepCommitter
from ..step.plan import StepPlanner
from ..swap import SwapSpace
from .rules import group_key


@dataclasses.dataclass
class LayerGroup:
    """One layer group of a cache (see `paged_kv.config.group_layers`); a uniform model's
    cache is one full-attention group. A subclass per layer kind
    (`paged_kv.core.groups.kinds`) says what its rows give back (`skipped_tokens`) and so
    which blocks a prefix hit needs (`accepted_hit`); the rest is shared.

    Attributes
    ----------
    index : int
        The group's number; group 0 leads (a full-attention group when there is one): only
        it hashes prompts, and every other group indexes its blocks under group 0's keys
        (`group_key`).
    kind : LayerKind
    layers : tuple of int
        The model layers it holds; layer ``layers[j]`` lives in pool plane ``j``.
    tables, planner, committer
        Its block tables and the step machinery over them (only group 0's indexes).
    released : np.ndarray
        ``[rows]`` int64 leading columns of each row given back (always 0 for full).
    """

    index: int
    kind: LayerKind
    layers: tuple[int, ...]
    tables: PageTables
    planner: StepPlanner
    committer: StepCommitter
    released: np.ndarray
    swap: SwapSpace | None = None

    gives_back: ClassVar[bool] = False  # whether rows give blocks back as they grow

    @classmethod
    def build(cls, index: int, kind: LayerKind, layers: tuple[int, ...], config: CacheConfig,
              allocator: BlockAllocator, pool: KVPool, compiled: bool | None,
              host_allocator: BlockAllocator | None) -> LayerGroup:
        """A group over the shared allocator and pool (and host pool, when there is one)."""
        own = (config if index == 0 or not config.enable_prefix_caching  # only group 0 hashes
               else dataclasses.replace(config, enable_prefix_caching=False))
        tables = PageTables(config.block_size, config.max_num_seqs, compiled=compiled)
        swap = None if host_allocator is None else SwapSpace(
            config.num_host_blocks, tables, allocator, pool, host_allocator)
        return cls(index, kind, layers, tables, StepPlanner(tables, allocator, own),
                   StepCommitter(tables, allocator, pool, own),
                   np.zeros(config.max_num_seqs, dtype=np.int64), swap)

    # -- the kind's rules (each kind's class overrides `skipped_tokens`) -------------------
    def skipped_tokens(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        """Leading tokens that no query from position `num_tokens` on reads: their blocks
        go back to the pool, and a prefix hit of `num_tokens` tokens needs the blocks of
        the tokens after them. Full attention reads every token."""
        raise NotImplementedError

    def skipped_blocks(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        """Leading blocks wholly made of `skipped_tokens`: those a row can give back."""
        return self.skipped_tokens(num_tokens) // self.tables.block_size

    def accepted_hit(self, end: int, cached: Callable[[int], bool]) -> int:
        """The longest hit of at most `end` blocks this kind accepts: the blocks a query
        right after it reads (from `skipped_blocks` of the hit on) are all cached. Scanned
        right to left, so a hit far past blocks long evicted is still found (vLLM's rule);
        full attention needs every block from the first.

        Parameters
        ----------
        cached : callable
            ``cached(column)``: whether the block at that column is in the prefix cache.
        """
        block_size = self.tables.block_size
        while end > 0:
            first = self.skipped_blocks(end * block_size)
            missing = next((c for c in range(end - 1, first - 1, -1) if not cached(c)), None)
            if missing is None:
                return end
            end = missing  # every longer hit below `end` needs that block too
        return 0

    # -- the lifecycle every kind shares ---------------------------------------------------
    def fork(self, allocator: BlockAllocator, parent: SeqId, child: SeqId) -> None:
        """`child`'s row shares all of `parent`'s blocks, and what it gave back."""
        row = self.tables.fork(parent, child)
        self.released_of(np.array([row]))
        self.released[row] = self.released[self.tables.row_of[parent]]
        blocks = self.tables.blocks(child)
        allocator.share(blocks[blocks != 0])

    def remove(self, allocator: BlockAllocator, seq_id: SeqId, retain: dict) -> None:
        """Drop `seq_id`'s row: its device blocks freed (or its host blocks, if swapped)."""
        row = self.tables.row_of[seq_id]
        swapped = self.swap is not None and self.swap.is_swapped(seq_id)
        self.released_of(np.array([row]))
        blocks = self.tables.remove(seq_id)
        self.released[row] = 0
        if swapped:
            self.swap.drop(seq_id, blocks)
        else:
            allocator.free(blocks[blocks != 0], unique=True, **retain)

    def can_truncate(self, row: int, num_tokens: int) -> bool:
        """Whether the row still holds every block a query after `num_tokens` reads."""
        return self.released_of(np.array([row]))[0] <= self.skipped_blocks(num_tokens)

    def released_of(self, rows: np.ndarray) -> np.ndarray:
        """``[B]`` leading columns given back by each of `rows` (grown with the tables)."""
        if self.released.shape[0] < self.tables.num_tokens.shape[0]:
            grown = np.zeros(self.tables.num_tokens.shape[0], dtype=np.int64)
            grown[: self.released.shape[0]] = self.released
            self.released = grown
        return self.released[rows]

    def releasable(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The blocks `rows` may give back before their next tokens (none for a full
        group): ``[R]`` rows, and for each the column to give back up to."""
        if not self.gives_back or not rows.size:
            return rows[:0], rows[:0]
        upto = self.skipped_blocks(self.tables.num_tokens[rows])
        moving = upto > self.released_of(rows)
        return rows[moving], upto[moving]

    def blocks_between(self, rows: np.ndarray, upto: np.ndarray) -> np.ndarray:
        """Block ids of each row's columns from its `released` count up to `upto`."""
        parts = [self.tables.block_ids[row, self.released[row]: end]
                 for row, end in zip(rows.tolist(), upto.tolist(), strict=True)]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)

    def release(self, allocator: BlockAllocator, rows: np.ndarray, upto: np.ndarray) -> int:
        """Give back each row's blocks before column `upto` (as `releasable` named them):
        the row points at the null block there, and the blocks are freed — indexed ones
        stay cached (a later prefix hit can still use them), the rest go free. Returns
        how many blocks left the rows."""
        ids = self.blocks_between(rows, upto)
        for row, end in zip(rows.tolist(), upto.tolist(), strict=True):
            start = int(self.released[row])
            columns = np.arange(start, end)
            self.tables.replace_blocks(np.full(columns.size, row), columns,
                                       np.zeros(columns.size, dtype=np.int64))
            self.released[row] = end
        allocator.free(ids)  # two forked rows may give back one block: one owner each
        return int(ids.size)

    def mirror(self, allocator: BlockAllocator,
               filled: list[tuple[int, int, bytes, bytes, bytes]]) -> None:
        """Index this group's blocks at the columns `filled_blocks` found under the keys
        the leading group gave its blocks there (`group_key`): one hash per block of the
        prompt, for every group."""
        for row, column, key, parent, tokens in filled:
            allocator.register(int(self.tables.block_ids[row, column]),
                               group_key(key, self.index), tokens,
                               group_key(parent, self.index))


def filled_blocks(allocator: BlockAllocator, leader: PageTables, rows: np.ndarray,
                  old_lens: np.ndarray, chains: list[bytes | None] | None = None,
                  ) -> list[tuple[int, int, bytes, bytes, bytes]]:
    """The leading group's blocks of `rows` that filled since `old_lens` and are indexed:
    ``(row, column, key, parent key, token bytes)`` each, found once a step for every other
    group to `LayerGroup.mirror`.

    `chains` are the keys each row's first filled block chains from (the rows' chains
    before the step). None reads them off the leader's blocks before, which a full leader
    always holds; a window leader may have given that block back (its column then holds
    the null block), so a window leader's caller passes them.
    """
    block_size, filled = leader.block_size, []
    first, end = old_lens // block_size, leader.num_tokens[rows] // block_size
    for i in np.flatnonzero(end > first).tolist():
        row, start = int(rows[i]), int(first[i])
        if chains is not None:
            parent = chains[i]
        else:
            parent = (allocator.block_hash(int(leader.block_ids[row, start - 1]))
                      if start else leader.root(row))
        for column in range(start, int(end[i])):
            key = allocator.block_hash(int(leader.block_ids[row, column]))
            if key is None:  # not indexed (ids unknown, or caching off)
                break
            tokens = leader.token_ids[row, column * block_size:(column + 1) * block_size]
            filled.append((row, column, key, parent or b"", encode_tokens(tokens)))
            parent = key
    return filled
