"""`TenantPolicy`: how tenants share the cached (evictable) blocks of the pool and the tiers.

A tenant is a prefix-cache salt (the server's tenants: one per API key group). The policy
governs only *cached* blocks, never the live blocks of running sequences:

- **quota**: the most cached blocks the tenant may hold; past it, its own least recently
  used cached blocks go first (at once, when its blocks become cached);
- **reservation**: that many of its cached blocks no other tenant's pressure (nor a step
  that mixes tenants) can evict;
- **priority** and **retention_seconds**: defaults for its requests' soft retention: a
  finished request's blocks are evicted after every ordinary cached block until their
  retention ends, the lower (decayed) priority first, at most **retention_budget** blocks
  retained at once (no unbounded pin).

The same quota and reservation apply in each tier (`TierLimits`), by default as the same
fraction of the tier's capacity that they are of the pool.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

MAX_PRIORITY = 99


@dataclasses.dataclass(frozen=True)
class TierLimits:
    """A tenant's quota and reservation in one tier, in blocks (None: no quota)."""

    quota: int | None = None
    reservation: int = 0

    def check(self, where: str) -> None:
        """Raise ValueError naming the field of `where` that is out of range."""
        _count(f"{where}.quota", self.quota, allow_none=True)
        _count(f"{where}.reservation", self.reservation)
        if self.quota is not None and self.reservation > self.quota:
            raise ValueError(f"{where}.reservation: {self.reservation} is above its quota "
                             f"{self.quota}")


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    """One tenant's share of the pool (blocks) and its requests' default retention.

    Parameters
    ----------
    quota : int, optional
        Most cached blocks it may hold in the device pool (None: no quota).
    reservation : int
        Cached blocks of its that no other tenant's pressure can evict.
    priority : int
        Default retention priority of its requests, 0-99 (0: none).
    retention_seconds : float
        Default soft retention of its requests' blocks once finished.
    retention_budget : int, optional
        Most blocks retained at once (None: a quarter of the pool).
    tiers : Mapping[str, TierLimits]
        Quota and reservation per tier (``host``, ``disk``, ``remote``) in that tier's
        blocks; a tier not named scales the pool's by its capacity.
    """

    quota: int | None = None
    reservation: int = 0
    priority: int = 0
    retention_seconds: float = 0.0
    retention_budget: int | None = None
    tiers: Mapping[str, TierLimits] = dataclasses.field(default_factory=dict)

    def check(self, where: str) -> None:
        """Raise ValueError naming the field of `where` that is out of range."""
        TierLimits(self.quota, self.reservation).check(where)
        check_priority(f"{where}.priority", self.priority)
        check_retention(f"{where}.retention_seconds", self.retention_seconds)
        _count(f"{where}.retention_budget", self.retention_budget, allow_none=True)
        for tier, limits in self.tiers.items():
            if tier not in ("host", "disk", "remote"):
                raise ValueError(f"{where}.tiers: unknown tier {tier!r} "
                                 "(expected host, disk or remote)")
            limits.check(f"{where}.{tier}")


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    """Every tenant's limits; salts not named get `default` (accounted together).

    Examples
    --------
    >>> policy = TenantPolicy({"a": TenantLimits(quota=8), "b": TenantLimits(reservation=4)})
    >>> policy.check(num_blocks=32)
    >>> policy.limits("b").reservation, policy.limits("c").quota
    (4, None)
    """

    tenants: Mapping[str, TenantLimits] = dataclasses.field(default_factory=dict)
    default: TenantLimits = TenantLimits()

    def limits(self, tenant: str | None) -> TenantLimits:
        """The limits of `tenant` (the default's for a tenant not named, or None)."""
        return self.tenants.get(tenant, self.default) if tenant is not None else self.default

    @property
    def reserved_blocks(self) -> int:
        """The blocks every reservation together keeps (the default's once)."""
        return sum(t.reservation for t in [*self.tenants.values(), self.default])

    def check_fields(self) -> None:
        """Raise ValueError naming the first field out of range on its own (a negative
        count, a reservation above its quota, ...): what can be checked before the pool's
        size is known, as a tenants file is read. `check` adds the sums."""
        for name, limits in self.tenants.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tenants: a tenant name must be a non-empty string, got "
                                 f"{name!r}")
            if not isinstance(limits, TenantLimits):
                raise TypeError(f"tenants.{name}: expected TenantLimits, got "
                                f"{type(limits).__name__}")
            limits.check(f"tenants.{name}")
        self.default.check("default")

    def check(self, num_blocks: int) -> None:
        """Raise ValueError naming the field out of range for a pool of `num_blocks`
        (null block included): a bad value (`check_fields`), or quotas / reservations that
        sum past the pool's blocks, which the message names."""
        self.check_fields()
        usable = num_blocks - 1
        quotas = sum(t.quota for t in self.tenants.values() if t.quota is not None)
        if quotas > usable:
            raise ValueError(f"tenants: quota: the quotas sum to {quotas} blocks, past the "
                             f"pool's {usable} ({num_blocks} blocks less the null block); "
                             "lower them, or give the pool more memory")
        reserved = self.reserved_blocks
        if reserved > usable // 2:  # room left for every other tenant's requests
            raise ValueError(f"tenants: reservation: the reservations sum to {reserved} "
                             f"blocks, past half the pool ({usable // 2} of its {usable}: "
                             f"{num_blocks} blocks less the null block); lower them, or give "
                             "the pool more memory")

    def check_tier(self, tier: str, capacity: int, num_blocks: int) -> None:
        """Raise ValueError when the reservations in `tier` (of `capacity` blocks) sum past
        half of it, as the pool's may not: it names the first tenant's own reservation for
        the tier (``tenants.NAME.tiers.TIER.reservation``) that takes the sum past it, its
        value and the tier's size. A reservation scaled from the pool's never does (those
        sum to at most half the pool, so scaled to at most half the tier)."""
        half = capacity // 2
        own = [(name, limits.tiers[tier].reservation)
               for name, limits in [*self.tenants.items(), (None, self.default)]
               if tier in limits.tiers]
        named = {name for name, _ in own}
        total = sum(self.tier_limits(name, tier, capacity, num_blocks).reservation
                    for name in [*self.tenants, None] if name not in named)
        for name, reservation in own:
            total += reservation
            if total > half:
                where = "default" if name is None else f"tenants.{name}"
                raise ValueError(
                    f"{where}.tiers.{tier}.reservation: {reservation} blocks take the {tier} "
                    f"tier's reservations to {total}, past half of its {capacity} blocks "
                    f"({half}); lower it, or give the {tier} tier more room")

    def tier_limits(self, tenant: str | None, tier: str, capacity: int,
                    num_blocks: int) -> TierLimits:
        """`tenant`'s limits in `tier` holding `capacity` blocks: its own for that tier,
        else the pool's scaled by ``capacity / (num_blocks - 1)``."""
        limits = self.limits(tenant)
        if tier in limits.tiers:
            return limits.tiers[tier]
        scale = capacity / max(num_blocks - 1, 1)
        quota = None if limits.quota is None else max(1, math.floor(limits.quota * scale))
        reservation = math.floor(limits.reservation * scale)
        return TierLimits(quota, min(reservation, quota) if quota is not None else reservation)


def check_priority(field: str, value: object) -> int:
    """`value` as a retention priority (an int 0-99); ValueError naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise ValueError(f"{field}: expected an integer 0-{MAX_PRIORITY}, got {value!r}")
    return value


def check_retention(field: str, value: object) -> float:
    """`value` as retention seconds (finite, >= 0); ValueError naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field}: expected seconds >= 0, got {value!r}")
    return float(value)


def _count(field: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}: expected a block count >= 0, got {value!r}")
