"""`TenantEviction`: the allocator's eviction policy under a `TenantPolicy`, and `eviction_for`.

It implements the allocator's `EvictionPolicy` (``paged_kv.core.eviction``; this floor is
below the core, so the protocol is met, not imported): it owns the cached blocks, their
tenants (`tags.TenantTags`), the counts, lists and retention by tenant (`ledger.TenantLedger`)
and the ghost list, which names whose pressure evicted a key.

**One order while nothing binds.** Most of the time no tenant is near its quota, every
tenant with a reservation holds well above it and nothing is retained: then the victims the
per-tenant lists would give are exactly the pool's least recently freed blocks. So the
policy keeps one order for the pool (the ``OrderedDict`` of its cached blocks, as
`LruEviction` does) and only counts blocks by tenant ("riding"). An operation that one
order cannot do exactly — a release past a quota or asking for retention, an eviction that
would take another tenant below its reservation, an admin flush — first *splits* the order
into the ledger's lists (ticks follow the order, so the choice is the same as if they had
been kept all along) and then runs on them. Once the work done split is as large as the
blocks the split moved and every tenant is again a margin inside its limits, the lists
merge back into one order (by tick) and the policy rides again: a split and the merge after
it cost O(blocks moved), paid for by at least as many blocks of split work.
"""

from __future__ import annotations

import collections
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..errors import ensure
from .ghost import GhostList, default_capacity
from .ledger import TenantLedger, TenantUsage
from .policy import TenantPolicy
from .tags import TenantTags

Forget = Callable[[list[int]], list[bytes]]  # the allocator's: out of the index, keys back


def eviction_for(policy: TenantPolicy | None, num_blocks: int, *,
                 clock: Callable[[], float] = time.monotonic) -> TenantEviction | None:
    """The eviction policy a `BlockAllocator` of `num_blocks` takes under `policy`
    (``BlockAllocator(n, eviction=eviction_for(policy, n))``); None without one, which the
    allocator reads as its plain LRU.

    Examples
    --------
    >>> from paged_kv.tenants import TenantLimits
    >>> eviction_for(None, 16) is None
    True
    >>> eviction_for(TenantPolicy({"a": TenantLimits(quota=4)}), 16).names
    [None, 'a']
    """
    return None if policy is None else TenantEviction(policy, num_blocks, clock)


class TenantEviction:
    """The cached blocks of a pool of `num_blocks` by tenant under `policy` (see the module).

    Parameters
    ----------
    policy : TenantPolicy
        Checked against the pool here (ValueError naming the field).
    num_blocks : int
        The pool's blocks, the null block included.
    clock : callable
        Seconds, for retention (``time.monotonic``).
    ride : bool
        Ride on one order while nothing binds (False: always the ledger's lists, as a
        reference the riding one is compared with).
    margin : int, optional
        How far inside its quota, and above its reservation, every tenant must be for the
        policy to ride again (None: a 64th of the pool, at least 8 blocks).
    """

    def __init__(self, policy: TenantPolicy, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic, *, ride: bool = True,
                 margin: int | None = None) -> None:
        self.ledger = ledger = TenantLedger(policy, num_blocks, clock)  # read: `usage`
        self.policy, self.names = policy, ledger.names
        self.ghost = GhostList(default_capacity(num_blocks))
        self._tags = TenantTags(self.names, num_blocks, self.ghost)
        self._ids = self._tags.ids  # salted root -> tenant
        # every cached block; while riding, in eviction order (all ordinary)
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._rides, self._riding = ride, ride
        self._work = self._owed = 0  # split work done, and owed for the switches (blocks)
        self._margin = max(num_blocks // 64, 8) if margin is None else margin
        # while riding, the tenants of blocks that left the order and are not yet off the
        # ledger's counts (`_settle`): a step's evictions cost no count per tenant
        self._pending: bytearray | list[int] = bytearray() if len(self.names) <= 256 else []
        # the tenants with a reservation, and a lower bound of the blocks each holds above
        # it (-1: unknown; math.inf: none reserves), so an eviction while riding rarely
        # looks at them one by one and `held` is a sum made once while every one holds
        self._reserve = [usage.reservation for usage in ledger.usage()]
        self._reserving = [t for t, reserve in enumerate(self._reserve) if reserve]
        self._floor = -1 if self._reserving else math.inf
        # whether a tenant's defaults retain blocks (its budget is whole while riding)
        self._keeps = [ledger.retains(t, None, None) for t in range(len(self.names))]
        self._reserved = sum(self._reserve)
        # what `held` is then, by salted root (None: every reservation; a root not named:
        # all but the unnamed's), one lookup per call
        self._held: dict[bytes | None, int] = {
            None: self._reserved, **{root: self._reserved - self._reserve[tenant]
                                     for root, tenant in self._ids.items()}}
        self._held_unnamed = self._reserved - self._reserve[0]
        # the ghost entries by owner for each (asking tenant, pressure) met: `_blame`
        self._entries: dict[tuple[int | None, str | None], list[tuple]] = {}

    # -- what readers see -------------------------------------------------------------------
    @property
    def tenants(self) -> TenantEviction:
        """Itself: the per-tenant accounting readers may read (`usage`, `names`, ...)."""
        return self

    @property
    def riding(self) -> bool:
        """Whether the pool rides on one order now (nothing binds), not the tenants' lists."""
        return self._riding

    def tenant_id(self, root: bytes | None) -> int:
        """The index of the tenant whose salted root is `root` (0: not named, or None)."""
        return self._tags.tenant_id(root)

    def tenants_of(self, block_ids: list[int]) -> tuple[int, ...]:
        """The tenants of indexed `block_ids` (set when they were indexed)."""
        return self._tags.of(block_ids)

    def usage(self) -> list[TenantUsage]:
        """Each tenant's cached and retained blocks now, the unnamed first."""
        self._settle()
        return self.ledger.usage()

    def retained_blocks(self, tenant: int) -> list[int]:
        """The blocks `tenant` retains now."""
        return self.ledger.retained_blocks(tenant)

    def cached_blocks(self, tenant: int) -> list[int]:
        """`tenant`'s cached blocks: its ordinary ones oldest first, then its retained."""
        ordinary = self.snapshot()[0][tenant]
        return [*ordinary, *self.ledger.retained_blocks(tenant)]

    def reserved_for(self, root: bytes | None) -> int:
        """Of the blocks reservations keep from everyone, those the tenant of salted root
        `root` may take itself (its own reservation; None: a step mixing tenants, 0)."""
        self._settle()
        return self.ledger.reserved_for(None if root is None else self._tags.tenant_id(root))

    def held(self, root: bytes | None) -> int:
        """Cached blocks a request under `root` may not take: the other tenants'
        reservations (every one, for None)."""
        if self._riding:
            if self._floor < 0:
                self._renew()
            if self._floor >= 0:  # every reserving tenant holds its reservation whole
                return self._held.get(root, self._held_unnamed)
        return self.ledger.protected - self.reserved_for(root)

    # -- the allocator's calls -----------------------------------------------------------
    def tag(self, block_ids: np.ndarray, keys: list[bytes], parents: list[bytes],
            index: Mapping[bytes, int]) -> None:
        """Tag `block_ids`, just indexed, with their tenant; remember their parents."""
        self._tags.tag(block_ids, keys, parents, index)
        self.ghost.seen(parents)

    def tag_chain(self, block_ids: np.ndarray, keys: list[bytes], parents: list[bytes],
                  index: Mapping[bytes, int]) -> None:
        """`tag` of one chain (``parents[i + 1] == keys[i]``): every block is the tenant
        of the chain's first parent, found once (~1.5 us a prompt less than `tag`, which
        compares the lists to find out)."""
        self._tags.tag_one(block_ids, parents[0], index)
        self.ghost.seen(parents)

    def cache(self, block_ids: list[int], priority: int | None, seconds: float | None,
              forget: Forget, root: bytes | None = None) -> list[int]:
        """`block_ids` (tail first) just became cached; the blocks of a tenant past its
        quota go at once, its oldest first (``own_quota``): returns them. Riding, they join
        the order while they are one tenant's and retain none; else the lists. Given the
        salted `root` they all chain from, their tenant is its tenant, unless a tag ever
        fell back to the unnamed for a parent found nowhere (`TenantTags.misses`): then,
        as without it, each block's tag is read."""
        if root is not None and not self._tags.misses:  # every tag is its chain's root's
            tenant, tenants = self._ids.get(root, 0), None
        else:
            tenants = self._tags.of(block_ids)
            tenant = tenants[0]
            if tenants.count(tenant) == len(tenants):
                tenants = None  # one tenant's, as a sequence's blocks are
        if self._riding:
            if tenants is None and not (
                    self._keeps[tenant] if priority is None and seconds is None
                    else self.ledger.retains(tenant, priority, seconds)):
                self.cached.update(dict.fromkeys(block_ids))
                # room left after them? (counts not yet settled only over-count)
                if self.ledger.gain(tenant, len(block_ids)) >= 0:
                    return []
                return self._ride_quota(tenant, forget)
            self._split()
        self.cached.update(dict.fromkeys(block_ids))
        over = self.ledger.cached(block_ids, (tenant,) * len(block_ids) if tenants is None
                                  else tenants, priority, seconds)
        self._drop(over)
        self._worked(len(block_ids))
        return self._evicted(over, forget, "own_quota")

    def uncache(self, block_ids: list[int]) -> None:
        """Cached `block_ids` stopped being cached (revived by a hit, or unindexed)."""
        self._drop(block_ids)
        tenants = self._tags.of(block_ids)
        if not self._riding:
            self.ledger.removed(block_ids, tenants)
            return
        self._floor -= len(block_ids)
        self._pending.extend(tenants)

    def evict(self, count: int, requester: bytes | None, forget: Forget) -> list[int]:
        """Take `count` victims for an allocation under salted root `requester` (None: a
        step mixing tenants), out of the index through `forget`, and remember whose
        pressure evicted them."""
        asking = None if requester is None else self._ids.get(requester, 0)
        if self._riding:
            # the order's `count` oldest, unless taking them takes another tenant below
            # its reservation: then the lists choose (where none binds, they give these)
            popitem = self.cached.popitem
            evicted = [popitem(False)[0] for _ in range(count)]
            tenants = self._tags.of(evicted)
            if count <= self._floor or self._spares(tenants, asking):
                self._floor -= count
                self._pending.extend(tenants)
                self._blame(forget(evicted), tenants, asking)
                return evicted
            self._unpop(evicted)
            self._split()
        evicted, runs = self.ledger.victims(count, asking)
        self._drop(evicted)
        self._blame(forget(evicted), [tenant for tenant, run in runs for _ in run], asking)
        self._worked(count)
        return evicted

    def flush(self, root: bytes, forget: Forget) -> list[int]:
        """Evict every cached block of the tenant of `root` (``flush``); returns them."""
        if self._riding:
            self._split()
        dropped = self.ledger.flush(self._tags.tenant_id(root))
        self._drop(dropped)
        return self._evicted(dropped, forget, "flush")

    def unretain(self, root: bytes) -> int:
        """End the retention of the blocks the tenant of `root` retains; returns how many
        (none while riding: nothing is retained then)."""
        return 0 if self._riding else self.ledger.unretain(self._tags.tenant_id(root))

    def clear(self) -> None:
        """Forget every cached block: one (empty) order again."""
        self.cached.clear()
        self.ledger.clear()
        self._pending.clear()
        self._riding, self._work = self._rides, 0
        self._floor = -1 if self._reserving else math.inf

    # -- riding on one order, or split by tenant ---------------------------------------------
    def _unpop(self, evicted: list[int]) -> None:
        """Put blocks just popped from the front of the one order back, as they were."""
        cached = self.cached
        for block_id in reversed(evicted):
            cached[block_id] = None
            cached.move_to_end(block_id, last=False)

    def _ride_quota(self, tenant: int, forget: Forget) -> list[int]:
        """Riding, `tenant` may have passed its quota by the blocks that just joined the
        order: settle the counts and, past it, evict its oldest blocks (``own_quota``) from
        near the front of the order, else from its list once split; returns them."""
        ledger = self.ledger
        self._settle()
        if ledger.room(tenant) >= 0:
            return []
        over = self._oldest_of(tenant, -ledger.room(tenant))
        if over is not None:
            self._floor -= len(over)
            ledger.add(tenant, -len(over))
            return self._evicted(over, forget, "own_quota")
        self._split()
        over = ledger.over_quota(tenant)
        self._drop(over)
        return self._evicted(over, forget, "own_quota")

    def _spares(self, tenants: Sequence[int], asking: int | None) -> bool:
        """Whether every tenant but `asking` keeps its reservation after losing the blocks
        of `tenants`; renews the lower bound of what they hold above it."""
        self._renew()
        if len(tenants) <= self._floor:
            return True
        spare = self.ledger.spare
        return all(tenant == asking or spare(tenant) >= lost
                   for tenant, lost in self._tally(tenants).items())

    def _renew(self) -> None:
        """Settle the counts and make the lower bound exact (riding)."""
        self._settle()
        if self._reserving:
            self._floor = min(map(self.ledger.spare, self._reserving))

    def _settle(self) -> None:
        """Take the blocks that left the order off their tenants' counts."""
        if self._pending:
            add = self.ledger.add
            for tenant, count in self._tally(self._pending).items():
                add(tenant, -count)
            self._pending.clear()

    def _tally(self, tenants: Sequence[int]) -> dict[int, int]:
        """How many of `tenants` each tenant is: ``{tenant: count}``."""
        if len(self.names) <= 8:  # a C-level count per tenant beats a Counter
            return {t: n for t in range(len(self.names)) if (n := tenants.count(t))}
        return collections.Counter(tenants)

    def _split(self) -> None:
        """Stop riding: the order's blocks go to their tenants' lists."""
        self._settle()
        self._floor = -1  # kept only while riding
        order = list(self.cached)
        self.ledger.adopt(order, self._tags.of(order))
        self._riding, self._work, self._owed = False, 0, len(order)

    def _oldest_of(self, tenant: int, count: int) -> list[int] | None:
        """Take `tenant`'s `count` oldest blocks out of the one order when they are near
        its front (the oldest blocks of the pool are a few tenants' as a rule); else
        None, nothing done."""
        mine = self._tags.first_of(tenant, self.cached, count,
                                   64 + 8 * count * len(self.names))
        if len(mine) < count:
            return None
        self._drop(mine)
        return mine

    def _evicted(self, block_ids: list[int], forget: Forget, pressure: str) -> list[int]:
        """`block_ids` (out of the policy) out of the index, remembered as evicted under
        `pressure` by their own tenant; returns them."""
        if block_ids:
            self._blame(forget(block_ids), self._tags.of(block_ids), None, pressure)
        return block_ids

    def _worked(self, blocks: int) -> None:
        """Count split work; ride again once it paid for the split (as many blocks as it
        moved; merging back moves at most those and the work's) and nothing binds."""
        self._work += blocks
        if self._rides and self._work >= self._owed and self.ledger.calm(self._margin):
            order = self.ledger.ride()
            self.cached.clear()
            self.cached.update(dict.fromkeys(order))
            self._riding = True
            self._floor = -1 if self._reserving else math.inf

    def _drop(self, block_ids: list[int]) -> None:
        cached = self.cached
        for block_id in block_ids:
            del cached[block_id]

    # -- blame: whose pressure evicted a key ---------------------------------------------
    def _blame(self, keys: list[bytes], tenants: Sequence[int], asking: int | None,
               pressure: str | None = None) -> None:
        """Remember `keys` (of blocks of `tenants`, in order) as evicted from the device,
        each with the tenant that owned it (`GhostList.owner`): under `pressure` when
        given (``own_quota``, ``flush``: by their own tenant), else by `asking`'s pressure,
        ``own`` for its blocks and ``tenant`` for others' (``global`` for a step mixing
        tenants). One entry for all when one tenant owned them all, as a run of victims
        as a rule; else each key's, by owner, in C (one `itemgetter` over the owners
        makes their entries: a map calling the list per key costs half as much again)."""
        entries = self._entries.get((asking, pressure))
        if entries is None:  # made once per (asking, pressure): a handful in all
            entries = self._entries[asking, pressure] = [
                self._entry(owner, asking, pressure) for owner in range(len(self.names))]
        first = tenants[0]
        if tenants.count(first) == len(tenants):
            self.ghost.evicted_each(dict.fromkeys(keys, entries[first]))
            return
        self.ghost.evicted_each(dict(zip(keys, operator.itemgetter(*tenants)(entries),
                                         strict=True)))

    def _entry(self, owner: int, asking: int | None, pressure: str | None) -> tuple:
        """The ghost entry of a block of `owner` evicted under `pressure` or, without one,
        by `asking`'s pressure: ``(tier, pressure, by, owner)``."""
        if pressure is None:
            if asking is not None and owner != asking:
                return "device", "tenant", self.names[asking], owner
            pressure = "global" if asking is None else "own"
        return "device", pressure, None, owner

    # -- checking -------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """Comparable copy of the state by tenant, the same riding or split: each tenant's
        ordinary blocks in order, its retained ones, the counts."""
        self._settle()
        if not self._riding:
            return self.ledger.snapshot()
        order: list[list[int]] = [[] for _ in self.names]
        for block_id, tenant in zip(self.cached, self._tags.of(list(self.cached)),
                                    strict=True):
            order[tenant].append(block_id)
        _, retained, counts, protected = self.ledger.snapshot()
        return tuple(map(tuple, order)), retained, counts, protected

    def check(self) -> None:
        """Raise `InvariantError` unless the ledger holds the cached blocks by tenant:
        counted riding (its lists empty), listed when split."""
        self._settle()
        held: list[set[int]] = [set() for _ in self.names]
        for block_id, tenant in zip(self.cached, self._tags.of(list(self.cached)),
                                    strict=True):
            held[tenant].add(block_id)
        ensure(list(map(len, held)) == self.ledger.counts,
               "a tenant's count differs from its cached blocks")
        self.ledger.check(None if self._riding else held)
