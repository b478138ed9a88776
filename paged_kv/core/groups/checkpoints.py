"""`CheckpointPolicy`: which written state checkpoint goes first when a slot is wanted.

A checkpoint's *tier* says what it is likely worth to a later prompt; the policy keeps the
higher tiers under pressure (Marconi's admission by likely reuse) and, within a tier, the
most recently used. `StateSlots` (`paged_kv.core.groups.state`) is its only caller.
"""

from __future__ import annotations

import heapq
import itertools

# a checkpoint's tier: what it is likely worth to a later prompt (the policy keeps the
# higher tiers under pressure; Marconi's admission by likely reuse)
DENSE = 0     # an interior boundary, taken only because a slot was free
INTERVAL = 1  # an interior boundary on the sparse interval (a later prompt that shares
#               a prefix nobody has met at yet still hits near its junction)
LATEST = 2    # a sequence's last boundary (a finished request's next turn starts there),
#               or one served to a hit
SHARED = 3    # a junction: where a prompt's attention blocks hit past its state

# the fields of a rank (`CheckpointPolicy`): slot, last use, tier, from the low bits up
_USE, _TIER = 32, 96
_SLOT = (1 << _USE) - 1
_USE_AND_SLOT = (1 << _TIER) - 1


class CheckpointPolicy:
    """Which written checkpoint goes first when a slot is wanted: the lowest tier
    (`DENSE` < `INTERVAL` < `LATEST` < `SHARED`), then the least recently used (added or
    served).
    A heap with lazy deletion: O(log n) a choice.

    The one place the ranking lives: `StateSlots` calls `add`, `touch`, `retier`,
    `remove`, `victim` and `admits` only.

    Every checkpoint saves one state's bytes of memory for the prefill it spares, so
    among its tier the one least likely to be reused goes first: a boundary inside one
    request's own suffix (`DENSE`) before any request's last one (`LATEST`, a multi-turn
    conversation's next turn), and both before a boundary two prompts shared (`SHARED`).
    """

    def __init__(self) -> None:
        # a rank is one int, ``tier << 96 | last use << 32 | slot``: it orders as the tuple
        # (tier, last use, slot) does, and a heap of ints compares in C where one of
        # tuples compared element by element (~3x slower a step's ~64 evictions)
        self._rank: dict[int, int] = {}  # slot -> its rank
        self._heap: list[int] = []       # ranks, some stale
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, slot: object) -> bool:
        return slot in self._rank

    def add(self, slot: int, tier: int) -> None:
        """Make `slot`, a written checkpoint of `tier`, evictable (the most recent)."""
        self.add_all([slot], [tier])

    def add_all(self, slots: list[int], tiers: list[int]) -> None:
        """`add` of each of `slots` (distinct) at its tier in `tiers`, in order: the same
        ranks (and so the same victims) in one call."""
        clock, rank, heap = self._clock, self._rank, self._heap
        for slot, tier in zip(slots, tiers, strict=True):
            rank[slot] = entry = tier << _TIER | next(clock) << _USE | slot
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(rank) + 64:  # drop the stale entries
            self._heap = list(rank.values())
            heapq.heapify(self._heap)

    def tier_of(self, slot: int) -> int:
        """`slot`'s tier."""
        return self._rank[slot] >> _TIER

    def touch(self, slot: int) -> None:
        """`slot` was served: it is now the most recently used of its tier."""
        self.add(slot, self.tier_of(slot))

    def retier(self, slot: int, tier: int) -> None:
        """`slot` moves to `tier` (its use unchanged)."""
        self._rank[slot] = entry = tier << _TIER | self._rank[slot] & _USE_AND_SLOT
        self._push(entry)

    def retier_written(self, slot: int, tier: int) -> None:
        """`retier` of `slot` if it is a written checkpoint (the policy's); else nothing."""
        entry = self._rank.get(slot)
        if entry is not None:
            self._rank[slot] = entry = tier << _TIER | entry & _USE_AND_SLOT
            self._push(entry)

    def _push(self, entry: int) -> None:
        """Put `entry` on the heap, in the top's place when that one is stale (one sift,
        not a pop and a push): a step's checkpoint offer evicts (`evict_below` leaves the
        victim's entry on top), then re-ranks the row's newest checkpoint, ~64 times a
        decode step at 1,024 rows."""
        heap = self._heap
        if heap and self._rank.get(heap[0] & _SLOT) != heap[0]:
            heapq.heapreplace(heap, entry)
        else:
            heapq.heappush(heap, entry)

    def remove(self, slot: int) -> None:
        """`slot` is no checkpoint any more."""
        del self._rank[slot]

    def victim(self, exclude: int | None = None, allowed=None) -> int | None:
        """The checkpoint to evict first (never `exclude`; with `allowed`, ``slot ->
        bool``, only one it allows: a tenant's share), or None when there is none."""
        heap, held, found = self._heap, [], None
        while heap:
            entry = heap[0]
            slot = entry & _SLOT
            if self._rank.get(slot) != entry:
                heapq.heappop(heap)  # stale: removed, touched or re-tiered since
            elif slot == exclude or (allowed is not None and not allowed(slot)):
                held.append(heapq.heappop(heap))
            else:
                found = slot
                break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def evict_below(self, tier: int) -> int | None:
        """`victim` (no exclusion), removed when a new checkpoint of `tier` ranks above it
        (`admits`); else None (no checkpoint, or none ranks at or below `tier`). The same
        heap and ranks as those three calls, in one: a step offers a checkpoint per block
        that fills (~64 a decode step at 1,024 rows), each evicting one: `evict_retier`
        with no checkpoint to lower."""
        return self.evict_retier(tier, -1, 0)

    def evict_retier(self, tier: int, previous: int, lower: int) -> int | None:
        """`evict_below(tier)`, then, when it evicted and `previous` (-1: none) is another
        written checkpoint, `retier_written(previous, lower)`: the same heap and ranks as
        those two calls, in one. A decode step's offer evicts for its row's new newest
        checkpoint and lowers the row's one before (~64 a step at 1,024 rows): one call,
        and the re-ranked entry takes the victim's (stale) place on top without a test."""
        heap, rank = self._heap, self._rank
        while heap:
            entry = heap[0]
            slot = entry & _SLOT
            if rank.get(slot) != entry:
                heapq.heappop(heap)  # stale: removed, touched or re-tiered since
            elif entry >> _TIER > tier:
                return None
            else:
                del rank[slot]  # so a `previous` that is the victim is re-ranked no more
                if (ranked := rank.get(previous)) is not None:
                    rank[previous] = entry = lower << _TIER | ranked & _USE_AND_SLOT
                    heapq.heapreplace(heap, entry)  # the top is the victim's: stale now
                return slot
        return None

    def admits(self, tier: int, victim: int) -> bool:
        """Whether a new checkpoint of `tier` ranks above `victim` (so `victim` may go for
        it): a higher tier, or the same tier and newer (it always is)."""
        return self._rank[victim] >> _TIER <= tier
