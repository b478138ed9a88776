"""`TenantLedger`: the cached blocks by tenant under a `TenantPolicy`, and which to evict next.

`TenantEviction` (the allocator's eviction policy under tenants, `eviction.py`) tells the
ledger each block that becomes cached or stops being cached, with its tenant
(`tags.TenantTags`), and asks it for victims. It always keeps each tenant's count of cached
blocks; the per-tenant lists below only while the eviction policy has split its order by
tenant (a quota, reservation or retention at stake: `adopt`), not while it rides on one
order for the pool (`ride`). Per tenant the ledger keeps its ordinary cached blocks oldest
first (an ``OrderedDict`` of block -> tick, the tick a global counter, so the oldest block
of the whole pool is the oldest front of the tenants' lists: picking a victim is one look
per tenant) and its retained blocks (priority, start, end). Victims, in order:

1. a tenant over its quota loses its own blocks first, as soon as they become cached
   (pressure ``own_quota``), so no tenant ever holds more cached blocks than its quota;
2. otherwise the oldest ordinary block of any tenant still above its reservation (its own
   blocks too, for the tenant asking), then
3. retained blocks, the lowest priority first, the priority decaying linearly to 0 over
   the retention; a retention that ended makes its blocks ordinary (and oldest).

`num_protected` (the blocks reservations keep from everyone) comes off what the allocator
calls obtainable, so a plan never counts on a block it could not take.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import operator
import time
from collections.abc import Callable, Sequence

from ..errors import InvariantError, ensure
from .policy import TenantPolicy

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class TenantUsage:
    """One tenant's cached blocks in the pool now, beside its limits."""

    tenant: str | None  # None: salts the policy does not name (and requests with none)
    cached: int  # ordinary and retained
    retained: int
    quota: int | None
    reservation: int


class TenantLedger:
    """Cached blocks by tenant under `policy`, for a pool of `num_blocks`.

    Parameters
    ----------
    policy : TenantPolicy
        Checked against the pool here (ValueError naming the field).
    num_blocks : int
        The pool's blocks, the null block included.
    clock : callable
        Seconds, for retention (``time.monotonic``).

    Attributes
    ----------
    names : list of str or None
        The tenants, the unnamed (None, for salts the policy does not name) first: a
        tenant is its index here.
    counts : list of int
        Each tenant's cached blocks, ordinary and retained (read it; `add` changes it).
    protected : int
        `num_protected` (read it).
    """

    def __init__(self, policy: TenantPolicy, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        policy.check(num_blocks)
        self.policy = policy
        self.names: list[str | None] = [None, *policy.tenants]
        limits = [policy.default, *policy.tenants.values()]
        self._quota = [num_blocks if t.quota is None else t.quota for t in limits]
        self._reserve = [t.reservation for t in limits]
        self._defaults = [(t.priority, t.retention_seconds) for t in limits]
        self._budget = [(num_blocks - 1) // 4 if t.retention_budget is None
                        else t.retention_budget for t in limits]
        self._lru: list[collections.OrderedDict[int, int]] = [
            collections.OrderedDict() for _ in self.names]
        # the first tick of each list (inf: empty), so choosing a victim reads a list of
        # numbers, not an iterator per tenant
        self._oldest: list[float] = [math.inf] * len(self.names)
        self._retained: list[dict[int, tuple[int, float, float, int]]] = [
            {} for _ in self.names]
        self.counts = self._count = [0] * len(self.names)
        self._tick = 0
        self._front = 0  # ticks below every other: demoted blocks, the oldest of the pool
        self.protected = 0  # sum over tenants of min(cached, reservation)
        self._next_expiry = math.inf
        self._clock = clock

    # -- queries --------------------------------------------------------------------------
    @property
    def num_protected(self) -> int:
        """Cached blocks that reservations keep from every tenant's pressure."""
        return self.protected

    @property
    def num_retained(self) -> int:
        """Retained blocks, every tenant's."""
        return sum(map(len, self._retained))

    def reserved_for(self, tenant: int | None) -> int:
        """Of `num_protected`, the blocks `tenant` may still take itself (its own
        reservation holds against others only; None: a step that mixes tenants, for which
        every reservation holds)."""
        if tenant is None:
            return 0
        return min(self._count[tenant], self._reserve[tenant])

    def room(self, tenant: int) -> int:
        """Cached blocks `tenant` may gain before it passes its quota."""
        return self._quota[tenant] - self._count[tenant]

    def spare(self, tenant: int) -> int:
        """Cached blocks of `tenant` another tenant's pressure may take (above its
        reservation; negative below it)."""
        return self._count[tenant] - self._reserve[tenant]

    def retains(self, tenant: int, priority: int | None, seconds: float | None) -> bool:
        """Whether blocks `tenant` releases asking for `priority` and `seconds` (None: its
        defaults) would be retained, any of them."""
        default_priority, default_seconds = self._defaults[tenant]
        return self._retainable(tenant, 1, default_priority if priority is None else priority,
                                default_seconds if seconds is None else seconds) > 0

    def calm(self, margin: int) -> bool:
        """Whether nothing is retained and every tenant is `margin` blocks or more inside
        its quota and, if it has a reservation, above it: one order for the pool evicts
        as the per-tenant lists would for a while."""
        if any(self._retained):
            return False
        return all(count + margin <= quota and (not reserve or count >= reserve + margin)
                   for count, quota, reserve in zip(self._count, self._quota,
                                                    self._reserve, strict=True))

    def usage(self) -> list[TenantUsage]:
        """Each tenant's cached and retained blocks now, the unnamed first."""
        return [TenantUsage(name, self._count[t], len(self._retained[t]),
                            self.policy.limits(name).quota, self._reserve[t])
                for t, name in enumerate(self.names)]

    def retained_blocks(self, tenant: int) -> list[int]:
        """The blocks `tenant` retains now."""
        return list(self._retained[tenant])

    # -- the eviction policy's notifications ----------------------------------------------
    def add(self, tenant: int, delta: int) -> None:
        """`tenant` gained `delta` cached blocks (lost, when negative) outside the lists:
        while the eviction policy rides on one order."""
        count, reserve = self._count[tenant], self._reserve[tenant]
        after = count + delta
        if count < reserve or after < reserve:  # (conditionals: min() costs 5x as much)
            self.protected += ((after if after < reserve else reserve)
                                - (count if count < reserve else reserve))
        self._count[tenant] = after

    def gain(self, tenant: int, count: int) -> int:
        """`add` `count` blocks to `tenant` and return its `room` after: a riding release's
        one call (its count and its quota check together)."""
        self.add(tenant, count)
        return self._quota[tenant] - self._count[tenant]

    def cached(self, block_ids: list[int], tenants: Sequence[int], priority: int | None = None,
               seconds: float | None = None) -> list[int]:
        """`block_ids` (tail first, of `tenants`) just became cached; retain their head
        within budget (`priority`, `seconds`: the request's, else the tenant's defaults).
        Returns the blocks to evict at once: those past their tenant's quota, its oldest
        first."""
        first = tenants[0] if tenants else 0
        if tenants.count(first) == len(tenants):  # the usual case: one request's blocks
            by_tenant = {first: list(block_ids)} if tenants else {}
        else:
            by_tenant = {}
            for block_id, tenant in zip(block_ids, tenants, strict=True):
                by_tenant.setdefault(tenant, []).append(block_id)
        over = []
        for tenant, blocks in by_tenant.items():
            default_priority, default_seconds = self._defaults[tenant]
            wanted = (default_priority if priority is None else priority,
                      default_seconds if seconds is None else seconds)
            keep = self._retainable(tenant, len(blocks), *wanted)
            ordinary = len(blocks) - keep
            self._lru[tenant].update(zip(blocks[:ordinary],
                                         range(self._tick, self._tick + ordinary), strict=True))
            if ordinary and self._oldest[tenant] == math.inf:
                self._oldest[tenant] = self._tick
            self._tick += ordinary
            if keep:  # the head: released last, the prefix other requests share
                self._retain(tenant, blocks[ordinary:], *wanted)
            self.add(tenant, len(blocks))
            over += self.over_quota(tenant)
        return over

    def over_quota(self, tenant: int) -> list[int]:
        """Take the blocks of `tenant` past its quota out, its oldest ordinary ones first,
        and return them (none while it is within its quota)."""
        excess = self._count[tenant] - self._quota[tenant]
        if excess <= 0:
            return []
        ordinary = min(excess, len(self._lru[tenant]))
        over = self._run(tenant, ordinary, math.inf, False) if ordinary else []
        return over + [self.pop(tenant) for _ in range(excess - ordinary)]

    def removed(self, block_ids: list[int], tenants: Sequence[int]) -> None:
        """`block_ids` (cached, of `tenants`) stopped being cached: revived by a hit, or
        unindexed."""
        lrus, retained, oldest = self._lru, self._retained, self._oldest
        for block_id, tenant in zip(block_ids, tenants, strict=True):
            tick = lrus[tenant].pop(block_id, _MISSING)
            if tick is _MISSING:
                del retained[tenant][block_id]
            elif tick == oldest[tenant]:
                self._refront(tenant)
            self.add(tenant, -1)

    def clear(self) -> None:
        """Every cached block is gone (the prefix cache was reset)."""
        for tenant in range(len(self.names)):
            self._lru[tenant].clear()
            self._retained[tenant].clear()
            self._count[tenant] = 0
            self._oldest[tenant] = math.inf
        self.protected, self._next_expiry = 0, math.inf

    # -- one order for the pool, or a list per tenant --------------------------------------
    def adopt(self, block_ids: list[int], tenants: Sequence[int]) -> None:
        """Split one order of ordinary cached blocks (oldest first, of `tenants`, already
        counted) into the tenants' lists, which are empty: ticks follow the order."""
        lrus, tick = self._lru, self._tick
        for block_id, tenant, at in zip(block_ids, tenants, itertools.count(tick),
                                        strict=False):
            lrus[tenant][block_id] = at
        self._tick = tick + len(block_ids)
        for tenant in range(len(self.names)):
            self._refront(tenant)

    def ride(self) -> list[int]:
        """Empty the tenants' lists (nothing may be retained) into one order, oldest first,
        and return it; the counts stay."""
        ensure(not any(self._retained), "retained blocks cannot ride on one order")
        entries = sorted(itertools.chain.from_iterable(lru.items() for lru in self._lru),
                         key=operator.itemgetter(1))
        for tenant in range(len(self.names)):
            self._lru[tenant].clear()
            self._oldest[tenant] = math.inf
        return [block_id for block_id, _ in entries]

    # -- choosing victims -----------------------------------------------------------------
    def victims(self, count: int, requester: int | None,
                ) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """Take `count` cached blocks to evict for an allocation by tenant `requester`
        (None: a step mixing tenants; every reservation holds). The caller made sure they
        exist (`num_protected` is off its obtainable count).

        Returns
        -------
        blocks : list of int
            The victims, oldest first.
        runs : list of (int, list of int)
            The same blocks in runs of one tenant each, ``(tenant, blocks)``.
        """
        if self._next_expiry != math.inf:
            self._expire()
        fronts, counts, reserve = self._oldest, self._count, self._reserve
        taken: list[int] = []
        runs: list[tuple[int, list[int]]] = []
        while count > 0:
            # the oldest front among the tenants that may lose a block, and the next oldest:
            # the best tenant's blocks older than that one go in one run
            best, oldest, runner_up = None, math.inf, math.inf
            for tenant, tick in enumerate(fronts):
                if tick < runner_up and (tenant == requester
                                         or counts[tenant] > reserve[tenant]):
                    if tick < oldest:
                        best, oldest, runner_up = tenant, tick, oldest
                    else:
                        runner_up = tick
            if best is None:
                best = self._lowest_retainer(requester)
                ensure(best is not None, "no evictable cached block for an allocation "
                       "that was counted as obtainable")
                run = [self.pop(best)]
            else:
                run = self._run(best, count, runner_up, best != requester)
            runs.append((best, run))
            taken += run
            count -= len(run)
        return taken, runs

    def pop(self, tenant: int) -> int:
        """Take `tenant`'s next victim: its oldest ordinary block, else its retained block
        of lowest decayed priority."""
        lru = self._lru[tenant]
        if lru:
            block_id = lru.popitem(last=False)[0]
            self._refront(tenant)
        else:
            retained = self._retained[tenant]
            if not retained:
                raise InvariantError(f"tenant {self.names[tenant]!r} has no cached block")
            now = self._clock()
            block_id = min(retained, key=lambda b: _rank(retained[b], now))
            del retained[block_id]
        self.add(tenant, -1)
        return block_id

    def flush(self, tenant: int) -> list[int]:
        """Every cached block of `tenant`, for the allocator to evict (admin flush)."""
        return [self.pop(tenant) for _ in range(self._count[tenant])]

    def unretain(self, tenant: int) -> int:
        """Make `tenant`'s retained blocks ordinary (and oldest); returns how many."""
        retained = self._retained[tenant]
        blocks = sorted(retained, key=lambda b: retained[b][3], reverse=True)
        self._demote(tenant, blocks)
        return len(blocks)

    # -- internals ------------------------------------------------------------------------
    def _run(self, tenant: int, most: int, before: float, reserved: bool) -> list[int]:
        """Up to `most` of `tenant`'s oldest ordinary blocks with ticks below `before`,
        never taking it to its reservation when `reserved` (at least one block)."""
        lru = self._lru[tenant]
        if reserved:
            most = min(most, self._count[tenant] - self._reserve[tenant])
        most = min(most, len(lru))
        if before != math.inf:
            # ticks rise along the list (demoted blocks take ticks below every other), so
            # the run's length is one bisection of its first `most` ticks, all in C
            ticks = list(itertools.islice(lru.values(), most))
            most = max(bisect.bisect_left(ticks, before), 1)
        popitem = lru.popitem
        run = [popitem(False)[0] for _ in range(most)]
        self._refront(tenant)
        self.add(tenant, -most)
        return run

    def _refront(self, tenant: int) -> None:
        lru = self._lru[tenant]
        self._oldest[tenant] = next(iter(lru.values())) if lru else math.inf

    def _retainable(self, tenant: int, count: int, priority: int, seconds: float) -> int:
        if priority <= 0 or seconds <= 0:
            return 0
        return min(count, max(self._budget[tenant] - len(self._retained[tenant]), 0))

    def _retain(self, tenant: int, blocks: list[int], priority: int, seconds: float) -> None:
        start = self._clock()
        end = start + seconds
        retained = self._retained[tenant]
        for block_id in blocks:
            retained[block_id] = (priority, start, end, self._tick)
            self._tick += 1
        self._next_expiry = min(self._next_expiry, end)

    def _demote(self, tenant: int, blocks: list[int]) -> None:
        """Move retained `blocks` (given newest first) to the front of the tenant's
        ordinary list: their retention is what kept them, so they go before the others."""
        lru, retained = self._lru[tenant], self._retained[tenant]
        for block_id in blocks:  # newest first, each to the front: the oldest ends first
            del retained[block_id]
            self._front -= 1
            lru[block_id] = self._front
            lru.move_to_end(block_id, last=False)
        self._refront(tenant)

    def _expire(self) -> None:
        if self._next_expiry == math.inf:  # nothing retained: no clock read per eviction
            return
        now = self._clock()
        if now < self._next_expiry:
            return
        upcoming = math.inf
        for tenant, retained in enumerate(self._retained):
            ended = [b for b, entry in retained.items() if entry[2] <= now]
            if ended:
                self._demote(tenant, sorted(ended, key=lambda b: retained[b][3],
                                            reverse=True))
            upcoming = min([upcoming, *(entry[2] for entry in retained.values())])
        self._next_expiry = upcoming

    def _lowest_retainer(self, requester: int | None) -> int | None:
        """The tenant holding the evictable retained block of lowest decayed priority."""
        now, best, lowest = self._clock(), None, (math.inf, math.inf)
        for tenant, retained in enumerate(self._retained):
            if retained and (tenant == requester
                             or self._count[tenant] > self._reserve[tenant]):
                rank = min(_rank(entry, now) for entry in retained.values())
                if rank < lowest:
                    best, lowest = tenant, rank
        return best

    # -- checking -------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """Comparable copy of the ledger's state: each tenant's ordinary blocks in order and
        its retained ones oldest first with their retention (not the ticks, which splitting
        one order renumbers), the counts."""
        return (tuple(tuple(lru) for lru in self._lru),
                tuple(tuple((block, *entry[:3]) for block, entry in
                            sorted(r.items(), key=lambda item: item[1][3]))
                      for r in self._retained),
                tuple(self._count), self.protected)

    def check(self, held: list[set[int]] | None = None) -> None:
        """Raise `InvariantError` unless the counts and the protection add up, no tenant is
        past its quota and the lists are ordered; with `held` (each tenant's cached blocks,
        the eviction policy's), the lists hold exactly those (None: the policy rides on one
        order, so the lists are empty and nothing is retained)."""
        if held is None:
            ensure(not any(self._lru) and not any(self._retained),
                   "the tenants' lists hold blocks while the pool rides on one order")
        else:
            for tenant, blocks in enumerate(held):
                ensure(set(self._lru[tenant]) | set(self._retained[tenant]) == blocks
                       and len(self._lru[tenant]) + len(self._retained[tenant]) == len(blocks),
                       f"tenant {tenant}'s lists differ from its cached blocks")
        for tenant, count in enumerate(self._count):
            ensure(count >= 0, f"tenant {tenant}'s count is negative")
            ensure(count <= self._quota[tenant],
                   f"tenant {self.names[tenant]!r} holds more cached blocks than its quota")
            ticks = list(self._lru[tenant].values())
            ensure(ticks == sorted(ticks), f"tenant {tenant}'s ticks do not rise")
        ensure(self.protected == sum(map(min, self._count, self._reserve)),
               "the protected count disagrees with the counts")
        ensure(self._oldest == [next(iter(lru.values())) if lru else math.inf
                                for lru in self._lru],
               "a tenant's oldest tick disagrees with its list")


def _rank(entry: tuple[int, float, float, int], now: float) -> tuple[float, int]:
    """A retained block's eviction rank: its priority decayed linearly to 0 over its
    retention, then its age (the older first)."""
    priority, start, end, tick = entry
    left = max(end - now, 0.0) / max(end - start, 1e-9)
    return priority * left, tick
