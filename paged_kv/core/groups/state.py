"""The state slab and its slots: where recurrent layers keep their states, beside the pool.

A recurrent layer keeps a fixed-size state per sequence (`paged_kv.config.StateSpec`: a
convolution window, an SSM or delta-rule state), not K/V per token. The cache keeps them
in a slab of state-sized slots allocated once beside the block pool: per recurrent layer
and per state one tensor ``[num_state_slots, *spec.shape]``, so slot ``s`` of every one of
them is one sequence's states (kernels index the states by slot, as vLLM's and SGLang's
do). A slot is in exactly one state:

- *free*;
- *live*: a resident sequence's state, read and written by each of its steps;
- *checkpoint*: a copy of a sequence's states at a block boundary, indexed under that
  block's group key (`paged_kv.core.groups.rules.group_key`), so a later prompt that
  shares the prefix to that boundary starts from it (copied into its own live slot).
  A checkpoint is *pending* from the commit that takes it until the forward that writes
  it is known to have run (the taking row's next step, or its removal): a pending one is
  neither served nor evicted. A written one is evictable: `CheckpointPolicy` chooses
  which goes when a slot is wanted.

`StateSlots` keeps that bookkeeping (ints, never tensors), `StateSlab` the tensors
(`paged_kv.core.groups.state_slab`).
"""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Sequence

import numpy as np

from ...errors import OutOfBlocksError, PagedKVError, ensure
from .checkpoints import DENSE, LATEST, MAX_SLOTS, SHARED, CheckpointPolicy
from .slot_loops import lowered, offer_rows, warm
from .state_checks import SlotChecks
from .state_tenants import CheckpointShares


class OutOfStateSlotsError(OutOfBlocksError):
    """A call needed more state slots than the slab can give; nothing was changed (an
    `OutOfBlocksError`, so a scheduler that backs off on one backs off on both)."""

    def __init__(self, requested: int, free: int, what: str) -> None:
        self.requested, self.free = requested, free
        PagedKVError.__init__(
            self, f"{what}: out of state slots: requested {requested}, only {free} "
                  f"obtainable (free + evictable checkpoints); free finished sequences, "
                  f"preempt one, or raise num_state_slots")


class StateSlots(SlotChecks):
    """Which slot of the state slab is free, live (a row's) or a checkpoint (a key's);
    see the module docstring. Never touches a tensor.

    Parameters
    ----------
    num_slots : int
        Slots in the slab (`CacheConfig.num_state_slots`).
    policy : CheckpointPolicy, optional
        Which written checkpoint goes first (default: lowest tier, then LRU).
    interval : int
        Tokens between the interior boundaries kept at the `INTERVAL` tier (0: none).
    shares : CheckpointShares, optional
        Each tenant's quota and reservation of checkpoints (None: no tenants).
    """

    def __init__(self, num_slots: int, policy: CheckpointPolicy | None = None,
                 interval: int = 0, shares: CheckpointShares | None = None) -> None:
        ensure(num_slots <= MAX_SLOTS, f"num_state_slots: at most {MAX_SLOTS}, got {num_slots}")
        self.num_slots, self.interval, self.shares = num_slots, interval, shares
        warm()
        self.policy = CheckpointPolicy() if policy is None else policy
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives 0, 1, ...
        self._live: dict[int, int] = {}                  # row -> its live slot
        # by row (-1: none), so a step reads every row's at once: its live slot, and its
        # newest checkpoint's slot (a decode step's offers lower the one before)
        self._live_by_row = np.full(64, -1, dtype=np.int64)
        self._latest = np.full(64, -1, dtype=np.int64)
        # the last read-only rows array a confirm was given, and its rows as a set
        self._stepped_of: tuple[np.ndarray | None, frozenset[int]] = (None, frozenset())
        self._slot_of: dict[bytes, int] = {}             # checkpoint key -> slot
        self._key_of: dict[int, tuple[bytes, int]] = {}  # checkpoint slot -> (key, position)
        self._pending: dict[int, list[bytes]] = {}       # row -> keys its last commit took
        # by checkpoint slot: its tier (-1: not a checkpoint), the row it is newest of (-1:
        # none) and its position (as in `_key_of`); arrays, which the offers' loop updates
        self._tier = np.full(num_slots, -1, dtype=np.int8)
        self._latest_of = np.full(num_slots, -1, dtype=np.int64)
        self._position = np.zeros(num_slots, dtype=np.int64)
        self._key_scratch = np.full(num_slots, -1, dtype=np.int64)  # the loop's, -1 between
        self.num_written = self.num_hits = self.num_evicted = 0  # checkpoints, so far
        # ("stored" | "removed", slot, key): a checkpoint became servable or went, for the
        # tiers and KV events (bounded as the allocator's events: a user who never drains
        # them does not leak memory)
        self.events: collections.deque[tuple[str, int, bytes]] = collections.deque(
            maxlen=65536)

    # -- queries --------------------------------------------------------------------------
    def live_of(self, rows: Sequence[int]) -> np.ndarray:
        """``[len(rows)]`` int64 live slot of each row."""
        if isinstance(rows, np.ndarray):
            return self._live_by_row[rows]
        return np.fromiter(map(self._live.__getitem__, rows), dtype=np.int64, count=len(rows))

    @property
    def num_live(self) -> int:
        """Slots holding a resident sequence's state."""
        return len(self._live)

    @property
    def num_checkpoints(self) -> int:
        """Slots holding a checkpoint (pending ones included)."""
        return len(self._key_of)

    def obtainable(self, exclude: int | None = None) -> int:
        """Slots a live state can take now: free, or a written checkpoint evicted (less
        `exclude`, the checkpoint an admission copies from)."""
        return len(self._free) + len(self.policy) - (exclude in self.policy)

    def find(self, key: bytes, row: int | None = None) -> int | None:
        """The written checkpoint indexed under `key`, or None: a pending one is not
        served (its forward may not have run), unless `row` took it and says it ran."""
        slot = self._slot_of.get(key)
        if slot in self.policy or (row is not None and key in self._pending.get(row, ())):
            return slot
        return None

    def checkpoints(self) -> list[tuple[bytes, int, int]]:
        """``(key, slot, position)`` of every written checkpoint (servable, evictable)."""
        return [(key, slot, position) for slot, (key, position) in self._key_of.items()
                if slot in self.policy]

    def position_of(self, slot: int) -> int:
        """Tokens a checkpoint's state has consumed."""
        return self._key_of[slot][1]

    def written_key(self, slot: int) -> bytes | None:
        """The key of the written checkpoint in `slot`, or None (free, live, pending)."""
        return self._key_of[slot][0] if slot in self.policy else None

    # -- mutators -------------------------------------------------------------------------
    def take_live(self, row: int, exclude: int | None = None) -> int:
        """Give `row` a live slot: a free one, else the policy's victim (never `exclude`).
        The caller checked `obtainable`."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = self.policy.victim(exclude)
            ensure(slot is not None, "no state slot to take (obtainable() was not checked)")
            self._evict(slot)
        self._live[row] = slot
        self._grow_rows(row + 1)
        self._live_by_row[row] = slot
        return slot

    def _grow_rows(self, num_rows: int) -> None:
        """The by-row arrays hold at least `num_rows` rows."""
        size = len(self._live_by_row)
        if num_rows > size:
            for name in ("_live_by_row", "_latest"):
                grown = np.full(max(2 * size, num_rows), -1, dtype=np.int64)
                grown[:size] = getattr(self, name)
                setattr(self, name, grown)

    def release_live(self, row: int) -> None:
        """`row` is gone (or swapped out): its live slot is free; its newest checkpoint
        keeps the `LATEST` tier (a finished request's next turn starts there)."""
        self._free.append(self._live.pop(row))
        self._live_by_row[row] = -1
        slot, self._latest[row] = self._latest[row], -1
        if slot >= 0:
            self._latest_of[slot] = -1

    def served(self, slot: int) -> None:
        """A checkpoint was copied into an admitted sequence's live slot: it is used now,
        and at least `LATEST` (an interior boundary two prompts shared). Not `SHARED`:
        a multi-turn conversation is served its last turn's tail once and moves on, and
        tails served once would crowd out the tails still to be served."""
        self.num_hits += 1
        if self._tier[slot] == DENSE:
            self._retier(slot, LATEST)
        self.policy.touch(slot)

    def offer(self, key: bytes, position: int, row: int, shared: bool = False,
              tenant: int = 0) -> int | None:
        """A slot for the checkpoint of `row` after `position` tokens, indexed under `key`
        (pending until `confirm`), or None: the key is indexed already, or no slot is free
        and no written checkpoint ranks below it (dense while there is room, thinned by
        tier under pressure). It is the row's newest (`LATEST`; the one before drops to
        `DENSE`), or a junction where prompts met (`shared`: `SHARED`)."""
        if key in self._slot_of:
            return None
        tier = SHARED if shared else LATEST
        # a free slot straight off the stack when no tenant can be at its quota (this runs
        # for every block that fills: ~64 a decode step at 1,024 rows)
        slot = (self._free.pop() if self._free and self.shares is None
                else self._slot_for(tier, tenant))
        if slot is None:
            return None
        self._index(slot, key, position, tier, tenant)
        pending = self._pending.get(row)
        if pending is None:
            self._pending[row] = [key]
        else:
            pending.append(key)
        self._grow_rows(row + 1)
        previous = int(self._latest[row])
        if previous >= 0:
            lower = lowered(self._tier, self._position, self.interval, previous)
            if lower >= 0:
                self._retier(previous, lower)
            self._latest_of[previous] = -1
        self._latest[row], self._latest_of[slot] = slot, row
        self.num_written += 1
        return slot

    def offer_all(self, offers: list[tuple[bytes, int, int, bool, int]],
                  ) -> list[int | None]:
        """`offer` of each ``(key, position, row, shared, tenant)`` in order; each one's
        slot or None: the same slots, ranks, evictions, events and counts as one `offer`
        after another (through `offer_arrays` where there are no tenants)."""
        if self.shares is not None or not offers:
            return [self.offer(*offer) for offer in offers]
        keys, positions, rows, shared, _ = zip(*offers, strict=True)
        taken = self.offer_arrays(list(keys), np.array(positions, dtype=np.int64),
                                  np.array(rows, dtype=np.int64), np.array(shared, dtype=bool))
        return [None if slot < 0 else slot for slot in taken.tolist()]

    def offer_arrays(self, keys: list[bytes], positions: np.ndarray, rows: np.ndarray,
                     shared: np.ndarray) -> np.ndarray:
        """`offer_all` without tenants, in arrays: ``[N]`` int64 each offer's slot, or -1.

        Parameters
        ----------
        keys : list of bytes
            ``[N]`` the checkpoints' keys.
        positions, rows : np.ndarray
            ``[N]`` int64: tokens each one's state has consumed, and the row taking it.
        shared : np.ndarray
            ``[N]`` bool: a junction where prompts met (`SHARED`).

        A step offers one per block that filled, ~64 a decode step at 1,024 rows: the
        slot bookkeeping runs in one compiled loop (`slot_loops.offer_rows`), the key
        index, events and pending keys in bulk here (~0.3 us an offer, ~2 us through
        `offer`). A key repeated in the call is offered again only while no earlier offer
        of it holds a slot, as `offer` after `offer` would. A policy of another class
        (its own ranking) goes through `offer` one by one.
        """
        n, policy = len(keys), self.policy
        ensure(self.shares is None, "offer_arrays: checkpoints with tenants go through offer")
        if type(policy) is not CheckpointPolicy:
            taken = [self.offer(*offer, 0) for offer in zip(
                keys, positions.tolist(), rows.tolist(), shared.tolist(), strict=True)]
            return np.array([-1 if slot is None else slot for slot in taken], dtype=np.int64)
        # C-contiguous, writable and of one dtype each (copied only where they are not):
        # the types the loop was compiled for
        rows, positions = np.require(rows, np.int64, "CW"), np.require(positions, np.int64, "CW")
        shared = np.require(shared, np.bool_, "CW")
        slot_of, free = self._slot_of, self._free
        numbered, distinct = _numbered(keys)
        key_slot = np.fromiter(map(slot_of.get, distinct, itertools.repeat(-1)), np.int64,
                               len(distinct))
        free_tail = np.array(free[max(len(free) - n, 0):], dtype=np.int64)
        self._grow_rows(int(rows.max()) + 1 if n else 0)
        policy.reserve(self.num_slots, n)
        taken, victims = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        used, evicted = offer_rows(rows, shared, numbered, key_slot, self._key_scratch,
                                   positions, free_tail, self._tier, self._latest,
                                   self._latest_of, self._position, self.interval,
                                   policy.rank, policy.heap, policy.meta, taken, victims)
        if used:
            del free[len(free) - used:]
        if evicted:
            self._evicted_all(victims[victims >= 0].tolist())
        self._indexed_all(keys, positions, rows, taken)
        return taken

    def _evicted_all(self, slots: list[int]) -> None:
        """The offers' loop evicted `slots` (their tiers and newest-of entries are written
        already): their keys leave the index, in order, each announced."""
        keys = list(map(operator.itemgetter(0), map(self._key_of.pop, slots)))
        collections.deque(map(self._slot_of.__delitem__, keys), 0)
        self.events.extend(zip(itertools.repeat("removed"), slots, keys))
        self.num_evicted += len(slots)

    def _indexed_all(self, keys: list[bytes], positions: np.ndarray, rows: np.ndarray,
                     taken: np.ndarray) -> None:
        """The keys of the offers that took a slot (``taken >= 0``) enter the index and
        their rows' pending keys, in order."""
        took = taken >= 0
        if not took.all():
            keys = list(itertools.compress(keys, took.tolist()))
            positions, rows, taken = positions[took], rows[took], taken[took]
        slots, rows_ = taken.tolist(), rows.tolist()
        self._slot_of.update(zip(keys, slots, strict=True))
        self._key_of.update(zip(slots, zip(keys, positions.tolist(), strict=True), strict=True))
        pending = self._pending
        if len(set(rows_)) == len(rows_) and pending.keys().isdisjoint(rows_):
            pending.update(zip(rows_, map(list, zip(keys)), strict=True))  # one key a row
        else:
            for row, key in zip(rows_, keys, strict=True):
                pending.setdefault(row, []).append(key)
        self.num_written += len(slots)

    def _retier(self, slot: int, tier: int) -> None:
        self._tier[slot] = tier
        if slot in self.policy:
            self.policy.retier(slot, tier)

    def confirm(self, rows: Sequence[int]) -> None:
        """The checkpoints these rows' last commit took were written (their forward ran):
        servable and evictable from now on."""
        pending = self._pending
        if not pending:
            return
        if len(pending) < len(rows):  # a decode step: few rows took any
            stepped = self._stepped(rows)
            rows = (None if stepped.issuperset(pending)  # each stepped: a set test in C
                    else [row for row in pending if row in stepped])  # in the pending order
        if rows is None:
            keys = [key for keys in pending.values() for key in keys]
            pending.clear()
        else:
            pop = pending.pop
            keys = [key for row in rows for key in pop(row, ())]
        slot_of = self._slot_of
        if keys:
            self._servable_all([slot_of[key] for key in keys], keys)

    def _stepped(self, rows: Sequence[int]) -> frozenset[int]:
        """`rows` as a set, kept for a read-only rows array (a decode step's handles, the
        same array every step while the running set is): a step's confirm picks its
        pending rows with a set lookup each, not an array built from them per step."""
        kept, stepped = self._stepped_of
        if rows is kept and not rows.flags.writeable:
            return stepped
        stepped = frozenset(rows.tolist() if isinstance(rows, np.ndarray) else rows)
        if isinstance(rows, np.ndarray) and not rows.flags.writeable:
            self._stepped_of = (rows, stepped)
        return stepped

    def _servable(self, slot: int) -> None:
        """A pending checkpoint was written: evictable, servable, and announced."""
        self._servable_all([slot], [self._key_of[slot][0]])

    def _servable_all(self, slots: list[int], keys: list[bytes]) -> None:
        """`_servable` of each of `slots` (under `keys`), in order, in one call each to
        the policy and the events."""
        self.policy.add_all(slots, self._tier[np.asarray(slots, dtype=np.int64)])
        self.events.extend(zip(itertools.repeat("stored"), slots, keys))

    def adopt(self, key: bytes, position: int, tenant: int = 0) -> int | None:
        """A slot for a written checkpoint after `position` tokens that came from
        elsewhere (a lower tier, a hand-off), indexed under `key` at the `LATEST` tier (a
        prompt is about to start from it), or None: the key is indexed already, or no slot
        is free and no written checkpoint ranks below it. The caller fills the slot."""
        slot = None if key in self._slot_of else self._slot_for(LATEST, tenant)
        if slot is not None:
            self._index(slot, key, position, LATEST, tenant)
            self.num_written += 1
            self._servable(slot)
        return slot

    def _slot_for(self, tier: int, tenant: int) -> int | None:
        """A slot for a new checkpoint of `tier` and `tenant`: a free one, else the
        policy's victim ranking below it (a tenant at its quota: its own; see
        `CheckpointShares`), evicted; or None."""
        shares, allowed, full = self.shares, None, False
        if shares is not None:
            full = shares.at_quota(tenant)
            allowed = shares.own(tenant) if full else shares.evictable_by(tenant)
        if self._free and not full:
            return self._free.pop()
        slot = self.policy.victim(allowed=allowed)
        if slot is None or not self.policy.admits(tier, slot):
            return None
        self._evict(slot)
        return slot

    def _index(self, slot: int, key: bytes, position: int, tier: int, tenant: int) -> None:
        self._slot_of[key], self._key_of[slot] = slot, (key, position)
        self._tier[slot], self._position[slot] = tier, position
        if self.shares is not None:
            self.shares.add(slot, tenant)

    def written(self, slots: Sequence[int]) -> None:
        """The checkpoints in `slots` hold their states (every recurrent layer wrote them):
        servable and evictable now, before their rows' next commit, so that the next
        admission may evict them rather than find no slot."""
        keys = {self._key_of[slot][0] for slot in slots if slot in self._key_of}
        for row in [row for row, pending in self._pending.items() if keys & set(pending)]:
            left = [key for key in self._pending[row] if key not in keys]
            for key in self._pending[row]:
                if key in keys:
                    self._servable(self._slot_of[key])
            if left:
                self._pending[row] = left
            else:
                del self._pending[row]

    def drop_pending(self, row: int, num_tokens: int) -> None:
        """`row`'s last step failed past `num_tokens` tokens: the checkpoints it took after
        them were never written, and go (their slots free); those up to it were."""
        for key in self._pending.pop(row, ()):
            slot = self._slot_of[key]
            if self._key_of[slot][1] <= num_tokens:
                self._servable(slot)
                continue
            del self._slot_of[key], self._key_of[slot]
            self._tier[slot] = -1
            self._unlatest(slot)
            self._free.append(slot)
            if self.shares is not None:
                self.shares.remove(slot)
            self.num_written -= 1

    def _evict(self, slot: int) -> None:
        self.policy.remove(slot)
        self._evicted(slot)

    def _evicted(self, slot: int) -> None:
        """`slot`'s checkpoint, gone from the policy, leaves the index (an eviction)."""
        key, _ = self._key_of.pop(slot)
        del self._slot_of[key]
        self._tier[slot] = -1
        if self.shares is not None:
            self.shares.remove(slot)
        self.events.append(("removed", slot, key))
        self._unlatest(slot)
        self.num_evicted += 1

    def _unlatest(self, slot: int) -> None:
        """`slot` is no checkpoint now: no row's newest."""
        row, self._latest_of[slot] = self._latest_of[slot], -1
        if row >= 0:
            self._latest[row] = -1


def _numbered(keys: list[bytes]) -> tuple[np.ndarray, list[bytes]]:
    """``[N]`` int64 each key's number among `keys`' distinct ones, in first-seen order, and
    those keys (a decode step's keys are distinct: numbered in order, no pass)."""
    if len(set(keys)) == len(keys):
        return np.arange(len(keys), dtype=np.int64), keys
    numbers: dict[bytes, int] = {}
    numbered = [numbers.setdefault(key, len(numbers)) for key in keys]
    return np.array(numbered, dtype=np.int64), list(numbers)
