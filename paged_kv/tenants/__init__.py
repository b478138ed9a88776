"""Sharing the cache between tenants: quotas, reservations, soft retention, miss reasons.

- `policy`: `TenantPolicy` / `TenantLimits` / `TierLimits`, what each tenant may hold;
- `eviction`: `TenantEviction`, the allocator's eviction policy under a tenant policy
  (``BlockAllocator(n, eviction=eviction_for(policy, n))``): one order for the pool while
  nothing binds, the ledger's lists by tenant when a quota, reservation or retention does;
- `ledger`: `TenantLedger`, the cached blocks by tenant and which to evict next;
- `tags`: `TenantTags`, the tenant of each indexed block;
- `ghost`: `GhostList` and `Miss`, a bounded memory of evicted keys that names a miss's cause.
"""

from .eviction import TenantEviction, eviction_for
from .ghost import PRESSURES, REASONS, GhostList, Miss, default_capacity
from .ledger import TenantLedger, TenantUsage
from .policy import (
           MAX_PRIORITY,
           TenantLimits,
           TenantPolicy,
           TierLimits,
           check_priority,
           check_retention,
)

__all__ = ["MAX_PRIORITY", "PRESSURES", "REASONS", "GhostList", "Miss", "TenantEviction",
           "TenantLedger", "TenantLimits", "TenantPolicy", "TenantUsage", "TierLimits",
           "check_priority", "check_retention", "default_capacity", "eviction_for"]
