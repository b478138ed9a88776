"""`PagedKVCache`: the facade over the owners; it holds no state of its own.

    BlockAllocator  block ids, refcounts, prefix index, eviction   (ints, never tensors)
    PageTables      per-sequence rows: block ids, token counts, prefix keys (numpy rows)
    KVPool          the one preallocated K/V tensor (and the host pool's tensor)
    LayerGroup      one per group of same-kind layers (`paged_kv.core.groups`): its
                    PageTables, its SwapSpace (host block ids, swapped-out sequences) and
                    its kind's rules; a uniform model's cache has one; the recurrent
                    layers' StateGroup holds the state slab (a live slot per sequence,
                    prefix checkpoints) instead of blocks
    paged_kv.core.step   a step's (or an admission's) parse -> plan -> check -> commit over
                    the owners: StepPlanner reads them, StepCommitter changes them

One constructor serves every layout: the cache always holds its layer groups. A single
full-attention group (a uniform model) runs the leading group's step, admission and swap
directly (the fast path); several groups, or a group that gives blocks back, go through a
`GroupLayout`, which loops over them. Either way the capacity test is one function
(`paged_kv.core.step.plan.check_capacity`).

Every public mutator validates everything first and only then changes state, so a rejected
call leaves every owner exactly as it was. The owners are exposed read-only in spirit
(`allocator`, `tables`): outside the core they are read, and changed only through the
operations here (`tests/test_architecture.py` fails on a mutator called through them).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .._checks import (
    check_retain,
    require_known,
    require_new,
    require_resident,
    require_truncatable,
)
from ..config import CacheConfig
from ..errors import InvariantError, OutOfBlocksError, PagedKVError
from ..kernels.quant import raw
from ..keys import BlockEvent, root_hash
from ..tenants import eviction_for
from .accounting import CacheStats, compute_stats
from .admission import Admissions
from .allocator import BlockAllocator
from .batch import BatchOrSeqIds, SeqId, StepBatch
from .groups.groups import LayerGroup
from .groups.kinds import build_groups
from .groups.layout import DecodeForecast, GroupLayout
from .groups.state_group import StateGroup
from .layer_access import LayerAccess
from .load_cached import load_blocks
from .page_table import PageTables
from .pool import KVPool
from .step.parse import Step, decode_columns, parse_rows, parse_step, tokens_to_array
from .step.prefix import forget_unwritten

_NO_TOKENS = np.empty(0, dtype=np.int32)


class PagedKVCache(Admissions, LayerAccess):
    """A paged KV cache for many sequences at once.

    Parameters
    ----------
    config : CacheConfig
        Pool shape, dtype, device, prefix caching, host pool size.

    Examples
    --------
    >>> cfg = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4,
    ...                   num_blocks=16, dtype=torch.float32)
    >>> cache = PagedKVCache(cfg)
    >>> cache.add_sequence("a", [1, 2, 3, 4, 5])
    0
    >>> batch = cache.prepare({"a": [1, 2, 3, 4, 5]})
    >>> batch.slot_mapping.tolist()  # block 1 holds tokens 0-3, block 2 token 4
    [4, 5, 6, 7, 8]
    >>> k = torch.randn(5, 2, 8)
    >>> cache.write(0, k, -k, batch)
    >>> keys, values = cache.gather(0, ["a"])
    >>> torch.equal(keys[0], k)
    True
    >>> cache.stats().num_live_blocks, cache.stats().num_empty_slots
    (2, 3)
    """

    def __init__(self, config: CacheConfig, *, compiled: bool | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
        self.config = config
        self._allocator = BlockAllocator(config.num_blocks,
                                         enable_prefix_caching=config.enable_prefix_caching,
                                         eviction=eviction_for(config.tenants,
                                                               config.num_blocks))
        # a block spans one group's layers: the pool has a plane per layer of a group (the
        # recurrent layers' states are the state group's slab, not planes)
        self._pool = KVPool(dataclasses.replace(config, num_layers=config.group_size,
                                                layer_kinds=(), num_state_slots=0)
                            if config.layer_kinds else config)
        self._groups = build_groups(config, self._allocator, self._pool, compiled)
        leader = self._groups[0]
        self._tables, self._planner, self._committer, self._swap = (
            leader.tables, leader.planner, leader.committer, leader.swap)
        # one full-attention group is the fast path; any other layout loops over groups
        self._layout = (GroupLayout(self._groups, self._allocator, config)
                        if len(self._groups) > 1 or leader.gives_back else None)
        self._plane = {layer: (group.index, plane) for group in self._groups
                       for plane, layer in enumerate(group.layers)}
        # the recurrent layers' group (its checkpoints' events and tier values), if any
        self._states = next((g for g in self._groups if isinstance(g, StateGroup)), None)
        self._debug = os.environ.get("PAGED_KV_DEBUG") == "1"
        self._workspace = torch.empty(0, dtype=config.dtype, device=config.device)
        self._generation = 0  # mutations so far: a plan of an older generation is stale
        # the last decode count's rows, generation and layout plans (`num_blocks_needed`)
        self._forecast: tuple[np.ndarray, int, DecodeForecast] | None = None

    # -- read-only views of the owners ----------------------------------------------------
    @property
    def allocator(self) -> BlockAllocator:
        """The block-id owner (read it; mutate only through the cache)."""
        return self._allocator

    @property
    def tables(self) -> PageTables:
        """The per-sequence rows (read it; mutate only through the cache)."""
        return self._tables

    @property
    def pool(self) -> KVPool:
        """The K/V tensors."""
        return self._pool

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups, the leading one first (`paged_kv.core.groups`; one for a
        uniform model). Read them; change them only through the cache."""
        return self._groups

    @property
    def state_group(self) -> StateGroup | None:
        """The recurrent layers' group (None without them): its checkpoints as the tiers
        and the hand-off move them (`StateGroup.tier_keys`, `values_at`, `stored_values`,
        `owns_value`). Read it; change it only through the cache."""
        return self._states

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks are obtainable now (free plus evictable cached)."""
        return self._allocator.can_allocate(num_blocks)

    # -- sequence lifecycle ---------------------------------------------------------------
    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Make `child` share all of `parent`'s blocks; the first write into a shared,
        partly filled block copies it (copy-on-write). A recurrent state is copied into a
        slot of the child's own (`OutOfBlocksError` naming state slots when none is
        obtainable; nothing changed)."""
        require_resident(self._tables, "fork()", parent)
        require_new(self._tables, "fork()", child)
        for group in self._groups:
            group.check_fork(parent, "fork()")
        for group in self._groups:
            group.fork(self._allocator, parent, child)
        self._after_mutation()

    def truncate(self, seq_id: SeqId, num_tokens: int, *, unwritten: bool = False) -> None:
        """Keep only the first `num_tokens` tokens of a resident sequence (speculative
        decoding rollback, ``crop``); blocks past them are released, tail first.

        The sequence keeps extending its prefix-index chain only while its last kept full
        block is still indexed. A kept block that becomes partial but stays indexed is
        copied before it is written again (see `prepare`), so its cached prefix survives.

        With ``unwritten=True`` the K/V past `num_tokens` was never written (a failed step
        planned it): those blocks first leave the prefix index, so neither a later prompt
        nor a lower tier ever finds them.

        With recurrent layers the live state after `num_tokens` is restored from a state
        checkpoint there (zeros at 0); another length is refused (ValueError), except with
        ``unwritten=True``: the failed step's checkpoints leave the index, and a state that
        cannot be restored is marked lost (its next step or fork raises `PagedKVError`:
        free it and admit it again).
        """
        require_truncatable(self._tables, seq_id, num_tokens)
        if self._layout is not None:  # checks every group first, then cuts all but the leader
            self._layout.truncate_others(seq_id, int(num_tokens), unwritten)
        if unwritten:
            forget_unwritten(self._allocator, self._tables, seq_id, int(num_tokens),
                             self.config.block_size)
        num_full = num_tokens // self.config.block_size
        if self._tables.chain(self._tables.row_of[seq_id]) is None:
            chain = None  # ids unknown somewhere (or no prefix caching): never index again
        elif num_full == 0:
            chain = self._tables.root(self._tables.row_of[seq_id])
        else:
            chain = self._allocator.block_hash(int(self._tables.blocks(seq_id)[num_full - 1]))
        self._allocator.free(self._tables.truncate(seq_id, int(num_tokens), chain), unique=True)
        self._after_mutation()

    def free(self, seq_id: SeqId, *, priority: int | None = None,
             retention_seconds: float | None = None) -> None:
        """Release `seq_id`: full indexed blocks become cached (evictable), the rest free.

        With a tenant policy (`CacheConfig.tenants`), `priority` (0-99) and
        `retention_seconds` retain the cached blocks softly: they are evicted after every
        ordinary cached block until the retention ends, within the tenant's retention
        budget (None: the tenant's defaults; see `paged_kv.tenants`).
        """
        if seq_id not in self._tables:
            raise KeyError(f"free(): unknown sequence {seq_id!r} (never added, or double free?)")
        retain = check_retain("free()", priority, retention_seconds)
        for group in self._groups:
            group.remove(self._allocator, seq_id, retain)
        self._after_mutation()

    def reset_prefix_cache(self, tenant: str | None = None, *,
                           retention_only: bool = False) -> int:
        """Free every cached block and empty the prefix index; returns blocks dropped.

        With `tenant` (a salt the tenant policy names), only that tenant's cached blocks
        are evicted (an admin flush), or with `retention_only` only their soft retention
        ends (returns how many were retained); live blocks always stay.
        """
        if tenant is None:
            if retention_only:
                raise ValueError("reset_prefix_cache(): retention_only needs a tenant")
            dropped = self._allocator.reset_prefix_cache()
        else:
            dropped = self._allocator.flush_tenant(root_hash(tenant),
                                                   retention_only=retention_only)
        self._after_mutation()
        return dropped

    def take_events(self) -> list[BlockEvent]:
        """Return and clear the block events logged since the last call (see
        `BlockAllocator.take_events`): what the tiers copy out and KV events publish; a
        recurrent state group's ``state_stored`` / ``state_removed`` checkpoint events
        follow (`StateGroup.take_events`)."""
        events = self._allocator.take_events()
        if self._states is not None:
            events += self._states.take_events()
        return events

    def load_cached(self, keys: list[bytes], token_ids: np.ndarray, payload: torch.Tensor,
                    parent_key: bytes) -> int:
        """Put blocks fetched from a lower tier into the pool as cached blocks under their
        keys, where the next admission finds them as any prefix hit.

        Parameters
        ----------
        keys : list of bytes
            The blocks' chained keys, a prompt's consecutive full blocks in order; on a
            layout with recurrent layers, then a state checkpoint's chunk keys
            (`HybridAdmission.missing`), loaded into a checkpoint slot.
        token_ids : np.ndarray
            ``[num_blocks * block_size]`` the blocks' token ids (chunk keys have none).
        payload : torch.Tensor
            ``[len(keys), pool.block_nbytes]`` uint8, the blocks as `KVPool.read_blocks`
            gave them (a checkpoint's chunks as `StateGroup.stored_values` did).
        parent_key : bytes
            The key the first block chains from (its `stored` event names it as parent).

        Returns
        -------
        int
            Blocks loaded (0 when the pool cannot spare them; nothing changed then), plus
            the chunks of the checkpoints loaded. A key indexed meanwhile keeps its block;
            the copy is freed.
        """
        loaded = load_values(self._allocator, self._pool, self._states, keys, token_ids,
                             payload, parent_key)
        self._after_mutation()
        return loaded

    # -- a step ---------------------------------------------------------------------------
    def prepare(self, new_tokens: Mapping[SeqId, Sequence[int] | int]) -> StepBatch:
        """Reserve slots for each sequence's new tokens and build the step's `StepBatch`.

        Parameters
        ----------
        new_tokens : mapping of seq_id to token ids or a count
            At least one token each; a count means ids unknown (such blocks are never
            indexed for reuse). Rows and tokens follow the mapping's order.

        Returns
        -------
        StepBatch

        Raises
        ------
        OutOfBlocksError
            The step needs more blocks than obtainable; nothing changed.
        KeyError, TypeError, ValueError
            Unknown or swapped-out sequence, bad token ids or counts; nothing changed.
        """
        return self._step(parse_step(new_tokens, self._tables), "prepare()")

    def _step(self, step: Step, what: str, decode: bool | None = None,
              forecast: DecodeForecast | None = None) -> StepBatch:
        """Plan, check and commit a parsed step (``decode=True``: one token a row;
        `forecast`: the layout's plans of its rows, still current)."""
        if self._layout is not None:
            batch = self._layout.step(step, what, decode, forecast)
            self._after_mutation()
            return batch
        plan = self._planner.plan(step, decode=decode)
        self._planner.check(plan, what)
        batch = self._committer.commit(plan)
        self._after_mutation()
        return batch

    def rows_of(self, seq_ids: Sequence[SeqId]) -> np.ndarray:
        """Row handles of resident sequences for `prepare_decode`, ``[B]`` int64, read-only.

        The same array comes back while no sequence is added, freed or swapped, so a
        running batch resolves its handles once and the decode step skips re-validating them.
        """
        seq_ids = tuple(seq_ids)
        try:
            rows = self._tables.rows_of(seq_ids)
        except KeyError as exc:
            raise KeyError(f"rows_of(): unknown sequence {exc.args[0]!r}") from None
        self._tables.resolve_rows("rows_of()", rows)
        return rows

    def prepare_decode(self, rows: np.ndarray, token_ids: np.ndarray | torch.Tensor | None,
                       counts: np.ndarray | torch.Tensor | None = None) -> StepBatch:
        """`prepare` given as arrays: one new token per sequence (the decode step), or
        `counts` each (a mixed step: a running batch's decoding rows beside new prompts'
        chunks, with no ``{seq_id: tokens}`` mapping made of every row).

        Parameters
        ----------
        rows : np.ndarray
            ``[B]`` row handles from `rows_of` (each sequence once, resident).
        token_ids : np.ndarray or torch.Tensor or None
            ``[B]`` int, the new token of each row; None when the ids are unknown (as a
            count of 1 in `prepare`: those rows' blocks are never indexed for reuse). With
            `counts`: ``[counts.sum()]``, each row's tokens after the row before's (known).
        counts : np.ndarray or torch.Tensor, optional
            ``[B]`` int, each row's new tokens (at least one); None: one each.

        Returns
        -------
        StepBatch
            As `prepare` of ``{seq_id: its tokens}`` in the order of `rows`, and the same
            state changes (copy-on-write, prefix indexing, all or nothing).

        Examples
        --------
        >>> cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
        ...                                  block_size=4, num_blocks=8))
        >>> for s in ("a", "b"):
        ...     _ = cache.add_sequence(s, [1, 2, 3])
        ...     _ = cache.prepare({s: [1, 2, 3]})
        >>> rows = cache.rows_of(["a", "b"])
        >>> cache.prepare_decode(rows, np.array([7, 8])).slot_mapping.tolist()
        [7, 11]
        >>> _ = cache.add_sequence("c", [1, 2])
        >>> rows = cache.rows_of(["a", "b", "c"])  # two decoding, one prompt of two tokens
        >>> batch = cache.prepare_decode(rows, np.array([9, 9, 1, 2]), counts=[1, 1, 2])
        >>> batch.slot_mapping.tolist()
        [12, 16, 20, 21]
        """
        rows, seq_ids = self._tables.resolve_rows("prepare_decode()", rows)
        if counts is not None:
            return self._step(parse_rows(seq_ids, rows, counts, token_ids), "prepare_decode()")
        known = token_ids is not None
        tokens = _NO_TOKENS  # ids unknown
        if known:
            tokens = tokens_to_array("prepare_decode(): token_ids", token_ids)
            if tokens.shape != rows.shape:
                raise ValueError(f"prepare_decode(): token_ids: expected shape {rows.shape} "
                                 f"(one per row), got {tokens.shape}")
        step = Step(seq_ids, rows, *decode_columns(rows.size, known), tokens)
        return self._step(step, "prepare_decode()", decode=True,
                          forecast=self._current_forecast(step.rows))

    def _current_forecast(self, rows: np.ndarray) -> DecodeForecast | None:
        """The layout's forecast that `num_blocks_needed` made of `rows` (resolved from
        the same read-only handles: `resolve_rows` gave the same array), if the cache has
        not changed since; taken once."""
        forecast, self._forecast = self._forecast, None
        if forecast is None or forecast[0] is not rows or forecast[1] != self._generation:
            return None
        return forecast[2]

    def num_blocks_needed(self, new_tokens: Mapping[SeqId, Sequence[int] | int] | np.ndarray,
                          *, per_sequence: bool = False) -> int | np.ndarray:
        """Blocks `prepare(new_tokens)` would take now (copy-on-write copies included),
        without changing anything: a scheduler's admission check.

        `new_tokens` may also be row handles from `rows_of` (an ``np.ndarray``): the blocks
        `prepare_decode` of those rows would take, one new token each (the steady decode
        state, counted without a mapping to parse).

        With ``per_sequence=True`` returns ``[B]`` int64, each sequence's share in the
        mapping's order (copies counted for the sequence that makes them).

        Examples
        --------
        >>> cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
        ...                                  block_size=4, num_blocks=8))
        >>> cache.add_sequence("a")
        0
        >>> cache.num_blocks_needed({"a": 9})  # ceil(9 / 4)
        3
        """
        if isinstance(new_tokens, np.ndarray) and self._layout is None and not per_sequence:
            # the steady state: no copy, no step object
            rows, _ = self._tables.resolve_rows("num_blocks_needed()", new_tokens)
            needed = self._tables.plan_decode(rows, self._allocator.protected)
            if needed >= 0:
                return needed
        step = self._parse_needed(new_tokens)  # a copy, per sequence, or several groups
        if self._layout is not None and isinstance(new_tokens, np.ndarray) and not per_sequence:
            # kept for `prepare_decode` of these rows, which plans the same while the
            # cache is unchanged (a scheduler's count, then its step; ~0.1 ms at 1,024)
            forecast = self._layout.forecast(step)
            self._forecast = (step.rows, self._generation, forecast)
            return forecast.needed
        if self._layout is not None:
            need = self._layout.num_blocks_needed(step)
            return need if per_sequence else int(need.sum())
        plan = self._planner.plan(step, fast=False)
        return plan.per_sequence() if per_sequence else plan.requested

    def _parse_needed(self, new_tokens: Mapping[SeqId, Sequence[int] | int] | np.ndarray,
                      ) -> Step:
        """`num_blocks_needed`'s argument as a step (rows: one unknown token each)."""
        if isinstance(new_tokens, np.ndarray):
            rows, seq_ids = self._tables.resolve_rows("num_blocks_needed()", new_tokens)
            return Step(seq_ids, rows, *decode_columns(rows.size, False), _NO_TOKENS)
        return parse_step(new_tokens, self._tables)

    # -- swapping -------------------------------------------------------------------------
    def swap_out(self, seq_id: SeqId) -> None:
        """Move a sequence's blocks to the host pool and release its device blocks."""
        require_resident(self._tables, "swap_out()", seq_id)
        if self._swap is None:
            raise PagedKVError("swap_out(): no host pool; set CacheConfig.num_host_blocks > 0")
        if self._layout is not None:  # every group's blocks, all or nothing
            self._layout.swap(seq_id, "swap_out()", out=True)
        else:
            self._swap.swap_out(seq_id)
        self._after_mutation()

    def swap_in(self, seq_id: SeqId) -> None:
        """Bring a swapped-out sequence back into fresh device blocks."""
        require_known(self._tables, "swap_in()", seq_id)
        if self._swap is None or not self._swap.is_swapped(seq_id):
            raise ValueError(f"swap_in(): sequence {seq_id!r} is not swapped out")
        if self._layout is not None:
            self._layout.swap(seq_id, "swap_in()", out=False)
        else:
            self._swap.swap_in(seq_id)
        self._after_mutation()

    # -- accounting and checking ----------------------------------------------------------
    def stats(self) -> CacheStats:
        """Where every block and byte is now (see `CacheStats`); over several groups,
        with live blocks by layer kind and the blocks rows gave back (`GroupLayout.stats`)."""
        stats = compute_stats(
            allocator=self._allocator, tables=self._tables, block_size=self.config.block_size,
            bytes_per_block=self.config.bytes_per_block, total_bytes=self._pool.nbytes,
            num_swap_outs=0 if self._swap is None else self._swap.num_swap_outs)
        return stats if self._layout is None else self._layout.stats(stats)

    def check(self) -> None:
        """Raise `InvariantError` if any invariant of allocator, tables or pool is broken
        (over several groups: `GroupLayout.check`)."""
        if self._layout is not None:
            self._layout.check()
            return
        self._tables.check()
        self._allocator.check_invariants(self._tables.owners(self.config.num_blocks))
        if self._swap is not None:
            self._swap.check()

    # -- the worker side ------------------------------------------------------------------
    def _pages(self, layer: int, batch_or_seq_ids: BatchOrSeqIds,
               ) -> tuple[int, BatchOrSeqIds, PageTables]:
        if self._layout is None:
            return layer, batch_or_seq_ids, self._tables
        index, plane = self._plane[layer]
        if self.config.kind_of(layer).is_recurrent:
            raise ValueError(f"layer {layer} is recurrent: it keeps a state, not K/V pages "
                             f"(states, read_states, write_states)")
        if isinstance(batch_or_seq_ids, StepBatch):
            if len(batch_or_seq_ids.groups) != len(self._groups):
                raise ValueError("batch: not a StepBatch this cache's prepare() returned "
                                 "(it has no batch per layer group)")
            batch_or_seq_ids = batch_or_seq_ids.groups[index]
        return plane, batch_or_seq_ids, self._groups[index].tables

    def _state_group(self, layer: int, what: str) -> LayerGroup:
        """The group holding recurrent layer `layer`'s states (ValueError for another)."""
        if not self.config.kind_of(layer).is_recurrent:
            raise ValueError(f"{what}: layer {layer} is {self.config.kind_of(layer)} "
                             f"attention: it keeps K/V pages, not a recurrent state")
        return self._groups[self._plane[layer][0]]

    # -- validation helpers ---------------------------------------------------------------
    def _after_mutation(self) -> None:
        self._generation += 1
        if self._debug:
            self.check()


__all__ = ["InvariantError", "OutOfBlocksError", "PagedKVCache", "PagedKVError"]


def load_values(allocator: BlockAllocator, pool: KVPool, states: StateGroup | None,
                keys: list[bytes], token_ids: np.ndarray, payload: torch.Tensor,
                parent_key: bytes) -> int:
    """`load_blocks` for a run whose keys may end with a state group's chunk keys (a hybrid
    prompt's checkpoint at the run's end, `HybridAdmission.missing`): the blocks are
    loaded (`token_ids` are theirs alone), then the checkpoints, each into a slot of its
    own; returns the blocks loaded plus the chunks of the checkpoints loaded. A checkpoint
    is indexed whatever became of the blocks: its key names the prefix it follows, and an
    admission serves it only where every group's blocks hit too."""
    owned = [states is not None and states.owns_value(key) for key in keys]
    if not any(owned):
        return load_blocks(allocator, pool, keys, token_ids, payload, parent_key)
    mine = [i for i, own in enumerate(owned) if own]
    blocks = [i for i, own in enumerate(owned) if not own]
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
            or tuple(payload.shape) != (len(keys), pool.block_nbytes):
        raise ValueError(f"load_cached(): expected uint8 payload [{len(keys)}, "
                         f"{pool.block_nbytes}] for {len(keys)} keys, got "
                         f"{getattr(payload, 'dtype', type(payload).__name__)} "
                         f"{tuple(getattr(payload, 'shape', ()))}")
    loaded = load_blocks(allocator, pool, [keys[i] for i in blocks], token_ids,
                         payload[blocks], parent_key) if blocks else 0
    return loaded + states.load_values([keys[i] for i in mine], payload[mine])


def snapshot(cache: PagedKVCache) -> tuple:
    """Comparable copy of a cache's whole state (tables, allocators, pool bytes): tests of
    rejected calls compare one taken before with one taken after."""
    pool = cache.pool
    tensors = tuple(None if t is None else raw(t).clone() for t in (
        pool.kv, pool.host, pool.scales, pool.host_scales))
    host = None if cache._swap is None else cache._swap.snapshot()
    # a hybrid layout's every layer group: its rows, and the blocks its window gave back
    # (the state group's slots and slab too)
    groups = tuple(g.snapshot() for g in cache.groups)
    return cache.allocator.snapshot(), cache.tables.snapshot(), host, tensors, groups
