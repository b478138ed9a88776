"""A step in three phases: parse, plan, commit.

Every step entry of `PagedKVCache` (``prepare``, ``admit``, ``prepare_decode``,
``num_blocks_needed``) runs the same way::

    step = parse_step(...)             # _tokens: validate the caller's input, change nothing
    plan = planner.plan(step)          # read the tables and the allocator, change nothing
    planner.check(plan, "prepare()")   # the one "requested > obtainable" test
    batch = planner.commit(plan)       # allocate, copy-on-write, extend rows, index blocks

so validate-then-commit rests on one number, `StepPlan.requested`. The plan and the commit
each take one of three shapes for speed (a decode step of known tokens with no copy in a
few array ops or compiled loops, a single sequence in scalar arithmetic, anything else with
arrays); they agree by construction, and the tests compare them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..allocator import BlockAllocator
from ..config import CacheConfig
from ..errors import OutOfBlocksError
from ..keys import TOKEN_BYTES, encode_tokens, root_hash
from ..page_table import PageTables
from ..pool import KVPool
from .batch import SeqId, StepBatch
from .parse import Step
from .prefix import index_filled_blocks, index_full_blocks, index_row_blocks, lookup_prefix

_NONE = np.empty(0, dtype=np.int64)
_NO_COPIES = (_NONE, _NONE, _NONE)


class StepPlan(NamedTuple):
    """What a step will take, decided before anything changes (a tuple, cheap to build
    on every decode step).

    Attributes
    ----------
    step : Step
        The parsed step.
    requested : int
        Blocks the step takes: new blocks plus copy-on-write copies.
    new_blocks : np.ndarray or None
        ``[B]`` blocks each row opens; None for a decode step without copies (its commit
        opens a block for each row whose last block is full).
    copies : tuple of np.ndarray
        Copy-on-write: ``[C]`` rows, the column of each row's partly filled last block, and
        that block (the copy's source).
    """

    step: Step
    requested: int
    new_blocks: np.ndarray | None
    copies: tuple[np.ndarray, np.ndarray, np.ndarray] = _NO_COPIES

    def per_sequence(self) -> np.ndarray:
        """``[B]`` int64 blocks each sequence takes (a copy counted for the one making it)."""
        return self.new_blocks + np.isin(self.step.rows, self.copies[0])


class StepPlanner:
    """Plans and commits steps over the owners; the one place a step changes them.

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
    def lookup(self, tokens: np.ndarray | None, salt: str | None,
               ) -> tuple[bytes | None, list[int]]:
        """The salted chain after the longest cached prefix of `tokens`, and its blocks."""
        chain = root_hash(salt)  # also the salt's check, with prefix caching off too
        if not self._indexing:
            return None, []
        if tokens is None or not len(tokens):
            return chain, []
        return lookup_prefix(self._allocator, chain, tokens, self._block_size)

    def add_row(self, seq_id: SeqId, tokens: np.ndarray | None, salt: str | None,
                chain: bytes | None, hits: list[int]) -> int:
        """Commit a new sequence's row with its prefix hits (from `lookup`); returns it."""
        row = self._tables.add(seq_id, chain, root_hash(salt) if self._indexing else None)
        num_hit = len(hits) * self._block_size
        if hits:
            self._allocator.share(hits)
            self._tables.extend_row(row, 0, num_hit, np.array(hits), tokens[:num_hit])
        if tokens is not None and chain is not None:
            self._allocator.count_prefix_lookup(len(tokens), num_hit)
        return row

    # -- plan (no visible change) -----------------------------------------------------------
    def plan(self, step: Step, *, fast: bool = True, decode: bool | None = None) -> StepPlan:
        """The plan of a parsed step; ``fast=False`` always gives per-row block counts,
        ``decode=True`` says the step is one token a row (skipping the test)."""
        if fast and (step.is_decode if decode is None else decode):
            requested = self._tables.plan_decode(step.rows, self._allocator.protected)
            if requested >= 0:  # else a last block must be copied: the general plan
                return StepPlan(step, requested, None)
        if step.rows.size == 1:
            return self._plan_one(step)
        return self._plan_rows(step)

    def admit(self, seq_id: SeqId, tokens: np.ndarray, salt: str | None,
              max_tokens: int | None) -> tuple[int, StepBatch]:
        """`PagedKVCache.admit` (arguments validated): lookup, plan, check, add the row,
        commit. The same steps and state changes as `add_row` then `commit` of the
        prompt's step, in scalar arithmetic on what the lookup found and with no step
        objects: for short prompts an admission's fixed cost is most of its cost. The
        prompt is encoded once, and the key the lookup hashed last is not hashed again."""
        block_size, allocator = self._block_size, self._allocator
        chain, hits, keys, data = self._match_prompt(tokens, salt)
        num_hit = len(hits) * block_size
        count = len(tokens) - num_hit
        count = count if max_tokens is None else min(count, max_tokens)
        end = num_hit + count
        need = -(-end // block_size) - len(hits)
        obtainable = allocator.num_obtainable_blocks - (
            allocator.count_cached(hits) if hits else 0)
        if need > obtainable:
            raise OutOfBlocksError(need, obtainable, "admit()")
        row = self._tables.add(seq_id, chain, root_hash(salt) if self._indexing else None)
        if hits:
            allocator.share(hits)
        if chain is not None:
            allocator.count_prefix_lookup(len(tokens), num_hit)
        new_ids = allocator.allocate(need) if need else _NONE
        ids = np.concatenate((np.array(hits, dtype=np.int64), new_ids)) if hits else new_ids
        self._tables.extend_row(row, 0, end, ids, tokens[:end])
        # the hits are whole blocks: the prompt's next full blocks are the first new ones
        num_full = end // block_size - len(hits)
        if self._indexing and num_full > 0:
            keys = allocator.register_chain(
                new_ids[:num_full].tolist(), chain,
                data[num_hit * TOKEN_BYTES: (num_hit + num_full * block_size) * TOKEN_BYTES],
                keys[len(hits):])
            self._tables.set_chain(row, keys[-1])
        return num_hit, self._admission_batch(seq_id, ids, end, count, new_ids)

    def _match_prompt(self, tokens: np.ndarray, salt: str | None,
                      ) -> tuple[bytes | None, list[int], list[bytes], bytes]:
        """`lookup`, plus the keys it hashed and the prompt's encoding (whole)."""
        chain = root_hash(salt)
        data = encode_tokens(tokens)
        num_full = (len(tokens) - 1) // self._block_size
        if not self._indexing:
            return None, [], [], data
        if num_full <= 0:
            return chain, [], [], data
        hits, keys = self._allocator.match(chain, data[: num_full * self._block_size * TOKEN_BYTES],
                                           num_full)
        return (keys[len(hits) - 1] if hits else chain), hits, keys, data

    def _admission_batch(self, seq_id: SeqId, ids: np.ndarray, end: int, count: int,
                         new_ids: np.ndarray) -> StepBatch:
        """An admission's batch: its row holds `ids`; its `count` new tokens fill `new_ids`
        from their start."""
        block_size = self._block_size
        slots = (new_ids[:, None] * block_size + self._offsets).ravel()[:count]
        return StepBatch.from_host(
            (seq_id,), ids.astype(np.int32)[None], np.array([ids.size]),
            np.array([end], dtype=np.int32), np.array([0, count], dtype=np.int32), slots,
            count, count, block_size, self._device, max_seq_len=end)  # int32: shipped as is

    def _plan_one(self, step: Step) -> StepPlan:
        # scalar arithmetic: array bookkeeping costs more than it saves at B = 1
        tables, block_size = self._tables, self._block_size
        row = int(step.rows[0])
        old_len = int(tables.num_tokens[row])
        have = int(tables.num_blocks[row])
        need = -(-(old_len + int(step.counts[0])) // block_size) - have
        if old_len % block_size and self._allocator.protected[tables.block_ids[row, have - 1]]:
            source = tables.block_ids[row, have - 1: have].astype(np.int64)
            copies = (step.rows[:1], np.array([have - 1]), source)
            return StepPlan(step, need + 1, np.array([need]), copies)
        return StepPlan(step, need, np.array([need]))

    def _plan_rows(self, step: Step) -> StepPlan:
        rows, block_size = step.rows, self._block_size
        old_lens = self._tables.num_tokens[rows]
        old_num_blocks = self._tables.num_blocks[rows]
        new_blocks = -(-(old_lens + step.counts) // block_size) - old_num_blocks
        copies = self._plan_copies(rows, old_lens, old_num_blocks)
        return StepPlan(step, int(new_blocks.sum()) + len(copies[0]), new_blocks, copies)

    def _plan_copies(self, rows: np.ndarray, old_lens: np.ndarray,
                     old_num_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows whose partly filled last block must not be written in place (shared, or
        indexed so its cached prefix stays intact), and which block they copy.

        When every owner of a shared block writes in this step, the first keeps the
        original (unless it is indexed).
        """
        partial = (old_lens % self._block_size != 0).nonzero()[0]
        columns = old_num_blocks[partial] - 1
        last = self._tables.block_ids[rows[partial], columns].astype(np.int64)
        must_copy = self._allocator.protected[last]
        if not must_copy.any():
            return _NO_COPIES
        partial, columns, last = (a[must_copy] for a in (partial, columns, last))
        refcount = self._allocator.refcount[last]
        _, first, writers = np.unique(last, return_index=True, return_counts=True)
        keep = first[(writers == refcount[first]) & ~self._allocator.indexed[last[first]]]
        copy = np.setdiff1d(np.arange(partial.size), keep, assume_unique=True)
        return rows[partial[copy]], columns[copy], last[copy]

    def check(self, plan: StepPlan, what: str = "prepare()") -> None:
        """Raise `OutOfBlocksError` unless the blocks `plan` takes are obtainable now."""
        obtainable = self._allocator.num_obtainable_blocks
        if plan.requested > obtainable:
            raise OutOfBlocksError(plan.requested, obtainable, what)

    # -- commit ---------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> StepBatch:
        """Apply a checked plan: allocate, copy on write, extend the rows, index the blocks
        that filled with known ids; returns the step's batch."""
        new_ids = (self._allocator.allocate(plan.requested) if plan.requested else _NONE)
        if plan.new_blocks is None:
            return self._commit_decode(plan.step, new_ids)
        copy_rows, copy_columns, sources = plan.copies
        if len(copy_rows):
            copies, new_ids = new_ids[: len(copy_rows)], new_ids[len(copy_rows):]
            self._pool.copy(sources, copies)
            self._tables.replace_blocks(copy_rows, copy_columns, copies)
            # two rows may copy one shared block: each copy drops one reference
            self._allocator.free(sources, unique=len(sources) == 1)
        if plan.step.rows.size == 1:
            return self._commit_one(plan.step, new_ids)
        return self._commit_rows(plan, new_ids)

    def _commit_decode(self, step: Step, new_ids: np.ndarray) -> StepBatch:
        tables, rows = self._tables, step.rows
        known = step.token_ids.size > 0
        slots, num_blocks, seq_lens, max_blocks, max_len, filled, filled_tokens = \
            tables.commit_decode(rows, step.token_ids if known else None, new_ids)
        if not known:
            tables.set_chains(rows.tolist(), [None] * rows.size)  # never indexed
        elif self._indexing and filled.shape[1]:
            index_filled_blocks(self._allocator, tables, filled, filled_tokens)
        # slicing columns first makes the row gather a contiguous-row take (~1.5x faster)
        return StepBatch.from_host(
            step.seq_ids, tables.block_ids[:, :max_blocks][rows], num_blocks, seq_lens,
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
        tables, step = self._tables, plan.step
        rows = step.rows
        old_lens = tables.num_tokens[rows]
        new_lens = old_lens + step.counts
        tables.append_blocks(rows, plan.new_blocks, new_ids)
        tables.set_num_tokens(rows, new_lens)
        if step.token_ids.size:
            tables.set_token_ids(step.token_rows, step.token_positions(old_lens),
                                 step.token_ids)
        for row in step.rows_without_ids:
            tables.set_chain(int(row), None)
        if self._indexing:
            index_full_blocks(self._allocator, tables, rows, old_lens, new_lens,
                              self._block_size)
        num_blocks = tables.num_blocks[rows]
        block_tables = tables.block_ids[:, : int(num_blocks.max())][rows]
        return StepBatch.from_arrays(step.seq_ids, block_tables, num_blocks, new_lens,
                                     step.counts, self._block_size, self._device)
