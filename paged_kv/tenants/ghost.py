"""`GhostList`: a bounded memory of evicted keys and seen parents, to say why a block missed.

ARC keeps "ghost" entries of recently evicted pages to tell a miss that a bigger cache
would have hit from a cold one; here they name the cause. Two FIFO maps, each bounded by
`capacity` entries (an ``OrderedDict``: O(1) to add and to drop the oldest):

- evicted key -> (tier, pressure, by): where it was last evicted from and whose pressure
  did it (``own_quota``, ``own``, ``tenant`` with `by` naming that tenant, ``global`` for a
  step mixing tenants or a pool without a policy, ``flush`` for an admin flush or reset);
- parent key of a block indexed once: a prompt whose block chains from such a parent but
  was never indexed differs from an earlier prompt *inside* that block (``diverged``).

A miss found in neither is ``cold``. An entry is ~200 bytes (key, entry, links), so the
default bound (`default_capacity`) keeps both maps to tens of MiB at most.
"""

from __future__ import annotations

import collections
import dataclasses

REASONS = ("cold", "evicted", "diverged", "tier_timeout", "verify_failed")
PRESSURES = ("own_quota", "own", "tenant", "global", "flush")
MAX_ENTRIES = 1 << 16


@dataclasses.dataclass(frozen=True)
class Miss:
    """Why a prompt's first uncached block was not cached.

    Attributes
    ----------
    reason : str
        One of `REASONS`.
    block : int
        The block's index in the prompt.
    tier : str, optional
        ``evicted``: the tier it was last evicted from (``device``, ``host``, ``disk``,
        ``remote``); ``tier_timeout`` / ``verify_failed``: the tier that failed.
    pressure : str, optional
        ``evicted``: whose pressure evicted it (one of `PRESSURES`).
    by : str, optional
        ``evicted`` under another tenant's pressure: that tenant.
    """

    reason: str
    block: int
    tier: str | None = None
    pressure: str | None = None
    by: str | None = None

    def as_dict(self) -> dict:
        """The fields that are set, for a response's usage."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def default_capacity(num_blocks: int) -> int:
    """Ghost entries kept for a store of `num_blocks`: four times its blocks, at most 65536."""
    return min(4 * num_blocks, MAX_ENTRIES)


class GhostList:
    """Bounded memory of evicted keys and of parents of indexed blocks (see the module)."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity: expected an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._evicted: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self._parents: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._evicted) + len(self._parents)

    def evicted(self, keys: list[bytes], tier: str, pressure: str,
                by: str | None = None) -> None:
        """Remember `keys` as evicted from `tier` under `pressure` (by tenant `by`)."""
        if not self.capacity or not keys:
            return
        entry, evicted = (tier, pressure, by), self._evicted
        for key in keys:
            evicted[key] = entry
            evicted.move_to_end(key)
        _trim(evicted, self.capacity)

    def seen(self, parents: list[bytes]) -> None:
        """Remember that blocks chaining from `parents` were indexed."""
        if self.capacity and parents:
            self._parents.update(dict.fromkeys(parents))
            _trim(self._parents, self.capacity)

    def miss(self, key: bytes, parent: bytes, block: int, *, first: bool = False) -> Miss:
        """Why the block `key` (chaining from `parent`, index `block` of its prompt) is not
        cached. `first`: it is the prompt's first block, whose parent is the tenant's root
        (every prompt of the tenant chains from it, so no block diverges from another)."""
        entry = self._evicted.get(key)
        if entry is not None:
            return Miss("evicted", block, *entry)
        if not first and parent in self._parents:
            return Miss("diverged", block)
        return Miss("cold", block)

    def entry(self, key: bytes) -> tuple | None:
        """``(tier, pressure, by)`` of `key` if remembered as evicted."""
        return self._evicted.get(key)


def _trim(entries: collections.OrderedDict, capacity: int) -> None:
    while len(entries) > capacity:
        entries.popitem(last=False)
