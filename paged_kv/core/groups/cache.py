"""`HybridKVCache`: a paged cache whose layers are of several kinds, in one pool.

Layers are grouped by kind into groups of one size (`paged_kv.config.group_layers`); a
block spans one group's layers, so one pool and one allocator serve every group, each
group with its own block tables. A window or chunked group's row gives its blocks back as
the window moves on (before each step, by `skipped_blocks` of the tokens it holds), so a
sequence holds about ``cdiv(W, block_size) + 1`` blocks per window group however long it
grows. A block given back stays indexed when it was (cached, evictable, reusable by a
later prefix hit), and a prefix hit is the longest every group accepts
(`paged_kv.core.groups.admission`).

Built by ``PagedKVCache(config)`` when ``config.layer_kinds`` is set; the public surface is
`PagedKVCache`'s, and a step's `StepBatch` carries one batch per group in ``groups``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..._checks import check_retain, require_new, require_resident, require_truncatable
from ...config import CacheConfig
from ...errors import OutOfBlocksError, ensure
from ..accounting import CacheStats, empty_slots_per_block
from ..allocator import BlockAllocator
from ..batch import BatchOrSeqIds, SeqId, StepBatch
from ..cache import PagedKVCache
from ..page_table import PageTables
from ..pool import KVPool
from ..step.parse import Step, decode_columns, parse_step
from ..step.plan import fits
from ..step.prefix import forget_unwritten
from .admission import HybridAdmission, commit_groups, plan_groups
from .groups import LayerGroup, filled_blocks
from .rules import skipped_blocks

_NO_TOKENS = np.empty(0, dtype=np.int32)


class HybridKVCache(PagedKVCache, serves_layer_kinds=True):
    """A `PagedKVCache` over layer groups of several kinds (see the module docstring).

    Examples
    --------
    >>> from paged_kv.config import LayerKind
    >>> cfg = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2,
    ...                   num_blocks=32, layer_kinds=(LayerKind.sliding(3), LayerKind()))
    >>> cache = PagedKVCache(cfg)
    >>> type(cache).__name__, cache.add_sequence("a", list(range(10)))
    ('HybridKVCache', 0)
    >>> _ = cache.prepare({"a": list(range(10))})
    >>> _ = cache.prepare({"a": [10]})  # the window's query at 10 reads tokens 8-10
    >>> cache.stats().blocks_by_kind
    (('full', 6), ('sliding:3', 2))
    """

    def __init__(self, config: CacheConfig, *, compiled: bool | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
        self.config = config
        self._allocator = BlockAllocator(config.num_blocks,
                                         enable_prefix_caching=config.enable_prefix_caching,
                                         tenants=config.tenants)
        self._pool = KVPool(dataclasses.replace(config, num_layers=config.group_size,
                                                layer_kinds=()))
        host = (BlockAllocator(config.num_host_blocks + 1, enable_prefix_caching=False)
                if config.num_host_blocks else None)  # one host pool, every group's ids
        self._groups = [LayerGroup.build(index, kind, layers, config, self._allocator,
                                         self._pool, compiled, host)
                        for index, (kind, layers) in enumerate(config.layer_groups)]
        ensure(len(self._groups) < 256, "more than 255 layer groups")
        leader = self._groups[0]
        self._tables, self._planner, self._committer = (leader.tables, leader.planner,
                                                        leader.committer)
        self._swap = leader.swap
        self._plane = {layer: (group.index, plane) for group in self._groups
                       for plane, layer in enumerate(group.layers)}
        self._given_back = 0  # blocks window rows gave back, since the start
        self._debug = os.environ.get("PAGED_KV_DEBUG") == "1"
        self._workspace = torch.empty(0, dtype=config.dtype, device=config.device)

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups, the leading one first (read them; change them only through
        the cache)."""
        return tuple(self._groups)

    # -- admission ------------------------------------------------------------------------
    def _plan_admission(self, what: str, seq_id: SeqId, tokens: np.ndarray | None,
                        salt: str | None, keys: Sequence[bytes], max_tokens: int | None,
                        *, lookup: bool = True, complete: bool = False) -> HybridAdmission:
        # a window leader's hit is found right to left: it needs every key of the prompt
        complete = complete or not self._groups[0].kind.is_full
        plan = super()._plan_admission(what, seq_id, tokens, salt, keys, max_tokens,
                                       lookup=lookup, complete=complete)
        return plan_groups(self._groups, self._allocator, plan, self.config.block_size,
                           max_tokens)

    def _commit_admission(self, plan: HybridAdmission, what: str, *, prepare: bool = False,
                          ) -> StepBatch | None:
        obtainable = self._allocator.num_obtainable_blocks
        if not fits(plan, obtainable):
            raise OutOfBlocksError(plan.requested, obtainable - plan.revived, what)
        batches = commit_groups(self._groups, self._allocator, plan, prepare,
                                self.config.device)
        self._changed()
        return dataclasses.replace(batches[0], groups=batches) if prepare else None

    # -- a step ---------------------------------------------------------------------------
    def _step(self, step: Step, what: str, decode: bool | None = None) -> StepBatch:
        rows, allocator = step.rows, self._allocator
        plans = [group.planner.plan(step, decode=decode) for group in self._groups]
        releases = [group.releasable(rows) for group in self._groups]
        requested = sum(plan.requested for plan in plans)
        obtainable = allocator.num_obtainable_blocks + sum(
            self._freed(group, *release).sum() for group, release in zip(
                self._groups, releases, strict=True))
        if requested > obtainable:
            raise OutOfBlocksError(requested, int(obtainable), what)
        old_lens = self._tables.num_tokens[rows].copy()
        mirrored = self.config.enable_prefix_caching and len(self._groups) > 1
        # a window leader gives back the blocks a filling one chains from: keep their keys
        chains = (self._tables.chains(rows.tolist())
                  if mirrored and not self._groups[0].kind.is_full else None)
        for group, (moving, upto) in zip(self._groups, releases, strict=True):
            if moving.size:
                self._given_back += group.release(allocator, moving, upto)
        batches = tuple(group.committer.commit(plan) for group, plan in zip(
            self._groups, plans, strict=True))
        if mirrored:
            filled = filled_blocks(allocator, self._tables, rows, old_lens, chains)
            for group in self._groups[1:]:
                group.mirror(allocator, filled)
        self._changed()
        return dataclasses.replace(batches[0], groups=batches)

    def _freed(self, group: LayerGroup, rows: np.ndarray, upto: np.ndarray) -> np.ndarray:
        """``[len(rows)]`` blocks each row's give-back makes obtainable: those every owner
        gives back in this step (forks decoding together give back shared blocks at once),
        each credited to the first row giving it back."""
        parts = [group.blocks_between(rows[i:i + 1], upto[i:i + 1]) for i in range(rows.size)]
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        owner = np.repeat(np.arange(rows.size), [part.size for part in parts])
        unique, first, counts = np.unique(ids, return_index=True, return_counts=True)
        gone = counts == self._allocator.refcount[unique]
        return np.bincount(owner[first[gone]], minlength=rows.size).astype(np.int64)

    def num_blocks_needed(self, new_tokens: Mapping[SeqId, Sequence[int] | int] | np.ndarray,
                          *, per_sequence: bool = False) -> int | np.ndarray:
        if isinstance(new_tokens, np.ndarray):
            rows, seq_ids = self._tables.resolve_rows("num_blocks_needed()", new_tokens)
            step = Step(seq_ids, rows, *decode_columns(rows.size, False), _NO_TOKENS)
        else:
            step = parse_step(new_tokens, self._tables)
        need = sum(group.planner.plan(step, fast=False).per_sequence()
                   for group in self._groups)
        position = None
        for group in self._groups:  # less what the step's give-back returns first
            moving, upto = group.releasable(step.rows)
            if moving.size:
                position = position or {row: i for i, row in enumerate(step.rows.tolist())}
                np.subtract.at(need, [position[row] for row in moving.tolist()],
                               self._freed(group, moving, upto))
        return need if per_sequence else int(need.sum())

    # -- sequence lifecycle ---------------------------------------------------------------
    def fork(self, parent: SeqId, child: SeqId) -> None:
        require_resident(self._tables, "fork()", parent)
        require_new(self._tables, "fork()", child)
        for group in self._groups:
            row = group.tables.fork(parent, child)
            group.released_of(np.array([row]))
            group.released[row] = group.released[group.tables.row_of[parent]]
            blocks = group.tables.blocks(child)
            self._allocator.share(blocks[blocks != 0])
        self._changed()

    def truncate(self, seq_id: SeqId, num_tokens: int, *, unwritten: bool = False) -> None:
        require_truncatable(self._tables, seq_id, num_tokens)
        row = self._tables.row_of[seq_id]
        for group in self._groups:
            if group.released[row] > skipped_blocks(group.kind, int(num_tokens),
                                                    self.config.block_size):
                raise ValueError(f"truncate(): {seq_id!r}'s {group.kind} layers gave back "
                                 f"the blocks a query after {num_tokens} tokens reads")
        for group in self._groups[1:]:
            if unwritten:
                forget_unwritten(self._allocator, group.tables, seq_id, int(num_tokens),
                                 self.config.block_size)
            self._allocator.free(group.tables.truncate(seq_id, int(num_tokens), None),
                                 unique=True)
        super().truncate(seq_id, num_tokens, unwritten=unwritten)

    def free(self, seq_id: SeqId, *, priority: int | None = None,
             retention_seconds: float | None = None) -> None:
        if seq_id not in self._tables:
            raise KeyError(f"free(): unknown sequence {seq_id!r} (never added, or double free?)")
        retain = check_retain("free()", priority, retention_seconds)
        row = self._tables.row_of[seq_id]
        swapped = self._swap is not None and self._swap.is_swapped(seq_id)
        for group in self._groups:
            blocks = group.tables.remove(seq_id)
            group.released[row] = 0
            if swapped:
                group.swap.drop(seq_id, blocks)
            else:
                self._allocator.free(blocks[blocks != 0], unique=True, **retain)
        self._changed()

    def swap_out(self, seq_id: SeqId) -> None:
        """Move the sequence's blocks of every group to the host pool (all or nothing)."""
        self._swap_all(seq_id, "swap_out()", out=True)

    def swap_in(self, seq_id: SeqId) -> None:
        """Bring every group's blocks of a swapped-out sequence back (all or nothing)."""
        self._swap_all(seq_id, "swap_in()", out=False)

    def _swap_all(self, seq_id: SeqId, what: str, *, out: bool) -> None:
        if out:
            require_resident(self._tables, what, seq_id)
        elif seq_id not in self._tables or self._swap is None \
                or not self._swap.is_swapped(seq_id):
            super().swap_in(seq_id)  # raises the uniform cache's error
        if self._swap is None:
            super().swap_out(seq_id)  # raises: no host pool
        rows = np.array([self._tables.row_of[seq_id]])
        # what no later query reads leaves before the swap-out, as it would before the
        # next step: a prefill's blocks are not carried to the host and back (nor counted
        # against the request limit the swap-in is sized by)
        releases = [group.releasable(rows) if out else (rows[:0], rows[:0])
                    for group in self._groups]
        blocks = sum(int(np.count_nonzero(group.tables.blocks(seq_id)))
                     - int(np.count_nonzero(group.blocks_between(*release)))
                     for group, release in zip(self._groups, releases, strict=True))
        pool = self._swap.allocator if out else self._allocator
        if not pool.can_allocate(blocks):
            raise OutOfBlocksError(blocks, pool.num_obtainable_blocks, f"{what} host pool"
                                   if out else what)
        for group, (moving, upto) in zip(self._groups, releases, strict=True):
            if moving.size:
                self._given_back += group.release(self._allocator, moving, upto)
            (group.swap.swap_out if out else group.swap.swap_in)(seq_id)
        self._changed()

    # -- the worker side ------------------------------------------------------------------
    def _pages(self, layer: int, batch_or_seq_ids: BatchOrSeqIds,
               ) -> tuple[int, BatchOrSeqIds, PageTables]:
        index, plane = self._plane[layer]
        if isinstance(batch_or_seq_ids, StepBatch):
            if len(batch_or_seq_ids.groups) != len(self._groups):
                raise ValueError("batch: not a StepBatch this cache's prepare() returned "
                                 "(it has no batch per layer group)")
            batch_or_seq_ids = batch_or_seq_ids.groups[index]
        return plane, batch_or_seq_ids, self._groups[index].tables

    # -- accounting and checking ----------------------------------------------------------
    def _changed(self) -> None:
        if self._debug:
            self.check()

    def stats(self) -> CacheStats:
        """`PagedKVCache.stats`, with live blocks by layer kind and the blocks window rows
        gave back; empty slots are counted in every group's resident rows, and a swapped
        sequence's host blocks in every group (not the leading group's alone)."""
        base, block_size = super().stats(), self.config.block_size
        empty, by_kind, swapped = 0, {}, 0
        for group in self._groups:
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
            num_given_back=self._given_back,
            bytes_given_back=self._given_back * self.config.bytes_per_block)

    def check(self) -> None:
        """`PagedKVCache.check` over every group: each group's rows (nulls only where its
        window gave blocks back), the same sequences and lengths in every group, and the
        refcounts against the owners summed over groups."""
        leader, owners = self._tables, np.zeros(self.config.num_blocks, dtype=np.int64)
        for group in self._groups:
            tables = group.tables
            ensure(tables.row_of == leader.row_of, f"group {group.index}'s rows diverged")
            rows = leader.rows()
            ensure(np.array_equal(tables.num_tokens[rows], leader.num_tokens[rows]),
                   f"group {group.index}'s token counts diverged")
            tables.check(null_prefix=group.released_of(np.arange(tables.num_tokens.size)))
            owners += tables.owners(self.config.num_blocks)
        owners[0] = 0
        self._allocator.check_invariants(owners)
        if self._swap is not None:
            host = sum(group.tables.owners(self.config.num_host_blocks + 1, swapped=True)
                       for group in self._groups)
            for group in self._groups:
                group.swap.check(host.copy())
