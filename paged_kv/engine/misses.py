"""Where each request's cached prompt tokens came from, and why its first uncached block
missed (`paged_kv.tenants.Miss`), counted by reason and tenant for the metrics.

A request's report is made once, at its first admission (a preempted request admitted
again keeps it): the device's hits, the blocks a tier fetch loaded before it (per tier),
and for the prompt's first block that was neither, the reason: the fetch's failure
(``tier_timeout`` / ``verify_failed``), else the deepest tier that remembers evicting it,
else the device pool's ghost list (``evicted`` / ``diverged`` / ``cold``).

A miss under another tenant's pressure names that tenant (``by``) for the operator; a
tenant's own view of its usage leaves the name out (`miss_seen_by`), since it would tell
who else uses the server.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from ..core.step.plan import Admission
from ..tenants import GhostList, Miss
from .request import Sequence


class CacheReports:
    """Builds each request's cache report and keeps the per-tenant counters.

    Parameters
    ----------
    block_size : int
    ghost : GhostList
        The device pool's (`BlockAllocator.ghost`).
    tiers : TierManager, optional
        Asked for `evicted_entry(key)` when it has one.
    indexed : callable, optional
        ``indexed(key)``: whether the device holds the block of `key` (a cache with
        recurrent layers: a block held there missed for want of its state checkpoint).
    """

    def __init__(self, block_size: int, ghost: GhostList, tiers: Any = None,
                 indexed: Callable[[bytes], bool] | None = None) -> None:
        self.block_size, self.ghost, self.tiers = block_size, ghost, tiers
        self.indexed = indexed
        self.misses: collections.Counter[tuple[str, str]] = collections.Counter()
        # tenant -> [prompt tokens looked up, found cached]
        self.tokens: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def admitted(self, seq: Sequence, admission: Admission, hit: int) -> None:
        """Record `seq`'s report at its first admission (`admission` its plan, `hit` the
        cached tokens it got)."""
        request = seq.request
        tenant = request.salt or ""
        loaded, failure = request.fetch_report or ({}, None)
        from_tiers = {tier: blocks * self.block_size for tier, blocks in loaded.items()
                      if blocks}
        device = max(hit - sum(from_tiers.values()), 0)
        request.cached_by_source = {"device": device, **from_tiers}
        if admission.tokens is None:  # every position computed (prompt log-probabilities)
            return
        counts = self.tokens[tenant]
        counts[0] += len(admission.tokens)
        counts[1] += hit
        miss = self.explain(admission, hit, failure)
        if miss is not None:
            request.miss = miss.as_dict()
            self.misses[miss.reason, tenant] += 1

    def explain(self, admission: Admission, hit: int,
                failure: tuple[str, str] | None = None) -> Miss | None:
        """Why the first block after `hit` cached tokens missed; None when every block
        that could hit did (the block holding the last token is always computed)."""
        block = hit // self.block_size
        if block >= (len(admission.tokens) - 1) // self.block_size:
            return None
        if failure is not None:
            return Miss(failure[0], block, tier=failure[1])
        if block >= len(admission.keys):
            return Miss("cold", block)
        key = admission.keys[block]
        if self.indexed is not None and self.indexed(key):
            return Miss("state_missing", block)
        entry = (self.tiers.evicted_entry(key)
                 if self.tiers is not None and hasattr(self.tiers, "evicted_entry") else None)
        if entry is not None:
            return Miss("evicted", block, *entry)
        parent = admission.keys[block - 1] if block else admission.root
        return self.ghost.miss(key, parent, block, first=block == 0)


def miss_seen_by(miss: dict | None, viewer: str | None) -> dict | None:
    """`miss` (`Miss.as_dict`, or None) as `viewer` may see it: for a tenant (a request's
    salt under a tenant's key) without ``by``, the name of the other tenant whose pressure
    evicted its block (``pressure: "tenant"`` still says it was another tenant's); whole
    for None (an admin key's requests and a server without keys carry no salt).

    Examples
    --------
    >>> miss = {"reason": "evicted", "block": 2, "tier": "device", "pressure": "tenant",
    ...         "by": "beta"}
    >>> miss_seen_by(miss, "acme")
    {'reason': 'evicted', 'block': 2, 'tier': 'device', 'pressure': 'tenant'}
    >>> miss_seen_by(miss, None)["by"]
    'beta'
    """
    if miss is None or viewer is None or "by" not in miss:
        return miss
    return {field: value for field, value in miss.items() if field != "by"}
