"""`GhostList`: a bounded memory of evicted keys and seen parents, to say why a block missed.

ARC keeps "ghost" entries of recently evicted pages to tell a miss that a bigger cache
would have hit from a cold one; here they name the cause. Two maps, each bounded by
`capacity` entries and each kept in two generations of at most half of it (plain dicts: a
run of keys is stored in C). A generation that would pass its half becomes the old one and
the old one is dropped whole — no copy and no Python step per key — so a map remembers at
least the newest half of its capacity and never more than all of it:

- evicted key -> (tier, pressure, by): where it was last evicted from and whose pressure
  did it (``own_quota``, ``own``, ``tenant`` with `by` naming that tenant, ``global`` for a
  step mixing tenants or a pool without a policy, ``flush`` for an admin flush or reset);
  a tenant policy adds a fourth field, the tenant that owned the block (`owner`), so a
  block chaining from an evicted key finds its tenant in the one map the ghost keeps;
- parent key of a block indexed once: a prompt whose block chains from such a parent but
  was never indexed differs from an earlier prompt *inside* that block (``diverged``).

A miss found in neither is ``cold``. A block whose attention pages are cached but whose
recurrent state has no checkpoint there (a model with recurrent layers) is
``state_missing``. An entry is ~200 bytes (key, entry, links), so the
default bound (`default_capacity`) keeps both maps to tens of MiB at most.
"""

from __future__ import annotations

import dataclasses

REASONS = ("cold", "evicted", "diverged", "tier_timeout", "verify_failed", "state_missing")
PRESSURES = ("own_quota", "own", "tenant", "global", "flush")
MAX_ENTRIES = 1 << 16
_MISSING = object()


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


class KeyMemory:
    """A map of keys to values bounded by `capacity` entries, in two generations of plain
    dicts (`_stored`): it remembers at least the newest half of its capacity. `GhostList`'s
    two maps are two of these.

    Examples
    --------
    >>> memory = KeyMemory(4)
    >>> memory.update({b"a": 1, b"b": 2})
    >>> memory.update({b"c": 3})  # past half of 4: {a, b} becomes the older generation
    >>> memory.get(b"a"), memory.get(b"c"), memory.get(b"z", 0)
    (1, 3, 0)
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._maps: tuple[dict, dict] = ({}, {})  # (newer, older)

    def update(self, entries: dict) -> None:
        """Remember `entries` (a key given again takes its newest value)."""
        if self.capacity and entries:
            self._maps = _stored(self._maps, entries, self.capacity)

    def __len__(self) -> int:
        return len(self._maps[0]) + len(self._maps[1])

    def __contains__(self, key: bytes) -> bool:
        return key in self._maps[0] or key in self._maps[1]

    def get(self, key: bytes, default: object = None) -> object:
        """The value remembered for `key`, else `default`."""
        newer, older = self._maps
        value = newer.get(key, _MISSING)
        return value if value is not _MISSING else older.get(key, default)


class GhostList:
    """Bounded memory of evicted keys and of parents of indexed blocks (see the module)."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity: expected an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._evicted = KeyMemory(capacity)  # key -> (tier, pressure, by)
        self._parents = KeyMemory(capacity)  # parent key -> None

    def __len__(self) -> int:
        return len(self._evicted) + len(self._parents)

    def evicted(self, keys: list[bytes], tier: str, pressure: str,
                by: str | None = None) -> None:
        """Remember `keys` as evicted from `tier` under `pressure` (by tenant `by`); a key
        evicted again is remembered with its newest entry."""
        if self.capacity and keys:
            self._evicted.update(dict.fromkeys(keys, (tier, pressure, by)))

    def evicted_each(self, entries: dict[bytes, tuple]) -> None:
        """Remember each key of `entries` as evicted, with its own ``(tier, pressure, by)``
        (one eviction whose blocks were under different pressures), or ``(tier, pressure,
        by, owner)`` naming the tenant that owned it."""
        if self.capacity and entries:
            self._evicted.update(entries)

    def seen(self, parents: list[bytes]) -> None:
        """Remember that blocks chaining from `parents` were indexed."""
        if self.capacity and parents:
            self._parents.update(dict.fromkeys(parents))

    def miss(self, key: bytes, parent: bytes, block: int, *, first: bool = False) -> Miss:
        """Why the block `key` (chaining from `parent`, index `block` of its prompt) is not
        cached. `first`: it is the prompt's first block, whose parent is the tenant's root
        (every prompt of the tenant chains from it, so no block diverges from another)."""
        entry = self.entry(key)
        if entry is not None:
            return Miss("evicted", block, *entry)
        if not first and parent in self._parents:
            return Miss("diverged", block)
        return Miss("cold", block)

    def entry(self, key: bytes) -> tuple | None:
        """``(tier, pressure, by)`` of `key` if remembered as evicted."""
        entry = self._evicted.get(key)
        return entry if entry is None or len(entry) == 3 else entry[:3]

    def owner(self, key: bytes) -> int | None:
        """The tenant that owned `key`'s block when it was evicted, if remembered (an entry
        of `evicted_each` that names one)."""
        entry = self._evicted.get(key)
        return entry[3] if entry is not None and len(entry) > 3 else None


def _stored(generations: tuple[dict, dict], entries: dict, capacity: int,
            ) -> tuple[dict, dict]:
    """`generations` (newer, older) with `entries` added to the newer one; when that would
    pass half of `capacity`, the newer one becomes the older and the older is dropped."""
    newer, older = generations
    if newer and len(newer) + len(entries) > max(capacity // 2, 1):
        newer, older = {}, newer
    newer.update(entries)
    return newer, older
