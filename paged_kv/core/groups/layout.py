"""`GroupLayout`: the lifecycle of a cache over several layer groups, or over one group that
gives blocks back (a model whose every layer has a window).

Layers are grouped by kind into groups of one size (`paged_kv.layer_kinds.group_layers`); a
block spans one group's layers, so one pool and one allocator serve every group, each
group with its own block tables. A group whose kind gives blocks back (a window or a chunk)
does so before each step, by `LayerGroup.skipped_blocks` of the tokens its row holds, so a
sequence holds about ``cdiv(W, block_size) + 1`` blocks per window group however long it
grows. A block given back stays indexed when it was (cached, evictable, reusable by a
later prefix hit), and a prefix hit is the longest every group accepts
(`paged_kv.core.groups.admission`).

`PagedKVCache` holds one when its layout needs it and otherwise runs its single
full-attention group's fast path itself; it validates every call before it gets here, and
the capacity check is the step's own (`paged_kv.core.step.plan.check_capacity`). Each
group does its part through its own methods (`LayerGroup.plan_step`, `commit_step`,
`check_rows`, ...), so a kind that holds no blocks (the recurrent state group) plugs in
without a test of its kind here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from ...config import CacheConfig
from ...errors import OutOfBlocksError, ensure
from ..accounting import CacheStats
from ..allocator import BlockAllocator
from ..batch import SeqId, StepBatch
from ..step.parse import Step
from ..step.plan import StepPlan, check_capacity
from .admission import HybridAdmission, commit_groups
from .groups import LayerGroup, filled_blocks


class DecodeForecast(NamedTuple):
    """A decode step's plans and give-backs as `GroupLayout.forecast` worked them out for
    its block count; the step reuses them when nothing changed in between (a scheduler
    counts a step's blocks, then prepares the same rows: planned once, not twice).

    Attributes
    ----------
    plans : list of StepPlan or None
        Each group's plan of the rows, one unknown token each (a decode plan does not read
        the tokens); None for a group holding no blocks, which plans at the step.
    releases, columns : list
        `GroupLayout._releases`' give-backs of the rows, and their columns.
    credit : int or None
        Blocks the give-backs make obtainable; None when not counted yet (`GroupLayout.step`
        counts it only for a step that does not fit without it).
    """

    plans: list[StepPlan | None]
    releases: list
    columns: list
    credit: int | None

    @property
    def needed(self) -> int:
        """Blocks the step takes less what its give-backs return first."""
        return sum(plan.requested for plan in self.plans if plan is not None) - self.credit


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
    def commit_admission(self, plan: HybridAdmission, prepare: bool,
                         what: str = "admit()") -> StepBatch | None:
        """Commit an admission whose blocks were checked, once every group says it can
        take it (with `prepare`, its step batch, one batch per group in ``groups``)."""
        for group, hits in zip(self.groups[1:], plan.group_hits, strict=True):
            group.check_admission(hits, what)
        batches = commit_groups(list(self.groups), self.allocator, plan, prepare,
                                self.config.device)
        return dataclasses.replace(batches[0], groups=batches) if prepare else None

    # -- a step ---------------------------------------------------------------------------
    def step(self, step: Step, what: str, decode: bool | None,
             forecast: DecodeForecast | None = None) -> StepBatch:
        """Plan a step in every group, check it (less what the step gives back first),
        give back, commit, and index other groups' filled blocks under the leader's keys
        (the blocks that filled are found once the leader committed, and every other
        group's commit is handed them). `forecast`: `forecast` of the same rows, made
        since the last change of the cache (the caller vouches for it), in place of the
        plans and give-backs."""
        rows, allocator, tables = step.rows, self.allocator, self.leader.tables
        # a forecast made now is of this step; a kept one is of the step `num_blocks_needed`
        # parsed, whose plans take this one (it carries the ids)
        fresh = forecast is None
        if fresh:
            forecast = self.forecast(step, decode, False)  # no credit counted yet
        plans = [group.plan_step(step, decode) if plan is None
                 else plan if fresh else plan._replace(step=step)
                 for group, plan in zip(self.groups, forecast.plans, strict=True)]
        releases, columns, credit = forecast[1:]
        self._check(StepPlan(step, sum(plan.requested for plan in plans), None), what,
                    credit, columns)
        mirrored = self.config.enable_prefix_caching and len(self.groups) > 1
        # a decode step's leading commit reports the blocks that filled (one pass, no
        # per-row read of the chains), and so does a step's decode head; any other rows'
        # are found after it, from the lengths and the rows' chains before it: a window
        # leader gives back the blocks a filling one chains from, and a block it fills
        # chains from the last key even where that block was not indexed (recomputed
        # while another row's is)
        found = mirrored and plans[0].new_blocks is not None
        rest = rows[plans[0].head:] if found else None
        old_lens = tables.num_tokens[rest] if found else None  # a gather: a copy already
        chains = tables.chains(rest.tolist()) if found else None
        for group, (moving, upto), between in zip(self.groups, releases, columns,
                                                  strict=True):
            if between:
                self.given_back += group.release(allocator, moving, upto, between)
        first, filled = self.leader.commit_leading(plans[0], mirrored)
        if not mirrored:
            filled = []
        elif found:  # the head's, then the rest's: in row order
            filled = (filled or []) + filled_blocks(allocator, tables, rest, old_lens, chains)
        batches = (first, *(group.commit_step(plan, filled) for group, plan in zip(
            self.groups[1:], plans[1:], strict=True)))
        for group in self.groups[1:]:
            group.mirror(allocator, filled)
        return dataclasses.replace(first, groups=batches)

    def forecast(self, step: Step, decode: bool | None = True, credit: bool = True,
                 ) -> DecodeForecast:
        """The plans of `step` in the groups holding blocks and its give-backs, which
        `step` would work out first (changes nothing). ``credit=False`` leaves the credit
        None (`step` counts it only when the step does not fit without it)."""
        plans = [group.plan_step(step, decode) if group.holds_blocks else None
                 for group in self.groups]
        return DecodeForecast(plans, *self._releases(step.rows, credit))

    def _releases(self, rows: np.ndarray, credit: bool = True) -> tuple[list, list, int | None]:
        """What each group gives back before a step of `rows`: `LayerGroup.releasable`,
        its `columns_between` (None where nothing moves; found once for the credit and
        the release), and (with `credit`, else None) the blocks that become obtainable."""
        releases = [group.releasable(rows) for group in self.groups]
        columns = [group.columns_between(*release) if release[0].size else None
                   for group, release in zip(self.groups, releases, strict=True)]
        return releases, columns, self._credit(columns) if credit else None

    def _credit(self, columns: list) -> int:
        """Blocks the give-backs of `columns` (`_releases`') make obtainable: those every
        owner gives back."""
        return sum(len(self._gone(found[2])) for found in columns if found)

    def _check(self, plan: StepPlan, what: str, credit: int | None, columns: list) -> None:
        """`check_capacity` of a step's `plan` with the credit of its give-backs; a credit
        of None is counted only when the plan does not fit without it (it never lowers
        what is obtainable: a step that fits without it fits with it). Counting it takes
        a sort of the blocks given back (`_gone`), ~0.1 M instructions a decode step at
        1,024 rows with a window group, whose rows share the prompt blocks they give back."""
        if credit is None:
            try:
                check_capacity(self.allocator, plan, what)
                return
            except OutOfBlocksError:
                credit = self._credit(columns)
        check_capacity(self.allocator, plan, what, credit=credit)

    def freed(self, group: LayerGroup, rows: np.ndarray, upto: np.ndarray) -> np.ndarray:
        """``[len(rows)]`` blocks each row's give-back makes obtainable: those every owner
        gives back in this step (forks decoding together give back shared blocks at once),
        each credited to the first row giving it back."""
        if not rows.size:  # a full or state group, or no window moved on: nothing to count
            return np.zeros(0, dtype=np.int64)
        owner, _, ids = group.columns_between(rows, upto)
        return np.bincount(owner[self._gone(ids)], minlength=rows.size).astype(np.int64)

    def _gone(self, ids: np.ndarray) -> np.ndarray:
        """Indices into `ids` (blocks rows give back, a block once per row giving it
        back) of the first entry of each block every owner gives back."""
        if (self.allocator.refcount[ids] == 1).all():  # one owner each: all go, no sort
            return np.arange(ids.size)
        unique, first, counts = np.unique(ids, return_index=True, return_counts=True)
        return first[counts == self.allocator.refcount[unique]]

    def num_blocks_needed(self, step: Step) -> np.ndarray:
        """``[B]`` blocks each row of `step` takes in every group, less what its
        give-back returns first."""
        need = sum(group.needed_per_row(step) for group in self.groups)
        for group in self.groups:
            # by position in the step (its rows are distinct), not through a dict of every
            # row (~60 us at 1,024)
            position, upto = group.releasable_at(step.rows)
            if position.size:
                need[position] -= self.freed(group, step.rows[position], upto)
        return need

    # -- sequence lifecycle ---------------------------------------------------------------
    def truncate_others(self, seq_id: SeqId, num_tokens: int, unwritten: bool) -> None:
        """Check every group still holds what a query after `num_tokens` reads, then cut
        the rows of the groups after the leader (the leader's row is the cache's)."""
        for group in self.groups:
            group.check_truncate(self.allocator, seq_id, num_tokens, unwritten)
        for group in self.groups[1:]:
            group.truncate(self.allocator, seq_id, num_tokens, unwritten)

    def swap(self, seq_id: SeqId, what: str, *, out: bool) -> None:
        """Move every group's blocks of `seq_id` to the host pool or back (all or nothing;
        the caller checked the sequence and the host pool)."""
        for group in self.groups:
            group.check_swap(seq_id, what, out)
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
            group.swap_row(seq_id, out)

    # -- accounting and checking ----------------------------------------------------------
    def stats(self, base: CacheStats) -> CacheStats:
        """`base` (the leading group's stats) with live blocks by layer kind and the blocks
        rows gave back; empty slots are counted in every group's resident rows, and a
        swapped sequence's host blocks in every group (not the leading group's alone); and
        what a group that holds no blocks adds (`LayerGroup.stat_fields`: the state slab)."""
        block_size = self.config.block_size
        empty, by_kind, swapped, extra = 0, {}, 0, {}
        for group in self.groups:
            counts = group.block_counts(block_size)
            extra.update(group.stat_fields(base))
            if counts is None:
                continue
            swapped += counts[0]
            empty += counts[1]
            by_kind[str(group.kind)] = by_kind.get(str(group.kind), 0) + counts[2]
        return dataclasses.replace(
            base, num_empty_slots=empty, num_live_tokens=base.num_live_blocks * block_size
            - empty, num_swapped_blocks=swapped, blocks_by_kind=tuple(by_kind.items()),
            num_given_back=self.given_back,
            bytes_given_back=self.given_back * self.config.bytes_per_block, **extra)

    def check(self) -> None:
        """Every group's rows (nulls only where its kind gave blocks back), the same
        sequences and lengths in every group, and the refcounts against the owners summed
        over groups."""
        leader, owners = self.leader.tables, np.zeros(self.config.num_blocks, dtype=np.int64)
        for group in self.groups:
            owners += group.check_rows(leader, self.config.num_blocks)
        owners[0] = 0
        self.allocator.check_invariants(owners)
        if self.leader.swap is not None:
            host = sum(group.host_owners(self.config.num_host_blocks + 1)
                       for group in self.groups)
            for group in self.groups:
                group.check_host(host)
