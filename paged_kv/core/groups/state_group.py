"""`StateGroup`: the recurrent layers' group, whose rows hold a state slot, not blocks.

Every recurrent layer of a model is in one group (`paged_kv.layer_kinds.group_layers`), placed
after the attention groups. Its rows follow theirs (same sequences, same rows, same token
counts), but a row holds no block: it holds a live slot of the state slab
(`paged_kv.core.groups.state`), which every step of the sequence reads and writes in
place. Its rules:

- **a prefix hit needs its state.** A hit of ``c`` blocks is accepted only where a written
  checkpoint sits at exactly ``c`` (the states after token ``c * block_size - 1``), or at
  ``c == 0`` (the zero state); `accepted_hit` rounds down to the nearest one, so a hit is
  never served without its state. The admission copies the checkpoint into the new
  sequence's live slot (the checkpoint stays cached), or zeroes it;
- **checkpoints at block boundaries.** For every block of the leading group that fills in
  a step and is indexed, the group offers a checkpoint (`StateSlots.offer`: dense while a
  slot is free, then only over a less valuable one), indexed at commit under that block's
  group key, as attention blocks are; the step's `StateBatch` tells the forward which
  token's state goes to which slot;
- **fork** copies the parent's live state into the child's own slot; **free** returns the
  live slot (checkpoints stay); **truncate** restores the live state from a checkpoint at
  the kept length (or zeroes it at 0) and refuses any other length, except after a failed
  step (``unwritten=True``), which drops the checkpoints the step took and marks a state
  it cannot restore as lost (a later step or fork of it raises: free it and admit it
  again); **swap** moves the live state to a host copy and frees its slot, and back into
  a fresh slot (at most `num_state_slots` host copies, so the host holds no more state
  than the slab: past that a swap-out raises `OutOfBlocksError` and the scheduler
  recomputes instead).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import ClassVar

import numpy as np
import torch

from ...config import CacheConfig, LayerKind
from ...errors import OutOfBlocksError, PagedKVError, ensure
from ..accounting import CacheStats
from ..allocator import BlockAllocator
from ..batch import SeqId, StepBatch
from ..page_table import PageTables
from ..pool import KVPool
from ..step.parse import Step
from ..step.plan import Admission, StepPlan
from .groups import Filled, LayerGroup
from .rules import group_key, group_suffix
from .state import OutOfStateSlotsError, StateSlots
from .state_batch import StateBatch
from .state_export import CheckpointExport
from .state_slab import StateSlab
from .state_tenants import CheckpointShares


@dataclasses.dataclass
class StateGroup(CheckpointExport, LayerGroup):
    """The recurrent layers' group (see the module docstring).

    Attributes
    ----------
    slots : StateSlots
        Which slab slot is free, live (a row's) or a checkpoint (a key's).
    slab : StateSlab
        The states' tensors.
    leader : PageTables
        The leading group's tables: the keys of a row's blocks (a checkpoint's key).
    lost : set of int
        Rows whose live state a failed step left unknown (see `truncate`).
    """

    slots: StateSlots | None = None
    slab: StateSlab | None = None
    leader: PageTables | None = None
    lost: set[int] = dataclasses.field(default_factory=set)
    # row -> the position of its junction: where its prompt's cached attention blocks ran
    # past the last checkpoint; the checkpoint there is offered as shared
    junction: dict[int, int] = dataclasses.field(default_factory=dict)
    # swapped-out sequences' live states, host copies (`StateSlab.save`)
    host: dict[SeqId, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    block_nbytes: int = 0  # one value of a lower tier (`state_values`): a pool block's bytes
    tenant: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> its tenant
    # the last read-only rows array a step packed, and each row's place in it
    _positions: tuple = dataclasses.field(default=(None, None), repr=False, compare=False)

    holds_blocks: ClassVar[bool] = False  # a row holds a state slot, never a block

    @classmethod
    def build(cls, index: int, kind: LayerKind, layers: tuple[int, ...], config: CacheConfig,
              allocator: BlockAllocator, pool: KVPool, compiled: bool | None,
              host_allocator: BlockAllocator | None, leader: LayerGroup | None = None,
              ) -> StateGroup:
        """The group, its slab of `config.num_state_slots` slots (each recurrent layer's
        `LayerKind.states`), and its rows following `leader`'s (no swap space)."""
        group = super().build(index, kind, layers, config, allocator, pool, compiled, None)
        # a sparse interval of 8 blocks (128 tokens at block 16) outlives other interior
        # boundaries: a prompt meeting a prefix no one has met at yet hits near it
        shares = (None if config.tenants is None else
                  CheckpointShares(config.tenants, config.num_state_slots, config.num_blocks))
        group.slots = StateSlots(config.num_state_slots, interval=8 * config.block_size,
                                 shares=shares)
        group.slab = StateSlab({layer: config.kind_of(layer).states for layer in layers},
                               config.num_state_slots, config.device)
        group.leader = leader.tables
        group.block_nbytes = pool.block_nbytes
        return group

    # -- the kind's rules ------------------------------------------------------------------
    def skipped_tokens(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        """Every token: the group reads no token's K/V (a tier or a hand-off asks it for
        no block)."""
        return num_tokens

    def accepted_hit(self, end: int, cached) -> int:
        """The largest hit of at most `end` blocks with a written checkpoint at its end
        (``cached(c - 1)``: one after block ``c - 1``), or 0 (the zero state)."""
        while end > 0 and not cached(end - 1):
            end -= 1
        return end

    def lookup(self, allocator: BlockAllocator, key: bytes, data: bytes) -> int | None:
        """The written checkpoint after the leading group's block `key`, or None."""
        return self.slots.find(group_key(key, self.index))

    def hits_at(self, end: int, found) -> list[int]:
        """The checkpoint slot a hit of `end` blocks starts from (none at 0)."""
        return [found(end - 1)] if end else []

    def revived(self, allocator: BlockAllocator, hits: list[int]) -> int:
        return 0

    def share_hits(self, allocator: BlockAllocator, hits: list[int]) -> None:
        """Nothing: a checkpoint is copied, never owned (`add_row` keeps it from eviction
        while taking the live slot)."""

    # -- an admission ----------------------------------------------------------------------
    def check_admission(self, hits: list[int], what: str) -> None:
        """`OutOfStateSlotsError` unless a live slot is obtainable besides the checkpoint
        the admission copies from."""
        if self.slots.obtainable(hits[0] if hits else None) < 1:
            raise OutOfStateSlotsError(1, 0, what)

    def add_row(self, allocator: BlockAllocator, plan: Admission, hits: list[int], row: int,
                prepare: bool, filled: list[Filled], device, shared: int = 0,
                ) -> StateBatch | None:
        """The row's live slot, holding a copy of the hit's checkpoint (or zeros), and
        with `prepare` the checkpoints of the blocks its first tokens fill. Where the
        attention blocks hit past the state (`shared` blocks against the hit's), the
        checkpoint at that junction is offered as shared when the row computes it."""
        ensure(self.tables.add(plan.seq_id) == row, "layer groups' rows diverged")
        if self.slots.shares is not None:
            self.tenant[row] = self.slots.shares.tenant_of_root(plan.root)
        if shared * self.tables.block_size > plan.num_hit:
            self.junction[row] = shared * self.tables.block_size
        count = plan.count if prepare else 0
        rows = np.array([row])
        self.tables.set_num_tokens(rows, np.array([plan.num_hit + count]))
        source = hits[0] if hits else None
        live = self.slots.take_live(row, exclude=source)
        if source is None:
            self.slab.zero(live)
        else:
            self.slab.copy(source, live)
            self.slots.served(source)
        if not prepare:
            return None
        return self._batch(rows, np.array([plan.num_hit]), np.array([count]), filled)

    # -- a step ----------------------------------------------------------------------------
    def plan_step(self, step: Step, decode: bool | None) -> StepPlan:
        """No block; refused (changing nothing) for a row whose state a failed step lost."""
        if self.lost:
            self._require_state(step.rows.tolist(), "a step")
        # a decode step's plan says so as the attention groups' do (no per-row array): its
        # commit then packs one token a row
        return StepPlan(step, 0, None if decode else np.zeros(step.rows.size, dtype=np.int64))

    def commit_step(self, plan: StepPlan, filled: list[Filled]) -> StateBatch:
        """The rows' new lengths; their last commit's checkpoints are written now (their
        forward ran), and the blocks that filled get checkpoints where the policy allows."""
        step = plan.step
        rows = step.rows
        old = self.tables.num_tokens[rows]  # a gather: a copy already
        self.tables.set_num_tokens(rows, old + step.counts)
        self.slots.confirm(rows)
        return self._batch(rows, old, step.counts, filled, plan.new_blocks is None)

    def needed_per_row(self, step: Step) -> np.ndarray:
        return np.zeros(step.rows.size, dtype=np.int64)

    def mirror(self, allocator: BlockAllocator, filled: list[Filled]) -> None:
        """Nothing: the checkpoints were indexed by `commit_step` / `add_row`."""

    def _batch(self, rows: np.ndarray, old: np.ndarray, counts: np.ndarray,
               filled: list[Filled], decode: bool = False) -> StateBatch:
        """The `StateBatch` of `rows` (their tokens packed in order, ``counts`` each after
        ``old``; `decode`: one each), offering a checkpoint after each block in `filled`."""
        taken, slots, ends = self._offer(filled)
        tensors = (torch.from_numpy(self.slots.live_of(rows)),
                   torch.from_numpy(self._position_of(rows).take(taken) if decode and taken.size
                                    # a block fills at a row's one token: its place
                                    else self._emit_tokens(rows, old, counts, taken, ends)),
                   torch.from_numpy(slots))
        device = self.slab.device
        if device.type != "cpu":  # shipped once, as `StepBatch.from_host` ships its own
            tensors = tuple(tensor.to(device) for tensor in tensors)
        return StateBatch(*tensors)

    def _offer(self, filled: list[Filled]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Offer a checkpoint after each block in `filled`, in one batch:
        ``(rows, slots, ends)``, ``[E]`` int64 each, of the offers that took a slot, in
        order (``ends``: the position the checkpoint is at)."""
        block_size, suffix = self.tables.block_size, group_suffix(self.index)
        junction, n = self.junction, len(filled)
        rows = np.fromiter(map(operator.itemgetter(0), filled), np.int64, n)
        ends = (np.fromiter(map(operator.itemgetter(1), filled), np.int64, n) + 1) * block_size
        keys = list(map(operator.add, map(operator.itemgetter(2), filled),
                        itertools.repeat(suffix)))
        shared = np.zeros(n, dtype=bool)
        if junction and not junction.keys().isdisjoint(rows.tolist()):
            shared[:] = [junction.get(row) == end
                         for row, end in zip(rows.tolist(), ends.tolist(), strict=True)]
        if self.slots.shares is None:
            slots = self.slots.offer_arrays(keys, ends, rows, shared)
        else:  # tenants: each through `offer`, with its row's tenant
            tenants = [self.tenant.get(row, 0) for row in rows.tolist()]
            found = self.slots.offer_all(list(zip(keys, ends.tolist(), rows.tolist(),
                                                  shared.tolist(), tenants, strict=True)))
            slots = np.array([-1 if slot is None else slot for slot in found], dtype=np.int64)
        took = slots >= 0
        if took.all():
            return rows, slots, ends
        return rows[took], slots[took], ends[took]

    def _emit_tokens(self, rows: np.ndarray, old: np.ndarray, counts: np.ndarray,
                     taken: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """``[E]`` int64 index in the step's packed tokens (``counts`` per row of `rows`,
        after ``old``) of the token before position ``ends[i]`` of row ``taken[i]``: in
        arrays, once a step (numpy scalars per block cost ~2 us each)."""
        if not taken.size:
            return np.zeros(0, dtype=np.int64)
        i = self._position_of(rows)[taken]  # each row's place in the step
        return (np.cumsum(counts) - counts)[i] + ends - 1 - old[i]

    def _position_of(self, rows: np.ndarray) -> np.ndarray:
        """``[rows.max() + 1]`` int64: each of `rows`' index in it (garbage elsewhere).
        Kept for a read-only rows array (a decode step's handles, the same every step
        while the running set is)."""
        kept, position_of = self._positions
        if rows is kept and not rows.flags.writeable:
            return position_of
        position_of = np.zeros(int(rows.max()) + 1, dtype=np.int64)
        position_of[rows] = np.arange(rows.size)
        if not rows.flags.writeable:
            self._positions = (rows, position_of)
        return position_of

    # -- the lifecycle ---------------------------------------------------------------------
    def check_fork(self, parent: SeqId, what: str) -> None:
        """`OutOfStateSlotsError` unless a slot is obtainable for the child's state."""
        self._require_state([self.tables.row_of[parent]], what)
        if self.slots.obtainable() < 1:
            raise OutOfStateSlotsError(1, 0, what)

    def fork(self, allocator: BlockAllocator, parent: SeqId, child: SeqId) -> None:
        """`child`'s row, and a live slot holding a copy of `parent`'s state."""
        row = self.tables.fork(parent, child)
        if self.slots.shares is not None:
            self.tenant[row] = self.tenant.get(self.tables.row_of[parent], 0)
        slot = self.slots.take_live(row)
        self.slab.copy(int(self.slots.live_of([self.tables.row_of[parent]])[0]), slot)

    def remove(self, allocator: BlockAllocator, seq_id: SeqId, retain: dict) -> None:
        """Drop the row: its last step's checkpoints are written (it ran), its live slot
        goes free (a swapped row's host copy is dropped)."""
        row = self.tables.row_of[seq_id]
        self.slots.confirm([row])
        if self.host.pop(seq_id, None) is None:
            self.slots.release_live(row)
        self.junction.pop(row, None)
        self.tenant.pop(row, None)
        self.lost.discard(row)
        self.tables.remove(seq_id)

    def check_truncate(self, allocator: BlockAllocator, seq_id: SeqId, num_tokens: int,
                       unwritten: bool) -> None:
        """ValueError unless the live state after `num_tokens` can be restored: 0 tokens,
        the row's own length, or a written checkpoint there, the row's own last ones
        included (its tokens were written: it rolls back tokens it computed); after a
        failed step (`unwritten`) never: an unknown state is marked lost instead."""
        row = self.tables.row_of[seq_id]
        current = int(self.tables.num_tokens[row])
        if unwritten or num_tokens in (0, current):
            return
        if self._restore_point(allocator, row, num_tokens, own=True) is None:
            raise ValueError(
                f"truncate(): {seq_id!r}'s recurrent layers hold its state after {current} "
                f"tokens and no state checkpoint at {num_tokens}: truncate to 0 or to a "
                f"block boundary with a checkpoint, or free it and admit it again")

    def truncate(self, allocator: BlockAllocator, seq_id: SeqId, num_tokens: int,
                 unwritten: bool) -> None:
        """Restore the live state after `num_tokens` (`unwritten`: the failed step's
        checkpoints past them go first, and a state that cannot be restored is lost)."""
        row = self.tables.row_of[seq_id]
        current = int(self.tables.num_tokens[row])
        if unwritten:
            self.slots.drop_pending(row, num_tokens)
        else:  # its forward ran: what it computed was written
            self.slots.confirm([row])
        if num_tokens < current:
            live = int(self.slots.live_of([row])[0])
            source = self._restore_point(allocator, row, num_tokens) if num_tokens else None
            if num_tokens == 0:
                self.slab.zero(live)
            elif source is not None:
                self.slab.copy(source, live)
            if num_tokens == 0 or source is not None:
                self.lost.discard(row)
            else:  # only after a failed step: check_truncate refused any other
                self.lost.add(row)
        self.tables.set_num_tokens(np.array([row]), np.array([num_tokens]))

    def _restore_point(self, allocator: BlockAllocator, row: int, num_tokens: int,
                       own: bool = False) -> int | None:
        """The written checkpoint after the row's first `num_tokens` tokens, or None
        (`own`: the row's pending ones count as written)."""
        column = num_tokens // self.tables.block_size - 1
        if num_tokens % self.tables.block_size or column < 0:
            return None
        block = int(self.leader.block_ids[row, column])
        key = allocator.block_hash(block) if block else None
        return None if key is None else self.slots.find(group_key(key, self.index),
                                                         row if own else None)

    def _require_state(self, rows: list[int], what: str) -> None:
        """PagedKVError, naming the first, if a row's state was lost (see `truncate`)."""
        if self.lost.isdisjoint(rows):
            return
        seq_of = {row: seq_id for seq_id, row in self.tables.row_of.items()}
        lost = [seq_of[row] for row in rows if row in self.lost]
        if lost:
            raise PagedKVError(
                f"{what}: the recurrent state of {lost[0]!r} was lost when a failed step "
                f"was rolled back (truncate(unwritten=True) to a length with no state "
                f"checkpoint): free it and admit it again")

    def check_swap(self, seq_id: SeqId, what: str, out: bool) -> None:
        """Out: the row's state is known and the host holds fewer than `num_state_slots`
        copies; in: a live slot is obtainable."""
        if out:
            self._require_state([self.tables.row_of[seq_id]], what)
            if len(self.host) >= self.slots.num_slots:
                raise OutOfBlocksError(1, 0, f"{what} host state copies (at most "
                                             f"num_state_slots={self.slots.num_slots})")
        elif self.slots.obtainable() < 1:
            raise OutOfStateSlotsError(1, 0, what)

    def swap_row(self, seq_id: SeqId, out: bool) -> None:
        """Move the row's live state to a host copy (its last step ran: its checkpoints
        are written) and free the slot, or back into a fresh live slot."""
        row = self.tables.row_of[seq_id]
        if out:
            self.slots.confirm([row])
            self.host[seq_id] = self.slab.save(int(self.slots.live_of([row])[0]))
            self.slots.release_live(row)
        else:
            self.slab.load(self.slots.take_live(row), self.host.pop(seq_id))
        self.tables.set_swapped(seq_id, np.zeros(0, dtype=np.int64), out)

    # -- accounting and checking -----------------------------------------------------------
    def block_counts(self, block_size: int) -> None:
        return None

    def stat_fields(self, stats: CacheStats) -> dict:
        """The slab's bytes (in ``total_bytes`` too), live states and checkpoints."""
        slots, nbytes = self.slots, self.slab.nbytes
        return dict(total_bytes=stats.total_bytes + nbytes, state_bytes=nbytes,
                    num_live_states=slots.num_live, num_checkpoints=slots.num_checkpoints,
                    checkpoint_bytes=slots.num_checkpoints * nbytes // slots.num_slots,
                    checkpoints_written=slots.num_written, checkpoints_hit=slots.num_hits,
                    checkpoints_evicted=slots.num_evicted)

    def check_rows(self, leader: PageTables, num_blocks: int) -> np.ndarray:
        """The rows follow the leader's and hold no block; the slots partition the slab
        and the live ones are exactly the rows'."""
        tables = self.tables
        ensure(tables.row_of == leader.row_of, f"group {self.index}'s rows diverged")
        rows = leader.rows()
        ensure(np.array_equal(tables.num_tokens[rows], leader.num_tokens[rows]),
               f"group {self.index}'s token counts diverged")
        ensure(not tables.num_blocks.any(), "a state group's row holds blocks")
        ensure(self.lost <= set(rows.tolist()), "a lost state of no row")
        swapped = tables.swapped[rows]
        ensure({tables.row_of[seq_id] for seq_id in self.host} == set(rows[swapped].tolist()),
               "host state copies are not the swapped rows'")
        self.slots.check(rows[~swapped].tolist())
        return tables.owners(num_blocks)

    def host_owners(self, num_host_blocks: int) -> np.ndarray:
        return np.zeros(num_host_blocks, dtype=np.int64)

    def check_host(self, host: np.ndarray) -> None:
        """Nothing: the group has no swap space."""

    def snapshot(self) -> tuple:
        return (*super().snapshot(), self.slots.snapshot(), self.slab.snapshot(),
                tuple(sorted(self.lost)), tuple(sorted(self.junction.items())),
                tuple((repr(seq_id), tuple(bytes(t.contiguous().view(torch.uint8).numpy())
                                           for t in saved))
                      for seq_id, saved in sorted(self.host.items(), key=repr)))

    # -- the worker side -------------------------------------------------------------------
    def batch_of(self, batch: StepBatch, what: str) -> StateBatch:
        """The `StateBatch` in `batch` (ValueError for a batch of another cache)."""
        groups = batch.groups
        if len(groups) <= self.index or not isinstance(groups[self.index], StateBatch):
            raise ValueError(f"{what}: batch: not a StepBatch this cache's prepare() "
                             f"returned (it has no recurrent-state entry)")
        return groups[self.index]
