"""`CheckpointPolicy`: which written state checkpoint goes first when a slot is wanted.

A checkpoint's *tier* says what it is likely worth to a later prompt; the policy keeps the
higher tiers under pressure (Marconi's admission by likely reuse) and, within a tier, the
most recently used. `StateSlots` (`paged_kv.core.groups.state`) is its only caller.

The ranks and their heap live in int64 arrays, and the heap's loops are functions over
them in `paged_kv.core.groups.slot_loops` (compiled by numba where the ``fast`` extra is
installed, plain Python otherwise, with the same results): a decode step offers a
checkpoint for every block that fills (~64 a step at 1,024 rows), and `StateSlots`' offer
loop, compiled beside them, calls them without going back to Python.
"""

from __future__ import annotations

import numpy as np

from .slot_loops import (  # noqa: F401  (the tiers are named here, where the policy is)
    CLOCK,
    COMPILED,
    COUNT,
    DENSE,
    INTERVAL,
    LATEST,
    MAX_SLOTS,
    SHARED,
    SIZE,
    SLOT_MASK,
    TIER_SHIFT,
    USE_LIMIT,
    add_all,
    evict_retier,
    pop,
    push,
    rebuild,
    retier_written,
    victim,
)


class CheckpointPolicy:
    """Which written checkpoint goes first when a slot is wanted: the lowest tier
    (`DENSE` < `INTERVAL` < `LATEST` < `SHARED`), then the least recently used (added or
    served).
    A heap with lazy deletion: O(log n) a choice.

    The one place the ranking lives: `StateSlots` calls `add`, `touch`, `retier`,
    `remove`, `victim` and `admits` only, or `slot_loops`' functions on the arrays
    (`rank`, `heap`, `meta`) of a policy of exactly this class.

    Every checkpoint saves one state's bytes of memory for the prefill it spares, so
    among its tier the one least likely to be reused goes first: a boundary inside one
    request's own suffix (`DENSE`) before any request's last one (`LATEST`, a multi-turn
    conversation's next turn), and both before a boundary two prompts shared (`SHARED`).

    Attributes
    ----------
    rank : np.ndarray
        ``[capacity]`` int64: each slot's rank, or -1 (not ranked).
    heap : np.ndarray
        int64 ranks, a heap in its first ``meta[SIZE]`` entries, some stale.
    meta : np.ndarray
        ``[3]`` int64: the heap's size, the use clock, the ranked slots.
    """

    def __init__(self) -> None:
        self.rank = np.full(0, -1, dtype=np.int64)
        # compiled: an array (room reserved ahead); else a list heapq keeps (`slot_loops`)
        self.heap = np.zeros(64, dtype=np.int64) if COMPILED else []
        self.meta = np.zeros(3, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.meta[COUNT])

    def __contains__(self, slot: object) -> bool:
        return (isinstance(slot, (int, np.integer)) and 0 <= slot < self.rank.size
                and self.rank[slot] >= 0)

    def ranks(self) -> dict[int, int]:
        """``{slot: rank}`` of every ranked slot (for checks and tests)."""
        ranked = np.flatnonzero(self.rank >= 0)
        return dict(zip(ranked.tolist(), self.rank[ranked].tolist(), strict=True))

    def entries(self) -> list[int]:
        """The heap's entries, stale ones included, in heap order (for tests)."""
        return [int(entry) for entry in self.heap[:self.meta[SIZE]]]

    def reserve(self, num_slots: int, pushes: int) -> None:
        """Room for slots below `num_slots` and `pushes` more heap entries (stale ones
        dropped first when they are most of it), and uses for as many: called before
        any function above that ranks or pushes."""
        if num_slots > MAX_SLOTS:
            raise ValueError(f"a checkpoint policy ranks at most {MAX_SLOTS} slots, "
                             f"got {num_slots}")
        if num_slots > self.rank.size:
            rank = np.full(max(num_slots, 2 * self.rank.size), -1, dtype=np.int64)
            rank[:self.rank.size] = self.rank
            self.rank = rank
        meta = self.meta
        if meta[CLOCK] + pushes >= USE_LIMIT:
            rebuild(self.rank, self.heap, meta, True)
        if COMPILED and meta[SIZE] + pushes > self.heap.size:
            self._drop_stale()
            if meta[SIZE] + pushes > self.heap.size:
                heap = np.zeros(max(2 * self.heap.size, meta[SIZE] + pushes), dtype=np.int64)
                heap[:meta[SIZE]] = self.heap[:meta[SIZE]]
                self.heap = heap

    def add(self, slot: int, tier: int) -> None:
        """Make `slot`, a written checkpoint of `tier`, evictable (the most recent)."""
        self.add_all([slot], [tier])

    def add_all(self, slots, tiers) -> None:
        """`add` of each of `slots` (distinct) at its tier in `tiers`, in order: the same
        ranks (and so the same victims) in one call."""
        slots = np.asarray(slots, dtype=np.int64)
        tiers = np.asarray(tiers, dtype=np.int64)
        if slots.size != tiers.size:
            raise ValueError(f"add_all: {slots.size} slots but {tiers.size} tiers")
        if not slots.size:
            return
        self.reserve(int(slots.max()) + 1, slots.size)
        add_all(self.rank, self.heap, self.meta, slots, tiers)
        self._drop_stale()

    def _drop_stale(self) -> None:
        """The heap made again of the ranked entries when stale ones are most of it."""
        if self.meta[SIZE] > 2 * self.meta[COUNT] + 64:
            rebuild(self.rank, self.heap, self.meta, False)

    def tier_of(self, slot: int) -> int:
        """`slot`'s tier (KeyError when the policy does not rank it)."""
        if slot not in self:
            raise KeyError(slot)
        return int(self.rank[slot] >> TIER_SHIFT)

    def touch(self, slot: int) -> None:
        """`slot` was served: it is now the most recently used of its tier."""
        self.add(slot, self.tier_of(slot))

    def retier(self, slot: int, tier: int) -> None:
        """`slot` moves to `tier` (its use unchanged)."""
        if slot not in self:
            raise KeyError(slot)
        self.retier_written(slot, tier)

    def retier_written(self, slot: int, tier: int) -> None:
        """`retier` of `slot` if it is a written checkpoint (the policy's); else nothing."""
        self.reserve(0, 1)
        retier_written(self.rank, self.heap, self.meta, slot, tier)

    def remove(self, slot: int) -> None:
        """`slot` is no checkpoint any more."""
        if slot not in self:
            raise KeyError(slot)
        self.rank[slot] = -1
        self.meta[COUNT] -= 1

    def victim(self, exclude: int | None = None, allowed=None) -> int | None:
        """The checkpoint to evict first (never `exclude`; with `allowed`, ``slot ->
        bool``, only one it allows: a tenant's share), or None when there is none."""
        rank, heap, meta = self.rank, self.heap, self.meta
        if allowed is None:
            self.reserve(0, 1)
            found = victim(rank, heap, meta, -1 if exclude is None else exclude)
            return None if found < 0 else int(found)
        held, found = [], None
        while meta[SIZE]:
            entry = int(heap[0])
            slot = entry & SLOT_MASK
            if rank[slot] != entry:
                pop(heap, meta)  # stale: removed, touched or re-tiered since
            elif slot == exclude or not allowed(slot):
                held.append(int(pop(heap, meta)))
            else:
                found = slot
                break
        for entry in held:
            push(heap, meta, entry)
        return found

    def evict_below(self, tier: int) -> int | None:
        """`victim` (no exclusion), removed when a new checkpoint of `tier` ranks above it
        (`admits`); else None (no checkpoint, or none ranks at or below `tier`)."""
        return self.evict_retier(tier, -1, 0)

    def evict_retier(self, tier: int, previous: int, lower: int) -> int | None:
        """`evict_below(tier)`, then, when it evicted and `previous` (-1: none) is another
        written checkpoint, `retier_written(previous, lower)`: the same heap and ranks as
        those two calls, in one (the module function `evict_retier`)."""
        found = evict_retier(self.rank, self.heap, self.meta, tier, previous, lower)
        return None if found < 0 else int(found)

    def admits(self, tier: int, victim: int) -> bool:
        """Whether a new checkpoint of `tier` ranks above `victim` (so `victim` may go for
        it): a higher tier, or the same tier and newer (it always is)."""
        return self.tier_of(victim) <= tier
