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
from ...errors import ensure
from ...keys import chain_pieces, encode_tokens
from ..accounting import CacheStats, empty_slots_per_block
from ..allocator import BlockAllocator
from ..batch import SeqId, StepBatch
from ..page_table import PageTables
from ..pool import KVPool
from ..step.commit import StepCommitter, admission_batch
from ..step.parse import Step
from ..step.plan import Admission, StepPlan, StepPlanner
from ..step.prefix import forget_unwritten
from ..swap import SwapSpace
from .rules import group_key, group_suffix

# a leading group's block that filled in a step: (row, column, key, parent key, token bytes)
Filled = tuple[int, int, bytes, bytes, bytes]


@dataclasses.dataclass
class LayerGroup:
    """One layer group of a cache (see `paged_kv.layer_kinds.group_layers`); a uniform model's
    cache is one full-attention group. A subclass per layer kind
    (`paged_kv.core.groups.kinds`) says what its rows give back (`skipped_tokens`) and so
    which blocks a prefix hit needs (`accepted_hit`); the rest is shared.

    `GroupLayout` and the admission (`paged_kv.core.groups.admission`) do a group's part of
    every operation through its methods (`plan_step`, `commit_step`, `add_row`,
    `truncate`, `block_counts`, `check_rows`, ...), whose defaults here are the attention
    kinds' (block tables over the shared pool); a kind that keeps something else (the
    recurrent state group, `paged_kv.core.groups.state_group`) overrides them.

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
    holds_blocks: ClassVar[bool] = True  # whether rows hold blocks of the pool at all

    @classmethod
    def build(cls, index: int, kind: LayerKind, layers: tuple[int, ...], config: CacheConfig,
              allocator: BlockAllocator, pool: KVPool, compiled: bool | None,
              host_allocator: BlockAllocator | None, leader: LayerGroup | None = None,
              ) -> LayerGroup:
        """A group over the shared allocator and pool (and host pool, when there is one);
        `leader` is the leading group (None for it), which an attention group never reads."""
        own = (config if index == 0 or not config.enable_prefix_caching  # only group 0 hashes
               else dataclasses.replace(config, enable_prefix_caching=False))
        tables = PageTables(config.block_size, config.max_num_seqs, compiled=compiled)
        tables.reuse_step_tables(config.reuse_block_tables)
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

    # -- an admission (`paged_kv.core.groups.admission`) ----------------------------------
    def lookup(self, allocator: BlockAllocator, key: bytes, data: bytes) -> int | None:
        """What the group holds cached at the leading group's block `key` (of token bytes
        `data`): its cached block under its `group_key`, or None."""
        return allocator.lookup(group_key(key, self.index), data)

    def hits_at(self, end: int, found: Callable[[int], int | None]) -> list[int]:
        """The group's part of an agreed hit of `end` blocks: its block at every column (0
        where its rows give blocks back), `found(column)` being what `lookup` found."""
        first = self.skipped_blocks(end * self.tables.block_size) if end else 0
        return [0] * first + [found(column) for column in range(first, end)]

    def revived(self, allocator: BlockAllocator, hits: list[int]) -> int:
        """Cached blocks that taking `hits` moves out of the obtainable ones."""
        return allocator.count_cached([block for block in hits if block])

    def share_hits(self, allocator: BlockAllocator, hits: list[int]) -> None:
        """Own `hits` (before any group allocates, so none is evicted meanwhile)."""
        if any(hits):
            allocator.share([block for block in hits if block])

    def check_admission(self, hits: list[int], what: str) -> None:
        """Raise, changing nothing, unless the group can add a row with `hits` now; an
        attention group's blocks are `check_capacity`'s, so nothing here."""

    def add_row(self, allocator: BlockAllocator, plan: Admission, hits: list[int], row: int,
                prepare: bool, filled: list[Filled], device, shared: int = 0,
                ) -> StepBatch | None:
        """Add the admitted sequence's row (at `row`, the leading group's) with `hits`,
        then with `prepare` the blocks of its next ``plan.count`` tokens; their batch
        (`shared`: `HybridAdmission.shared`, for a group that keeps junctions).
        `filled`: the leading group's blocks that filled (attention groups index theirs
        in `mirror`)."""
        ensure(self.tables.add(plan.seq_id) == row, "layer groups' rows diverged")
        count = plan.count if prepare else 0
        end, num_new = plan.num_hit + count, (plan.requested if prepare else 0)
        new = allocator.allocate(num_new, plan.root) if num_new else np.empty(0, dtype=np.int64)
        ids = np.concatenate((np.array(hits, dtype=np.int64), new))
        if ids.size:
            self.tables.extend_row(row, 0, end, ids,
                                   None if plan.tokens is None else plan.tokens[:end])
        self.released_of(np.array([row]))
        self.released[row] = hits.count(0)
        if not prepare:
            return None
        return admission_batch(plan.seq_id, ids, end, count, new, self.tables.block_size,
                               device)

    # -- a step (`GroupLayout.step`) --------------------------------------------------------
    def plan_step(self, step: Step, decode: bool | None) -> StepPlan:
        """The plan of the group's blocks for `step` (changes nothing)."""
        return self.planner.plan(step, decode=decode)

    def commit_step(self, plan: StepPlan, filled: list[Filled]) -> StepBatch:
        """Commit a checked plan into the group's rows; the group's batch. `filled`: the
        leading group's blocks that filled in the step (see `add_row`)."""
        return self.committer.commit(plan)

    def commit_leading(self, plan: StepPlan, report: bool = True,
                       ) -> tuple[StepBatch, list[Filled] | None]:
        """Commit a checked plan as the leading group; its batch, and (with `report`: other
        groups mirror its blocks) the blocks that filled, as `filled_blocks` finds them,
        when its commit found them itself (a decode step without copies indexes them in
        one pass; a step with a decode head, its head's), else None."""
        filled: list[Filled] | None = [] if report else None
        batch = self.committer.commit(plan, filled)
        return batch, (filled if plan.new_blocks is None or plan.head else None)

    def needed_per_row(self, step: Step) -> np.ndarray:
        """``[B]`` blocks each row of `step` takes in the group (before any give-back)."""
        plan = self.planner.plan(step)
        if plan.new_blocks is None:
            # a decode step that copies no block (the compiled count said so): a row opens
            # a block where its last one is full, as the commit will (~30 us less a group
            # at 1,024 rows than the general plan's per-row arrays and copy search)
            tables = self.tables
            return (tables.num_tokens[step.rows] % tables.block_size == 0).astype(np.int64)
        return plan.per_sequence()

    # -- the lifecycle every kind shares ---------------------------------------------------
    def check_fork(self, parent: SeqId, what: str) -> None:
        """Raise, changing nothing, unless `parent` can be forked now (a fork shares
        blocks: nothing to check for an attention group)."""
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
        root = self.tables.root(row)  # the salted root its blocks chain from (removal clears it)
        swapped = self.swap is not None and self.swap.is_swapped(seq_id)
        self.released_of(np.array([row]))
        blocks = self.tables.remove(seq_id)
        self.released[row] = 0
        if swapped:
            self.swap.drop(seq_id, blocks)
        else:
            allocator.free(blocks[blocks != 0], unique=True, root=root, **retain)

    def can_truncate(self, row: int, num_tokens: int) -> bool:
        """Whether the row still holds every block a query after `num_tokens` reads."""
        return self.released_of(np.array([row]))[0] <= self.skipped_blocks(num_tokens)

    def check_truncate(self, allocator: BlockAllocator, seq_id: SeqId, num_tokens: int,
                       unwritten: bool) -> None:
        """Raise ValueError, changing nothing, unless `seq_id` can keep `num_tokens`."""
        if not self.can_truncate(self.tables.row_of[seq_id], num_tokens):
            raise ValueError(f"truncate(): {seq_id!r}'s {self.kind} layers gave back the "
                             f"blocks a query after {num_tokens} tokens reads")

    def truncate(self, allocator: BlockAllocator, seq_id: SeqId, num_tokens: int,
                 unwritten: bool) -> None:
        """Cut a checked row of a group after the leading one to `num_tokens` (`unwritten`:
        its blocks past them leave the prefix index first)."""
        if unwritten:
            forget_unwritten(allocator, self.tables, seq_id, num_tokens, self.tables.block_size)
        allocator.free(self.tables.truncate(seq_id, num_tokens, None), unique=True)

    def check_swap(self, seq_id: SeqId, what: str, out: bool) -> None:
        """Raise, changing nothing, unless `seq_id`'s row can move to the host pool (`out`)
        or back."""

    def swap_row(self, seq_id: SeqId, out: bool) -> None:
        """Move `seq_id`'s row to the host pool (`out`) or back (checked)."""
        (self.swap.swap_out if out else self.swap.swap_in)(seq_id)

    # -- accounting and checking -----------------------------------------------------------
    def block_counts(self, block_size: int) -> tuple[int, int, int] | None:
        """Blocks of swapped rows (host), empty slots in resident rows' last blocks, and
        blocks resident rows hold (less those given back); None for a group holding none."""
        tables = self.tables
        rows = tables.rows()
        out, rows = rows[tables.swapped[rows]], rows[~tables.swapped[rows]]
        swapped = sum(int(np.count_nonzero(tables.block_ids[row, :tables.num_blocks[row]]))
                      for row in out.tolist())
        empty = sum(empty_slots_per_block(tables.block_ids[rows], tables.num_blocks[rows],
                                          tables.num_tokens[rows], block_size).values())
        held = int(tables.num_blocks[rows].sum() - self.released_of(rows).sum())
        return swapped, empty, held

    def stat_fields(self, stats: CacheStats) -> dict:
        """`CacheStats` fields the group sets beyond the blocks (none for attention)."""
        return {}

    def check_rows(self, leader: PageTables, num_blocks: int) -> np.ndarray:
        """Check the group's rows against the leading group's (same sequences, same
        lengths) and its own invariants; returns ``[num_blocks]`` owners of each block."""
        tables = self.tables
        ensure(tables.row_of == leader.row_of, f"group {self.index}'s rows diverged")
        rows = leader.rows()
        ensure(np.array_equal(tables.num_tokens[rows], leader.num_tokens[rows]),
               f"group {self.index}'s token counts diverged")
        tables.check(null_prefix=self.released_of(np.arange(tables.num_tokens.size)))
        return tables.owners(num_blocks)

    def host_owners(self, num_host_blocks: int) -> np.ndarray:
        """``[num_host_blocks]`` owners of each host block among the swapped rows."""
        return self.tables.owners(num_host_blocks, swapped=True)

    def check_host(self, host: np.ndarray) -> None:
        """Check the group's swap space against `host`, every group's host owners."""
        self.swap.check(host.copy())

    def snapshot(self) -> tuple:
        """Comparable copy of the group's rows (for tests of rejected calls)."""
        return self.tables.snapshot(), self.released.tobytes()

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
        if not self.gives_back:  # a full or state group: no gather of no positions
            return rows[:0], rows[:0]
        moving, upto = self.releasable_at(rows)
        return rows[moving], upto

    def releasable_at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`releasable` by position: ``[R]`` indices into `rows` of the rows that give
        blocks back, in order, and for each the column to give back up to."""
        if not self.gives_back or not rows.size:
            return rows[:0], rows[:0]
        upto = self.skipped_blocks(self.tables.num_tokens[rows])
        moving = np.flatnonzero(upto > self.released_of(rows))
        return moving, upto[moving]

    def blocks_between(self, rows: np.ndarray, upto: np.ndarray) -> np.ndarray:
        """Block ids of each row's columns from its `released` count up to `upto`."""
        return self.columns_between(rows, upto)[2]

    def columns_between(self, rows: np.ndarray, upto: np.ndarray,
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's columns from its `released` count up to `upto` (none where `upto` is
        not past it), flattened in row order: ``[N]`` the index into `rows` each belongs
        to, its column, and the block id there (int64).

        A few array operations for any number of rows: a decode step of a window group
        gives back a block for about one row in ``block_size``, ~64 rows at 1,024, and a
        loop over them cost ~4 us a row.
        """
        start = self.released_of(rows)
        counts = np.maximum(np.minimum(upto, self.tables.block_ids.shape[1]) - start, 0)
        if (counts == 1).all():  # a decode step's: one block a row (5 array calls fewer)
            return (np.arange(rows.size), start,
                    self.tables.block_ids[rows, start].astype(np.int64))
        owner = np.repeat(np.arange(rows.size), counts)
        # each entry's rank within its row: its flat index less its row's first
        rank = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
        columns = start[owner] + rank
        return owner, columns, self.tables.block_ids[rows[owner], columns].astype(np.int64)

    def release(self, allocator: BlockAllocator, rows: np.ndarray, upto: np.ndarray,
                columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> int:
        """Give back each row's blocks before column `upto` (as `releasable` named them):
        the row points at the null block there, and the blocks are freed — indexed ones
        stay cached (a later prefix hit can still use them), the rest go free. Returns
        how many blocks left the rows. `columns`: `columns_between` of the same, when the
        caller found it already."""
        owner, columns, ids = self.columns_between(rows, upto) if columns is None else columns
        self.tables.replace_blocks(rows[owner], columns, np.zeros(ids.size, dtype=np.int64))
        self.released[rows] = upto
        allocator.free(ids)  # two forked rows may give back one block: one owner each
        return int(ids.size)

    def mirror(self, allocator: BlockAllocator, filled: list[Filled]) -> None:
        """Index this group's blocks at the columns `filled_blocks` found under the keys
        the leading group gave its blocks there (`group_key`): one hash per block of the
        prompt, for every group. One bulk register (`BlockAllocator.register_keyed`)."""
        if not filled:
            return
        rows, columns, keys, parents, pieces = zip(*filled, strict=True)
        suffix, count = group_suffix(self.index), len(rows)
        # typed arrays from the tuples: indexing by lists has numpy discover each int's
        # type first (~25 k instructions more for a step's ~64 blocks at 1,024 rows)
        rows, columns = np.fromiter(rows, np.intp, count), np.fromiter(columns, np.intp, count)
        allocator.register_keyed(self.tables.block_ids[rows, columns].tolist(),
                                 [key + suffix for key in keys], list(pieces),
                                 [parent + suffix for parent in parents])


def filled_blocks(allocator: BlockAllocator, leader: PageTables, rows: np.ndarray,
                  old_lens: np.ndarray, chains: list[bytes | None] | None = None,
                  ) -> list[Filled]:
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
            block = int(leader.block_ids[row, column])
            key = allocator.block_hash(block)
            piece = encode_tokens(leader.token_ids[row, column * block_size:
                                                   (column + 1) * block_size])
            if key is None:
                # given back, never indexed, or filled with unknown ids (the step left
                # the row without a chain)
                if not block or parent is None or leader.chains([row])[0] is None:
                    break
                # another row's block may be indexed under its key: this row recomputed
                # it (another group's rule cut its hit short), and it fills all the same;
                # otherwise it was never indexed (its ids unknown)
                key = chain_pieces(parent, [piece])[0]
                if not allocator.is_indexed(key):
                    break
            filled.append((row, column, key, parent or b"", piece))
            parent = key
    return filled
