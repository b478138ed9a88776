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
        self._rank: dict[int, tuple[int, int]] = {}  # slot -> (tier, last use)
        self._heap: list[tuple[int, int, int]] = []  # (tier, last use, slot), some stale
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
            rank[slot] = entry = (tier, next(clock))
            heapq.heappush(heap, (*entry, slot))
        if len(heap) > 2 * len(rank) + 64:  # drop the stale entries
            self._heap = [(*entry, s) for s, entry in rank.items()]
            heapq.heapify(self._heap)

    def tier_of(self, slot: int) -> int:
        """`slot`'s tier."""
        return self._rank[slot][0]

    def touch(self, slot: int) -> None:
        """`slot` was served: it is now the most recently used of its tier."""
        self.add(slot, self._rank[slot][0])

    def retier(self, slot: int, tier: int) -> None:
        """`slot` moves to `tier` (its use unchanged)."""
        used = self._rank[slot][1]
        self._rank[slot] = (tier, used)
        heapq.heappush(self._heap, (tier, used, slot))

    def remove(self, slot: int) -> None:
        """`slot` is no checkpoint any more."""
        del self._rank[slot]

    def victim(self, exclude: int | None = None, allowed=None) -> int | None:
        """The checkpoint to evict first (never `exclude`; with `allowed`, ``slot ->
        bool``, only one it allows: a tenant's share), or None when there is none."""
        heap, held, found = self._heap, [], None
        while heap:
            tier, used, slot = heap[0]
            if self._rank.get(slot) != (tier, used):
                heapq.heappop(heap)  # stale: removed, touched or re-tiered since
            elif slot == exclude or (allowed is not None and not allowed(slot)):
                held.append(heapq.heappop(heap))
            else:
                found = slot
                break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def admits(self, tier: int, victim: int) -> bool:
        """Whether a new checkpoint of `tier` ranks above `victim` (so `victim` may go for
        it): a higher tier, or the same tier and newer (it always is)."""
        return self._rank[victim][0] <= tier
