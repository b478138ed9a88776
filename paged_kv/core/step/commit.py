"""The commit phase: applying a checked plan to the owners (see `paged_kv.core.step.plan`).

`StepCommitter` is the one place a step or an admission changes the tables, the allocator
and (for copy-on-write copies) the pool; every plan it takes was checked first, so nothing
here can run out of blocks half-way.
"""

from __future__ import annotations

import numpy as np

from ...config import CacheConfig
from ...keys import TOKEN_BYTES
from ..allocator import BlockAllocator
from ..batch import SeqId, StepBatch
from ..page_table import PageTables
from ..pool import KVPool
from .parse import Step
from .plan import Admission, StepPlan
from .prefix import index_filled_blocks, index_full_blocks, index_row_blocks

_NONE = np.empty(0, dtype=np.int64)


class StepCommitter:
    """Applies checked step and admission plans to the owners.

    Parameters
    ----------
    tables : PageTables
    allocator : BlockAllocator
    pool : KVPool
        Only for copy-on-write copies.
    config : CacheConfig
    """

    def __init__(self, tables: PageTables, allocator: BlockAllocator, pool: KVPool,
                 config: CacheConfig) -> None:
        self._tables, self._allocator, self._pool = tables, allocator, pool
        self._block_size = config.block_size
        self._device = config.device
        self._indexing = config.enable_prefix_caching
        self._offsets = np.arange(config.block_size)  # a slot's offset in its block

    # -- admission ------------------------------------------------------------------------
    def add_row(self, plan: Admission) -> int:
        """Commit a new sequence's row with its prefix hits; returns the row. The row keeps
        the prompt's keys, so its blocks are indexed under them as they fill."""
        return self._add_row(plan, 0, plan.num_hit)[0]

    def admit(self, plan: Admission) -> StepBatch:
        """`add_row`, then the commit of the prompt's next `plan.count` tokens: the same
        state changes as `add_row` then `commit` of their step, in scalar arithmetic on the
        plan and with no step objects (for short prompts an admission's fixed cost is most
        of its cost); the blocks that fill are indexed under the keys the plan carries."""
        block_size, allocator = self._block_size, self._allocator
        num_hit, num_hits = plan.num_hit, len(plan.hits)
        end = num_hit + plan.count
        row, ids, new_ids = self._add_row(plan, plan.requested, end)
        # the hits are whole blocks: the prompt's next full blocks are the first new ones
        num_full = end // block_size - num_hits
        if self._indexing and num_full > 0:
            data = plan.data[num_hit * TOKEN_BYTES:
                             (num_hit + num_full * block_size) * TOKEN_BYTES]
            keys = allocator.register_chain(new_ids[:num_full].tolist(), plan.chain, data,
                                            plan.keys[num_hits:],
                                            plan.pieces[:num_full] or None)
            self._tables.set_chain(row, keys[-1])
        return self._admission_batch(plan.seq_id, ids, end, plan.count, new_ids)

    def _add_row(self, plan: Admission, num_new: int, end: int,
                 ) -> tuple[int, np.ndarray, np.ndarray]:
        """The row of `plan` holding its hits, then `num_new` new blocks, up to `end`
        tokens; returns the row, its block ids and the new ones. The hits are shared first:
        no allocation may evict a cached block the row is about to take."""
        tables, allocator = self._tables, self._allocator
        # the keys of blocks the row fills later, when the plan has them all (the request's
        # own): keeping a lazy plan's first miss alone costs more than hashing it again
        num_keys = len(plan.keys)
        keep = num_keys * self._block_size > end and plan.tokens is not None \
            and num_keys == len(plan.tokens) // self._block_size
        ahead = (plan.keys, plan.data) if keep else None
        row = tables.add(plan.seq_id, plan.chain, plan.root if self._indexing else None, ahead)
        if plan.hits:  # a window row's hit starts with null columns (0): nothing to share
            allocator.share(plan.hits if plan.hits[0] else [b for b in plan.hits if b])
        if plan.tokens is not None and plan.root is not None:
            allocator.count_prefix_lookup(len(plan.tokens), plan.num_hit)
        ids = new_ids = allocator.allocate(num_new, plan.root) if num_new else _NONE
        if plan.hits:
            ids = np.array(plan.hits, dtype=np.int64)
            if num_new:
                ids = np.concatenate((ids, new_ids))
        if ids.size:
            tables.extend_row(row, 0, end, ids, plan.tokens[:end])
        return row, ids, new_ids

    def _admission_batch(self, seq_id: SeqId, ids: np.ndarray, end: int, count: int,
                         new_ids: np.ndarray) -> StepBatch:
        return admission_batch(seq_id, ids, end, count, new_ids, self._block_size,
                               self._device)

    # -- a step ---------------------------------------------------------------------------
    def commit(self, plan: StepPlan, filled: list | None = None) -> StepBatch:
        """Apply a checked plan: allocate, copy on write, extend the rows, index the blocks
        that filled with known ids; returns the step's batch.

        With `filled` (a list) a decode step without copies (``plan.new_blocks is None``)
        appends the blocks it indexed to it, as `index_filled_blocks` says, and so does a
        step with a decode head (`StepPlan.head`) for its head's rows; other steps and
        rows are left to `paged_kv.core.groups.groups.filled_blocks`."""
        new_ids = (self._allocator.allocate(plan.requested) if plan.requested else _NONE)
        if plan.new_blocks is None:
            return self._commit_decode(plan.step, new_ids, filled)
        copy_rows, copy_columns, sources = plan.copies
        if len(copy_rows):
            copies, new_ids = new_ids[: len(copy_rows)], new_ids[len(copy_rows):]
            self._pool.copy(sources, copies)
            self._tables.replace_blocks(copy_rows, copy_columns, copies)
            # two rows may copy one shared block: each copy drops one reference
            self._allocator.free(sources, unique=len(sources) == 1)
        if plan.step.rows.size == 1:
            return self._commit_one(plan.step, new_ids)
        if plan.head:
            return self._commit_split(plan, new_ids, filled)
        return self._commit_rows(plan, new_ids)

    def _commit_decode(self, step: Step, new_ids: np.ndarray, out: list | None) -> StepBatch:
        tables, rows = self._tables, step.rows
        known = step.token_ids.size > 0
        slots, num_blocks, seq_lens, max_blocks, max_len, filled, filled_tokens = \
            tables.commit_decode(rows, step.token_ids if known else None, new_ids)
        if not known:
            tables.set_chains(rows.tolist(), [None] * rows.size)  # never indexed
        elif self._indexing and filled.shape[1]:
            index_filled_blocks(self._allocator, tables, filled, filled_tokens, out)
        return StepBatch.from_host(
            step.seq_ids, tables.batch_tables(rows, num_blocks, max_blocks), num_blocks, seq_lens,
            np.arange(rows.size + 1, dtype=np.int32), slots, rows.size, 1, self._block_size,
            self._device, max_seq_len=max_len)

    def _commit_one(self, step: Step, new_ids: np.ndarray) -> StepBatch:
        tables, block_size = self._tables, self._block_size
        # .item(): a Python int in one call (int(array[0]) makes a numpy scalar first)
        row, count = step.rows.item(0), step.counts.item(0)
        old_len = tables.num_tokens.item(row)
        new_len = old_len + count
        known = step.has_ids.item(0)
        tables.extend_row(row, old_len, new_len, new_ids, step.token_ids if known else None)
        if not known:
            tables.set_chain(row, None)
        elif self._indexing:
            index_row_blocks(self._allocator, tables, row, old_len // block_size,
                             new_len // block_size, block_size)
        need = tables.num_blocks.item(row)
        block_table = tables.block_ids[row: row + 1, :need].copy()
        first = old_len % block_size
        slots = (block_table[0, old_len // block_size:, None].astype(np.int64) * block_size
                 + self._offsets).ravel()[first: first + count]
        return StepBatch.from_host(step.seq_ids, block_table, np.array([need]),
                                   np.array([new_len]), np.array([0, count]), slots, count,
                                   count, block_size, self._device, max_seq_len=new_len)

    def _commit_rows(self, plan: StepPlan, new_ids: np.ndarray) -> StepBatch:
        self._extend_rows(plan.step, plan.new_blocks, new_ids)
        return self._rows_batch(plan.step)

    def _rows_batch(self, step: Step) -> StepBatch:
        """The batch of a committed step's rows, read off the tables as it left them."""
        tables, rows = self._tables, step.rows
        num_blocks = tables.num_blocks[rows]
        block_tables = tables.batch_tables(rows, num_blocks, int(num_blocks.max()))
        return StepBatch.from_arrays(step.seq_ids, block_tables, num_blocks,
                                     tables.num_tokens[rows], step.counts, self._block_size,
                                     self._device)

    def _extend_rows(self, step: Step, new_blocks: np.ndarray, new_ids: np.ndarray) -> None:
        """Give each row of `step` its `new_blocks` (from `new_ids`, in row order) and its
        tokens, and index the blocks that filled with known ids."""
        tables, rows = self._tables, step.rows
        old_lens = tables.num_tokens[rows]
        new_lens = old_lens + step.counts
        tables.append_blocks(rows, new_blocks, new_ids)
        tables.set_num_tokens(rows, new_lens)
        if step.token_ids.size:
            tables.set_token_ids(step.token_rows, step.token_positions(old_lens),
                                 step.token_ids)
        for row in step.rows_without_ids:
            tables.set_chain(int(row), None)
        if self._indexing:
            index_full_blocks(self._allocator, tables, rows, old_lens, new_lens,
                              self._block_size)

    def _commit_split(self, plan: StepPlan, new_ids: np.ndarray,
                      filled: list | None) -> StepBatch:
        """A step whose first `plan.head` rows take one token each as a decode step (the
        compiled loop, their filled blocks indexed in one batch and reported in `filled`),
        the rest as `_commit_rows` does; one batch of all, in row order. The new blocks go
        to the rows in row order, as `_commit_rows` gives them (after any copies)."""
        tables, step, head = self._tables, plan.step, plan.head
        rows, opened = step.rows, int(plan.new_blocks[:head].sum())
        *_, found, found_tokens = tables.commit_decode(rows[:head], step.token_ids[:head],
                                                       new_ids[:opened])
        if self._indexing and found.shape[1]:
            index_filled_blocks(self._allocator, tables, found, found_tokens, filled)
        rest = Step(step.seq_ids, rows[head:], step.counts[head:], step.has_ids[head:],
                    step.token_ids[head:])  # (seq_ids unread by `_extend_rows`)
        self._extend_rows(rest, plan.new_blocks[head:], new_ids[opened:])
        return self._rows_batch(step)


def admission_batch(seq_id: SeqId, ids: np.ndarray, end: int, count: int, new_ids: np.ndarray,
                    block_size: int, device) -> StepBatch:
    """An admission's batch: its row holds `ids` (up to `end` tokens); its `count` new
    tokens fill `new_ids` from their start."""
    slots = (new_ids[:, None] * block_size + np.arange(block_size)).ravel()[:count]
    return StepBatch.from_host(
        (seq_id,), ids.astype(np.int32)[None], np.array([ids.size]),
        np.array([end], dtype=np.int32), np.array([0, count], dtype=np.int32), slots,
        count, count, block_size, device, max_seq_len=end)  # int32: shipped as is
