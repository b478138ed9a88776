"""Blocks by tenant for `Engine.stats`: live (held by running sequences) and, under a
`TenantPolicy`, cached and retained (the allocator's `TenantLedger`).

A tenant is a request's prefix-cache salt; ``""`` stands for requests without one and,
with a policy, for the salts it does not name (the ledger's unnamed bucket), so a label's
live, cached and retained blocks describe the same requests.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..core.cache import PagedKVCache
    from .request import Sequence


def tenant_blocks(running: Iterable[Sequence],
                  cache: PagedKVCache) -> tuple[tuple[str, str, int], ...]:
    """``(tenant, state, blocks)`` rows, state ``live`` / ``cached`` / ``retained``.

    Live blocks are the distinct device blocks of the tenant's running sequences (a prefix
    its samples share counts once; tenants never share blocks: the salt is in every key).
    Cached counts ordinary and retained blocks, as the pool's cached state does. Empty when
    there is no policy and no running sequence has a salt (one tenant: the pool's own
    gauges say it all), so a single-tenant engine pays nothing.

    Parameters
    ----------
    running : iterable of Sequence
        The scheduler's running sequences.
    cache : PagedKVCache
        Read only: its tables (block ids) and its allocator's ledger.
    """
    running = list(running)
    ledger = cache.allocator.tenants
    if ledger is None and not any(seq.request.salt for seq in running):
        return ()
    named = None if ledger is None else set(ledger.policy.tenants)
    held: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    for seq in running:
        tenant = seq.request.salt or ""
        if named is not None and tenant not in named:
            tenant = ""
        if seq.seq_id in cache:
            held[tenant].append(cache.tables.blocks(seq.seq_id))
    # block 0 is the null block (window layers' given-back entries): never live
    rows = [(tenant, "live", int(np.count_nonzero(np.unique(np.concatenate(arrays)))))
            for tenant, arrays in held.items()]
    for usage in () if ledger is None else ledger.usage():
        name = usage.tenant or ""
        rows += [(name, "cached", usage.cached), (name, "retained", usage.retained)]
    return tuple(rows)
