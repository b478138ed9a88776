"""`GroupLayout`: the lifecycle of a cache over several layer groups, or over one group that
gives blocks back (a model whose every layer has a window).

Layers are grouped by kind into groups of one size (`paged_kv.config.group_layers`); a
block spans one group's layers, so one pool and one allocator serve every group, each
group with its own block tables. A group whose kind gives blocks back (a window or a chunk)
does so before each step, by `LayerGroup.skipped_blocks` of the tokens its row holds, so a
sequence holds about ``cdiv(W, block_size) + 1`` blocks per window group however long it
grows. A block given back stays indexed when it was (cached, evictable, reusable by a
later prefix hit), and a prefix hit is the longest every group accepts
(`paged_kv.core.groups.admission`).

`PagedKVCache` holds one when its layout needs it and otherwise runs its single
full-attention group's fast path itself; it validates every call before it gets here, and
the capacity check is the step's own (`paged_kv.core.step.plan.check_capacity`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...config import CacheConfig
from ...errors import OutOfBlocksError, ensure
from ..accounting import CacheStats, empty_slots_per_block
from ..allocator import BlockAllocator
from ..batch import SeqId, StepBatch
from ..step.parse import Step
from ..step.plan import StepPlan, check_capacity
from ..step.prefix import forget_unwritten
from .admission import HybridAdmission, commit_groups
from .groups import LayerGroup, filled_blocks


class GroupLayout:
    """Steps, swaps, accounting and checks over every layer group of a cache (see the
    module docstring); the groups and the allocator are the cache's."""

    def __init__(self, groups: tuple[LayerGroup, ...], allocator: BlockAllocator,
                 config: CacheConfig) -> None:
        ensure(len(groups) < 256, "more than 255 layer groups")
        self.groups, self.allocator, self.config = groups, allocator, config
        self.leader = groups[0]
        self.given_back = 0  # blocks rows gave back, since the start

    # -- admission ------------------------------------------------------------------------
    def commit_admission(self, plan: HybridAdmission, prepare: bool) -> StepBatch | None:
        """Commit a checked admission over every group (with `prepare`, its step batch,
        one batch per group in ``groups``)."""
        batches = commit_groups(list(self.groups), self.allocator, plan, prepare,
                                self.config.device)
        return dataclasses.replace(batches[0], groups=batches) if prepare else None

    # -- a step ---------------------------------------------------------------------------
    def step(self, step: Step, what: str, decode: bool | None) -> StepBatch:
        """Plan a step in every group, check it (less what the step gives back first),
        give back, commit, and index other groups' filled blocks under the leader's keys."""
        rows, allocator, tables = step.rows, self.allocator, self.leader.tables
        plans = [group.planner.plan(step, decode=decode) for group in self.groups]
        releases = [group.releasable(rows) for group in self.groups]
        credit = sum(int(self.freed(group, *release).sum())
                     for group, release in zip(self.groups, releases, strict=True))
        check_capacity(allocator, StepPlan(step, sum(plan.requested for plan in plans), None),
                       what, credit=credit)
        old_lens = tables.num_tokens[rows].copy()
        mirrored = self.config.enable_prefix_caching and len(self.groups) > 1
        # a window leader gives back the blocks a filling one chains from: keep their keys
        chains = (tables.chains(rows.tolist())
                  if mirrored and self.leader.gives_back else None)
        for group, (moving, upto) in zip(self.groups, releases, strict=True):
            if moving.size:
                self.given_back += group.release(allocator, moving, upto)
        batches = tuple(group.committer.commit(plan) for group, plan in zip(
            self.groups, plans, strict=True))
        if mirrored:
            filled = filled_blocks(allocator, tables, rows, old_lens, chains)
            for group in self.groups[1:]:
                group.mirror(allocator, filled)
        return dataclasses.replace(batches[0], groups=batches)

    def freed(self, group: LayerGroup, rows: np.ndarray, upto: np.ndarray) -> np.ndarray:
        """``[len(rows)]`` blocks each row's give-back makes obtainable: those every owner
        gives back in this step (forks decoding together give back shared blocks at once),
        each credited to the first row giving it back."""
        parts = [group.blocks_between(rows[i:i + 1], upto[i:i + 1]) for i in range(rows.size)]
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        owner = np.repeat(np.arange(rows.size), [part.size for part in parts])
        unique, first, counts = np.unique(ids, return_index=True, return_counts=True)
        gone = counts == self.allocator.refcount[unique]
        return np.bincount(owner[first[gone]], minlength=rows.size).astype(np.int64)

    def num_blocks_needed(self, step: Step) -> np.ndarray:
        """``[B]`` blocks each row of `step` takes in every group, less what its
        give-back returns first."""
        need = sum(group.planner.plan(step, fast=False).per_sequence()
                   for group in self.groups)
        position = None
        for group in self.groups:
            moving, upto = group.releasable(step.rows)
            if moving.size:
                position = position or {row: i for i, row in enumerate(step.rows.tolist())}
                np.subtract.at(need, [position[row] for row in moving.tolist()],
                               self.freed(group, moving, upto))
        return need

    # -- sequence lifecycle ---------------------------------------------------------------
    def truncate_others(self, seq_id: SeqId, num_tokens: int, unwritten: bool) -> None:
        """Check every group still holds what a query after `num_tokens` reads, then cut
        the rows of the groups after the leader (the leader's row is the cache's)."""
        row = self.leader.tables.row_of[seq_id]
        for group in self.groups:
            if not group.can_truncate(row, num_tokens):
                raise ValueError(f"truncate(): {seq_id!r}'s {group.kind} layers gave back "
                                 f"the blocks a query after {num_tokens} tokens reads")
        for group in self.groups[1:]:
            if unwritten:
                forget_unwritten(self.allocator, group.tables, seq_id, num_tokens,
                                 self.config.block_size)
            self.allocator.free(group.tables.truncate(seq_id, num_tokens, None), unique=True)

    def swap(self, seq_id: SeqId, what: str, *, out: bool) -> None:
        """Move every group's blocks of `seq_id` to the host pool or back (all or nothing;
        the caller checked the sequence and the host pool)."""
        swap = self.leader.swap
        rows = np.array([self.leader.tables.row_of[seq_id]])
        # what no later query reads leaves before the swap-out, as it would before the
        # next step: a prefill's blocks are not carried to the host and back (nor counted
        # against the request limit the swap-in is sized by)
        releases = [group.releasable(rows) if out else (rows[:0], rows[:0])
                    for group in self.groups]
        blocks = sum(int(np.count_nonzero(group.tables.blocks(seq_id)))
                     - int(np.count_nonzero(group.blocks_between(*release)))
                     for group, release in zip(self.groups, releases, strict=True))
        pool = swap.allocator if out else self.allocator
        if not pool.can_allocate(blocks):
            raise OutOfBlocksError(blocks, pool.num_obtainable_blocks, f"{what} host pool"
                                   if out else what)
        for group, (moving, upto) in zip(self.groups, releases, strict=True):
            if moving.size:
                self.given_back += group.release(self.allocator, moving, upto)
            (group.swap.swap_out if out else group.swap.swap_in)(seq_id)

    # -- accounting and checking ----------------------------------------------------------
    def stats(self, base: CacheStats) -> CacheStats:
        """`base` (the leading group's stats) with live blocks by layer kind and the blocks
        rows gave back; empty slots are counted in every group's resident rows, and a
        swapped sequence's host blocks in every group (not the leading group's alone)."""
        block_size = self.config.block_size
        empty, by_kind, swapped = 0, {}, 0
        for group in self.groups:
            tables = group.tables
            rows = tables.rows()
            out, rows = rows[tables.swapped[rows]], rows[~tables.swapped[rows]]
            swapped += sum(int(np.count_nonzero(tables.block_ids[row, :tables.num_blocks[row]]))
                           for row in out.tolist())
            empty += sum(empty_slots_per_block(tables.block_ids[rows], tables.num_blocks[rows],
                                               tables.num_tokens[rows], block_size).values())
            held = int(tables.num_blocks[rows].sum() - group.released_of(rows).sum())
            by_kind[str(group.kind)] = by_kind.get(str(group.kind), 0) + held
        return dataclasses.replace(
            base, num_empty_slots=empty, num_live_tokens=base.num_live_blocks * block_size
            - empty, num_swapped_blocks=swapped, blocks_by_kind=tuple(by_kind.items()),
            num_given_back=self.given_back,
            bytes_given_back=self.given_back * self.config.bytes_per_block)

    def check(self) -> None:
        """Every group's rows (nulls only where its kind gave blocks back), the same
        sequences and lengths in every group, and the refcounts against the owners summed
        over groups."""
        leader, owners = self.leader.tables, np.zeros(self.config.num_blocks, dtype=np.int64)
        for group in self.groups:
            tables = group.tables
            ensure(tables.row_of == leader.row_of, f"group {group.index}'s rows diverged")
            rows = leader.rows()
            ensure(np.array_equal(tables.num_tokens[rows], leader.num_tokens[rows]),
                   f"group {group.index}'s token counts diverged")
            tables.check(null_prefix=group.released_of(np.arange(tables.num_tokens.size)))
            owners += tables.owners(self.config.num_blocks)
        owners[0] = 0
        self.allocator.check_invariants(owners)
        if self.leader.swap is not None:
            host = sum(group.tables.owners(self.config.num_host_blocks + 1, swapped=True)
                       for group in self.groups)
            for group in self.groups:
                group.swap.check(host.copy())
