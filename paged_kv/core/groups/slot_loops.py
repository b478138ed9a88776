"""The state slots' compiled loops: the checkpoint policy's heap (`CheckpointPolicy`'s
ranks in int64 arrays) and a step's checkpoint offers (`offer_rows`, `StateSlots`'
`offer_arrays`), with the constants they read.

A decode step at 1,024 rows fills ~64 blocks, and the state group offers a checkpoint at
each: take a free slot or evict the policy's victim, lower the row's newest checkpoint a
tier, make the new one its newest. In Python that was ~2 us an offer (dict and heap work);
here it is one call of a loop compiled by numba where the optional ``fast`` extra is
installed and ``PAGED_KV_NUMBA`` is not ``0`` when this module is imported (the switch the
compiled row loops read), the same loops in Python otherwise, with the same results.

They are one module on purpose: numba's cache is keyed by each function's source file,
and a loop cached against another file's function (or constant) would keep the old one
after that file changed. Here any change recompiles them all.
"""

from __future__ import annotations

import heapq
import os

import numpy as np

try:
    import numba
except ImportError:  # the `fast` extra is not installed: the same loops in Python
    numba = None

# a checkpoint's tier: what it is likely worth to a later prompt (the policy keeps the
# higher tiers under pressure; Marconi's admission by likely reuse)
DENSE = 0     # an interior boundary, taken only because a slot was free
INTERVAL = 1  # an interior boundary on the sparse interval (a later prompt that shares
#               a prefix nobody has met at yet still hits near its junction)
LATEST = 2    # a sequence's last boundary (a finished request's next turn starts there),
#               or one served to a hit
SHARED = 3    # a junction: where a prompt's attention blocks hit past its state

# a rank is one int64, ``tier << 61 | last use << 21 | slot``: it orders as the tuple
# (tier, last use, slot) does, so the heap compares one machine int an entry
TIER_SHIFT, USE_SHIFT = 61, 21
MAX_SLOTS = 1 << USE_SHIFT       # slots a policy ranks: 2,097,152
SLOT_MASK = MAX_SLOTS - 1
USE_LIMIT = 1 << (TIER_SHIFT - USE_SHIFT)  # uses before the ranks are renumbered
USE_AND_SLOT = (1 << TIER_SHIFT) - 1
# the policy's counters, one int64 array (the compiled loops update them in place)
SIZE, CLOCK, COUNT = 0, 1, 2

COMPILED = numba is not None and os.environ.get("PAGED_KV_NUMBA", "1") != "0"
jit = numba.njit(cache=True, nogil=True) if COMPILED else (lambda function: function)


# -- the heap's primitives: an int64 array and its size where compiled, else a list that
# heapq keeps (C sifts; Python ones over an array cost ~4x the offers' old time) ----------
if COMPILED:

    @jit
    def sift_up(heap, pos):
        """Move ``heap[pos]`` up to its place."""
        item = heap[pos]
        while pos > 0:
            parent = (pos - 1) >> 1
            if item >= heap[parent]:
                break
            heap[pos] = heap[parent]
            pos = parent
        heap[pos] = item

    @jit
    def sift_down(heap, size, pos):
        """Move ``heap[pos]`` down to its place in the first `size` entries."""
        item = heap[pos]
        while True:
            child = 2 * pos + 1
            if child >= size:
                break
            if child + 1 < size and heap[child + 1] < heap[child]:
                child += 1
            if heap[child] >= item:
                break
            heap[pos] = heap[child]
            pos = child
        heap[pos] = item

    @jit
    def push(heap, meta, entry):
        """Push `entry` (the caller reserved room: `CheckpointPolicy.reserve`)."""
        size = meta[SIZE]
        heap[size] = entry
        meta[SIZE] = size + 1
        sift_up(heap, size)

    @jit
    def pop(heap, meta):
        """Pop and return the top entry (the heap is not empty)."""
        size = meta[SIZE] - 1
        top = heap[0]
        meta[SIZE] = size
        if size:
            heap[0] = heap[size]
            sift_down(heap, size, 0)
        return top

    @jit
    def replace_top(heap, meta, entry):
        """`entry` in the top's place (the heap is not empty), sifted down."""
        heap[0] = entry
        sift_down(heap, meta[SIZE], 0)

    @jit
    def heapify(heap, meta, entries):
        """The heap made of `entries` alone (the caller reserved room)."""
        size = entries.size
        heap[:size] = entries
        for pos in range(size // 2 - 1, -1, -1):
            sift_down(heap, size, pos)
        meta[SIZE] = size

else:

    def push(heap, meta, entry):
        heapq.heappush(heap, int(entry))
        meta[SIZE] += 1

    def pop(heap, meta):
        meta[SIZE] -= 1
        return heapq.heappop(heap)

    def replace_top(heap, meta, entry):
        heapq.heapreplace(heap, int(entry))

    def heapify(heap, meta, entries):
        heap[:] = entries.tolist()
        heapq.heapify(heap)
        meta[SIZE] = len(heap)


# -- the policy's operations (see `CheckpointPolicy`) ----------------------------------------
@jit
def place(rank, heap, meta, entry):
    """Put `entry` on the heap, in the top's place when that one is stale (one sift, not a
    pop and a push): a step's offer evicts (the victim's entry stays on top), then re-ranks
    the row's newest checkpoint."""
    if meta[SIZE] and rank[heap[0] & SLOT_MASK] != heap[0]:
        replace_top(heap, meta, entry)
    else:
        push(heap, meta, entry)


@jit
def add_all(rank, heap, meta, slots, tiers):
    """Rank each of `slots` (distinct) at its tier in `tiers`, the most recent in order."""
    clock = meta[CLOCK]
    for i in range(slots.size):
        slot = slots[i]
        entry = np.int64(tiers[i]) << TIER_SHIFT | clock << USE_SHIFT | slot
        clock += 1
        if rank[slot] < 0:
            meta[COUNT] += 1
        rank[slot] = entry
        push(heap, meta, entry)
    meta[CLOCK] = clock


@jit
def retiered(entry, tier):
    """The rank `entry` at `tier` instead, its use and slot unchanged."""
    return np.int64(tier) << TIER_SHIFT | entry & USE_AND_SLOT


@jit
def retier_written(rank, heap, meta, slot, tier):
    """`slot` moves to `tier`, its use unchanged, if the policy ranks it; else nothing."""
    if 0 <= slot < rank.size and rank[slot] >= 0:
        entry = retiered(rank[slot], tier)
        rank[slot] = entry
        place(rank, heap, meta, entry)


@jit
def victim(rank, heap, meta, exclude):
    """The slot to evict first, never `exclude` (-1: none), left ranked; or -1. Stale
    entries on top are dropped on the way."""
    held, found = 0, -1  # entries of `exclude` held off the heap (all equal its rank)
    while meta[SIZE]:
        entry = heap[0]
        slot = entry & SLOT_MASK
        if rank[slot] != entry:
            pop(heap, meta)  # stale: removed, touched or re-tiered since
        elif slot == exclude:
            pop(heap, meta)
            held += 1
        else:
            found = slot
            break
    for _ in range(held):
        push(heap, meta, rank[exclude])
    return found


@jit
def evict_retier(rank, heap, meta, tier, previous, lower):
    """The first victim, removed, when a new checkpoint of `tier` ranks above it (else -1:
    none, or none at or below `tier`); when it evicted and `previous` (-1: none) is
    another ranked checkpoint, `previous` moves to `lower` (its use unchanged) in the
    victim's place on top: a decode step's offer, ~64 a step at 1,024 rows."""
    while meta[SIZE]:
        entry = heap[0]
        slot = entry & SLOT_MASK
        if rank[slot] != entry:
            pop(heap, meta)  # stale: removed, touched or re-tiered since
        elif entry >> TIER_SHIFT > tier:
            return -1
        else:
            rank[slot] = -1  # so a `previous` that is the victim is re-ranked no more
            meta[COUNT] -= 1
            if 0 <= previous < rank.size and rank[previous] >= 0:
                ranked = retiered(rank[previous], lower)
                rank[previous] = ranked
                replace_top(heap, meta, ranked)  # the top is the victim's: stale now
            return slot
    return -1


@jit
def rebuild(rank, heap, meta, renumber):
    """The heap made again of the ranked entries alone (the stale ones dropped); with
    `renumber`, their uses first renumbered 0, 1, ... in the order of their uses, whatever
    their tiers (a re-tier keeps a use: the order of uses is the policy's, across tiers),
    the clock then starting after them, so the ranks fit their bits however long the
    policy runs."""
    ranked = np.nonzero(rank >= 0)[0]
    if renumber:
        order = ranked[np.argsort(rank[ranked] & USE_AND_SLOT)]
        for use in range(order.size):
            slot = order[use]
            rank[slot] = rank[slot] >> TIER_SHIFT << TIER_SHIFT | np.int64(use) << USE_SHIFT | slot
        meta[CLOCK] = order.size
    heapify(heap, meta, rank[ranked])


@jit
def lowered(tiers, position, interval, previous):
    """The tier a row's newest checkpoint `previous` (-1: none) drops to when the row
    takes a newer one: `INTERVAL` on the sparse interval, else `DENSE`; -1 when it
    stays (none, or not `LATEST`: a junction keeps `SHARED`)."""
    if previous < 0 or tiers[previous] != LATEST:
        return -1
    return INTERVAL if interval and position[previous] % interval == 0 else DENSE


@jit
def offer_rows(rows, shared, keys, key_slot, key_of, positions, free_tail, tiers, latest,
               latest_of, position, interval, rank, heap, meta, taken, victims):
    """Offer a checkpoint for each ``(rows[i], positions[i], shared[i])`` in order.

    ``keys[i]`` numbers offer i's key among the call's distinct keys, and ``key_slot[k]``
    is the slot key k is indexed in (-1: none), updated here: an offer whose key is
    indexed (before the call, or by an earlier offer of it) is not offered again, and a
    victim's key, if one of the call's, is indexed no more. `key_of` (by slot) is scratch,
    -1 throughout on entry and again on return: the call's key each slot holds, set and
    cleared here for the call's keys alone (a fresh array a call cost a fill of the whole
    slab, ~13 us at 65,536 slots). Slots come from the end of
    `free_tail` (the free stack's top), then from the policy's victims below the new
    checkpoint's tier. Updates ``tiers`` / ``position`` / ``latest_of`` (by slot),
    ``latest`` (by row: its newest checkpoint) and the policy's arrays; writes each
    offer's slot into `taken` and the slot it evicted into `victims` (-1: none). Returns
    ``(free slots used, checkpoints evicted)``.
    """
    for key in range(key_slot.size):  # key_of[s] == k exactly while key_slot[k] == s
        if key_slot[key] >= 0:
            key_of[key_slot[key]] = key
    used = evicted = 0
    for i in range(rows.size):
        taken[i] = victims[i] = -1
        if key_slot[keys[i]] >= 0:
            continue
        row = rows[i]
        # the row's newest checkpoint drops a tier (found first: an eviction re-ranks it
        # in the same policy call, unless it is the victim)
        previous = latest[row]
        lower = lowered(tiers, position, interval, previous)
        tier = SHARED if shared[i] else LATEST
        if used < free_tail.size:
            used += 1
            slot = free_tail[free_tail.size - used]
            if lower >= 0:
                retier_written(rank, heap, meta, previous, lower)
        else:
            slot = evict_retier(rank, heap, meta, tier, previous if lower >= 0 else -1, lower)
            if slot < 0:
                continue
            victims[i], evicted = slot, evicted + 1
            if key_of[slot] >= 0:  # the victim held a key offered later in the call
                key_slot[key_of[slot]] = -1
            if latest_of[slot] >= 0:  # the victim was some row's newest
                latest[latest_of[slot]] = -1
            if slot == previous:
                previous = -1
        tiers[slot], position[slot] = tier, positions[i]
        if previous >= 0:
            if lower >= 0:
                tiers[previous] = lower
            latest_of[previous] = -1
        latest[row], latest_of[slot], taken[i] = slot, row, slot
        key_slot[keys[i]], key_of[slot] = slot, keys[i]
    for key in range(key_slot.size):  # the scratch cleared where it was set
        if key_slot[key] >= 0:
            key_of[key_slot[key]] = -1
    return used, evicted


_warm = not COMPILED  # nothing to compile without numba


def warm() -> None:
    """Compile (or load from numba's cache) every loop here, once a process: the first
    `StateSlots` calls it, so no step pays a compile, or a cache load, when it first
    evicts or compacts the policy's heap (~10 ms each)."""
    global _warm
    if _warm:
        return
    _warm = True
    rank, heap = np.full(4, -1, dtype=np.int64), np.zeros(16, dtype=np.int64)
    meta = np.zeros(3, dtype=np.int64)
    add_all(rank, heap, meta, np.arange(4), np.array([DENSE, LATEST, DENSE, LATEST]))
    victim(rank, heap, meta, 0)
    retier_written(rank, heap, meta, 1, DENSE)
    pop(heap, meta)
    push(heap, meta, rank[0])
    rebuild(rank, heap, meta, True)
    one = np.zeros(1, dtype=np.int64)
    tiers, latest = np.full(4, -1, dtype=np.int8), np.full(4, -1, dtype=np.int64)
    lowered(tiers, one, 16, 0)  # `StateSlots.offer` calls it from Python
    offer_rows(one, np.zeros(1, dtype=bool), one.copy(), one - 1, latest.copy(), one, one,
               tiers, latest, latest.copy(), np.zeros(4, dtype=np.int64), 16, rank, heap, meta,
               one.copy(), one.copy())
