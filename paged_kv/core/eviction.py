"""Which cached blocks the allocator evicts: the `EvictionPolicy` it calls, and `LruEviction`,
its default (one least-recently-freed order over the whole pool).

The allocator owns block states (free, cached, live), the prefix index and the events; a
policy owns the set of *cached* blocks and their eviction order, and the ghost list that
remembers why a key was evicted (`paged_kv.tenants.GhostList`). The allocator tells it each
block that becomes cached or stops being cached, hands it the blocks it indexes, and asks
it for victims; it never asks which policy it holds. The tenant ledger
(`paged_kv.tenants.TenantEviction`) is the other policy: quotas, reservations and soft
retention by tenant. It lives on the floor below the core, so it implements this protocol
without importing it (the policy test suite, ``tests/core/test_eviction_policies.py``,
runs against both).

A policy takes blocks out of the index through the allocator's ``forget`` (it returns the
blocks' keys and logs their eviction), so it can name the pressure that evicted them in its
ghost list.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from ..tenants.ghost import GhostList, default_capacity

Forget = Callable[[list[int]], list[bytes]]  # takes blocks out of the index, returns keys

__all__ = ["EvictionPolicy", "Forget", "GhostList", "LruEviction"]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What `BlockAllocator` asks of the owner of its cached blocks.

    Attributes
    ----------
    cached : Mapping[int, object]
        The cached blocks (unowned, indexed, evictable). The allocator reads it (membership,
        size, iteration) and never changes it: it may be another object after any call.
    ghost : GhostList
        Evicted keys and the parents of indexed blocks, to name a miss's cause.
    tenants : object or None
        What readers may know of the cached blocks by tenant (usage, names), or None.
    """

    cached: Mapping[int, object]
    ghost: GhostList

    @property
    def tenants(self) -> object | None:
        """The per-tenant accounting readers may read, or None."""

    def held(self, root: bytes | None) -> int:
        """Cached blocks a request under salted root `root` may not take (reservations of
        others; None: a step mixing tenants, for which every reservation holds)."""

    def tag(self, block_ids: np.ndarray, keys: list[bytes], parents: list[bytes],
            index: Mapping[bytes, int]) -> None:
        """`block_ids` (live; ``[n]`` int64) are being indexed under `keys` (none indexed
        yet), chaining from `parents` (`index`: the prefix index, key -> block, before they
        join it)."""

    def tag_chain(self, block_ids: np.ndarray, keys: list[bytes], parents: list[bytes],
                  index: Mapping[bytes, int]) -> None:
        """`tag` of one chain, as the allocator knows it to be (one sequence's consecutive
        blocks: ``parents[i + 1] == keys[i]``), so a policy need not check that it is."""

    def cache(self, block_ids: list[int], priority: int | None, seconds: float | None,
              forget: Forget, root: bytes | None = None) -> list[int]:
        """`block_ids` (tail first) just became cached, released by a request that asked
        for `priority` and `seconds` of soft retention (None: the policy's defaults).
        `root`, when given, is the salted root every one of them chains from (one
        sequence's blocks), so a policy need not look each block's tenant up.
        Returns the blocks the policy evicted at once (out of it and, through `forget`,
        out of the index) for the allocator to free."""

    def uncache(self, block_ids: list[int]) -> None:
        """Cached `block_ids` stopped being cached: revived by a hit, or unindexed."""

    def evict(self, count: int, requester: bytes | None, forget: Forget) -> list[int]:
        """Take `count` victims out of the policy and, through `forget`, out of the index,
        for an allocation under salted root `requester` (None: a step mixing tenants). The
        allocator asks only for blocks it counted as obtainable (`held`)."""

    def flush(self, root: bytes, forget: Forget) -> list[int]:
        """Evict every cached block of the tenant of salted root `root` (an admin flush),
        through `forget`; returns them for the allocator to free."""

    def unretain(self, root: bytes) -> int:
        """End the soft retention of the blocks the tenant of `root` retains (they become
        its oldest ordinary ones); returns how many."""

    def clear(self) -> None:
        """Forget every cached block (the prefix cache was reset)."""

    def snapshot(self) -> tuple:
        """Comparable copy of the policy's state."""

    def check(self) -> None:
        """Raise `InvariantError` if the policy's own state does not add up."""


class LruEviction(EvictionPolicy):
    """One order over every cached block, least recently freed first: an ``OrderedDict``
    pops the oldest in O(1) and drops one from the middle (a prefix hit revives it) in O(1).
    A sequence's blocks come freed tail first, so its tail goes before the prefix that
    other sequences are likelier to share.

    Parameters
    ----------
    num_blocks : int
        The pool's blocks (the ghost list's default bound scales with it).
    ghost_capacity : int, optional
        Evicted keys remembered to name a miss's cause (None: `default_capacity`, 0: none).

    Examples
    --------
    >>> lru = LruEviction(8)
    >>> lru.cache([3, 2, 1], None, None, forget=lambda blocks: [b"k"] * len(blocks))
    []
    >>> lru.evict(2, None, forget=lambda blocks: [b"k"] * len(blocks))
    [3, 2]
    """

    def __init__(self, num_blocks: int, ghost_capacity: int | None = None) -> None:
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.ghost = GhostList(default_capacity(num_blocks) if ghost_capacity is None
                               else ghost_capacity)

    @property
    def tenants(self) -> None:
        """No per-tenant accounting: None."""
        return None

    def held(self, root: bytes | None) -> int:
        """Nothing is reserved: 0."""
        return 0

    def tag(self, block_ids: np.ndarray, keys: list[bytes], parents: list[bytes],
            index: Mapping[bytes, int]) -> None:
        """Remember the parents, so a later block that chains from one but differs inside
        it misses as ``diverged``."""
        self.ghost.seen(parents)

    tag_chain = tag  # one chain or not, only the parents are remembered

    def cache(self, block_ids: list[int], priority: int | None, seconds: float | None,
              forget: Forget, root: bytes | None = None) -> list[int]:
        """Append `block_ids` to the order (nothing is retained, no quota): none evicted."""
        self.cached.update(dict.fromkeys(block_ids))
        return []

    def uncache(self, block_ids: list[int]) -> None:
        """Drop `block_ids` from the order."""
        cached = self.cached
        for block_id in block_ids:
            del cached[block_id]

    def evict(self, count: int, requester: bytes | None, forget: Forget) -> list[int]:
        """The `count` least recently freed blocks, remembered as evicted by ``global``
        pressure."""
        popitem = self.cached.popitem
        evicted = [popitem(False)[0] for _ in range(count)]
        self.ghost.evicted(forget(evicted), "device", "global")
        return evicted

    def flush(self, root: bytes, forget: Forget) -> list[int]:
        """No tenants: nothing is flushed."""
        return []

    def unretain(self, root: bytes) -> int:
        """Nothing is retained: 0."""
        return 0

    def clear(self) -> None:
        """Empty the order."""
        self.cached.clear()

    def snapshot(self) -> tuple:
        """The order (the allocator's snapshot holds it already): empty."""
        return ()

    def check(self) -> None:
        """Nothing of its own to check: the allocator checks the cached blocks."""
