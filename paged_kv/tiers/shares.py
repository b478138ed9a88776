"""Per-tenant accounting in a tier (`TierShares`), and the bounded memory of what the tiers
evicted (`TierGhosts`), so a miss can name the tier and whose pressure evicted its block.

With a `paged_kv.tenants.TenantPolicy` every tier keeps, per tenant, the blocks this process
wrote there (least recently used first) and chooses the victims itself, before a write, by
the device pool's rules: a tenant over its tier quota evicts its own least recently used
blocks first; otherwise the tier's least recently used block goes, but never one of another
tenant at or below its tier reservation (a block that could only be written by evicting
such a block is not written). A tier's limits are
``policy.tier_limits(tenant, tier, capacity_blocks, num_blocks)``. The store's own eviction
(its byte cap, Redis' ``maxmemory`` LRU) stays the last resort, for what the accounting does
not know: blocks an earlier run left on disk, keys another replica wrote to Redis. A Redis
tier's capacity is not known here, so only a tenant's explicit ``remote`` limits apply to it.
In Redis a named tenant's keys carry its prefix (`tenant_prefix`), so an operator can read
or flush one tenant's blocks (``SCAN MATCH pkv:<tenant>/*``).
"""

from __future__ import annotations

import collections
import hashlib
import math
import re
import threading

from ..tenants import GhostList
from ..tenants.ghost import default_capacity
from ..tenants.policy import TenantPolicy, TierLimits
from .base import Store

# (chained key, pressure, tenant whose pressure evicted it or None, the evicted block's
# tenant: the ledger's index, 0 when not known)
Eviction = tuple[bytes, str, str | None, int]
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def tenant_prefix(name: str | None) -> str:
    """The prefix of tenant `name`'s keys in a store that names tenants (`Store.tenant_keys`):
    ``name/`` for a short plain name, else a digest of it; "" for the unnamed.

    >>> tenant_prefix("acme"), tenant_prefix(None), len(tenant_prefix("a b"))
    ('acme/', '', 18)
    """
    if not name:
        return ""
    if _SAFE_NAME.fullmatch(name):
        return name + "/"
    return "#" + hashlib.sha256(name.encode()).hexdigest()[:16] + "/"


class TierShares:
    """One tier's blocks by tenant and the victims that make room for new ones.

    Parameters
    ----------
    tier : str
        The tier's name (``host``, ``disk``, ``remote``).
    capacity : int, optional
        Blocks the tier holds at most (None: unknown, only quotas are enforced).
    names : list of str or None
        The tenants, as the allocator's ledger indexes them (``ledger.names``; None: the
        salts the policy does not name).
    policy : TenantPolicy
    num_blocks : int
        The device pool's blocks (null block included): scales the pool's limits.
    """

    def __init__(self, tier: str, capacity: int | None, names: list[str | None],
                 policy: TenantPolicy, num_blocks: int) -> None:
        self.tier, self.capacity, self.names = tier, capacity, names
        limits = [_limits(policy, name, tier, capacity, num_blocks) for name in names]
        self._quota = [math.inf if t.quota is None else t.quota for t in limits]
        self._reserve = [t.reservation for t in limits]
        self._lru = [collections.OrderedDict() for _ in names]  # key -> tick, oldest first
        self._tenant: dict[bytes, int] = {}
        self._tick = 0
        self._untracked = 0  # blocks the store holds that the accounting does not know
        self._lock = threading.Lock()  # the writer admits, the engine's thread touches

    def admit(self, keys: list[bytes], tenants: list[int], held: int,
              ) -> tuple[list[int], list[Eviction]]:
        """Account `keys` (of ledger tenants `tenants`) as written to a tier holding `held`
        blocks now; returns the indices of the keys to write and the blocks to evict first
        (a key admitted and then evicted within the batch is not written)."""
        keep: dict[bytes, int] = {}
        victims: list[Eviction] = []
        with self._lock:
            self._untracked = max(held - len(self._tenant), 0)
            for i, (key, tenant) in enumerate(zip(keys, tenants, strict=True)):
                if key in self._tenant:
                    self._touch(key)
                    keep[key] = i
                    continue
                victim = self._room_for(tenant)
                if victim is False:
                    continue  # no room without breaking a reservation: not written
                if victim is not None:
                    victims.append(victim)
                    keep.pop(victim[0], None)
                self._add(key, tenant)
                keep[key] = i
        return sorted(keep.values()), victims

    def _room_for(self, tenant: int) -> Eviction | bool | None:
        """The eviction that admits one block of `tenant` (None: none needed; False: no
        block may go). Called under the lock."""
        if self._quota[tenant] == 0:
            return False
        if len(self._lru[tenant]) >= self._quota[tenant]:
            return self._pop(tenant), "own", None, tenant
        if self.capacity is None or len(self._tenant) + self._untracked < self.capacity:
            return None
        if self._untracked:  # an earlier run's block (the oldest): the store's LRU takes it
            self._untracked -= 1
            return None
        best, oldest = None, math.inf
        for other, lru in enumerate(self._lru):
            if lru and (other == tenant or len(lru) > self._reserve[other]):
                tick = next(iter(lru.values()))
                if tick < oldest:
                    best, oldest = other, tick
        if best is None:
            return False
        own = best == tenant
        return (self._pop(best), "own" if own else "tenant",
                None if own else self.names[tenant], best)

    def touch(self, keys: list[bytes]) -> None:
        """`keys` were just read from the tier: most recently used now."""
        with self._lock:
            for key in keys:
                if key in self._tenant:
                    self._touch(key)

    def forget(self, keys: list[bytes]) -> list[bytes]:
        """The tier no longer holds `keys` (evicted by the store, deleted, vanished);
        returns those that were accounted."""
        gone = []
        with self._lock:
            for key in keys:
                tenant = self._tenant.pop(key, None)
                if tenant is not None:
                    del self._lru[tenant][key]
                    gone.append(key)
        return gone

    def tenant_blocks(self) -> dict[str, int]:
        """Blocks held now by tenant name ("" for the salts the policy does not name)."""
        with self._lock:
            return {name or "": len(lru) for name, lru in zip(self.names, self._lru,
                                                               strict=True)}

    def _add(self, key: bytes, tenant: int) -> None:
        self._tenant[key] = tenant
        self._lru[tenant][key] = self._tick
        self._tick += 1

    def _touch(self, key: bytes) -> None:
        lru = self._lru[self._tenant[key]]
        lru[key] = self._tick
        lru.move_to_end(key)
        self._tick += 1

    def _pop(self, tenant: int) -> bytes:
        key = self._lru[tenant].popitem(last=False)[0]
        del self._tenant[key]
        return key


class TierGhosts:
    """Which tier evicted a block recently, and under whose pressure: one `GhostList` per
    tier, each bounded (`paged_kv.tenants.ghost.default_capacity` of the tier's blocks)."""

    def __init__(self, capacities: dict[str, int | None]) -> None:
        self.tiers = list(capacities)
        # a tier of unknown capacity (Redis) remembers as many as 16384 blocks' worth
        self._ghosts = {tier: GhostList(default_capacity(cap if cap else 1 << 14))
                        for tier, cap in capacities.items()}
        self._lock = threading.Lock()  # the writer records, the engine's thread asks

    def evicted(self, tier: str, evictions: list[Eviction]) -> None:
        """Remember `evictions` from `tier`."""
        ghost = self._ghosts[tier]
        with self._lock:
            for key, pressure, by, _ in evictions:
                ghost.evicted([key], tier, pressure, by)

    def entry(self, key: bytes) -> tuple[str, str, str | None] | None:
        """``(tier, pressure, by)`` of the deepest tier that remembers evicting `key`."""
        with self._lock:
            for tier in reversed(self.tiers):
                found = self._ghosts[tier].entry(key)
                if found is not None:
                    return found
        return None

    def __len__(self) -> int:
        return sum(len(ghost) for ghost in self._ghosts.values())


def capacity_blocks(store: Store, value_bytes: int) -> int | None:
    """Blocks of `value_bytes` that `store` holds at most (None: its cap is not known)."""
    cap = getattr(store, "cap_bytes", None)
    return None if cap is None else int(cap) // value_bytes


def open_shares(stores: list[Store], value_bytes: int, names: list[str | None],
                policy: TenantPolicy, num_blocks: int) -> dict[str, TierShares]:
    """A `TierShares` for each store, under `policy`.

    Raises
    ------
    ValueError
        A tier's own reservations sum past half of its capacity, as the pool's may not
        (`TenantPolicy.check_tier` names the field, its value and the tier's size); a tier
        of unknown capacity (Redis) is not checked.
    """
    capacities = {store.name: capacity_blocks(store, value_bytes) for store in stores}
    for tier, capacity in capacities.items():
        if capacity is not None:
            policy.check_tier(tier, capacity, num_blocks)
    return {tier: TierShares(tier, capacity, names, policy, num_blocks)
            for tier, capacity in capacities.items()}


def _limits(policy: TenantPolicy, name: str | None, tier: str, capacity: int | None,
            num_blocks: int) -> TierLimits:
    if capacity is None:  # unknown: only the tenant's own limits for the tier
        return policy.limits(name).tiers.get(tier, TierLimits())
    return policy.tier_limits(name, tier, capacity, num_blocks)
