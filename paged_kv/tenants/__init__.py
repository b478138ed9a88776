"""Sharing the cache between tenants: quotas, reservations, soft retention, miss reasons.

- `policy`: `TenantPolicy` / `TenantLimits` / `TierLimits`, what each tenant may hold;
- `ledger`: `TenantLedger`, the allocator's cached blocks by tenant and the eviction order;
- `ghost`: `GhostList` and `Miss`, a bounded memory of evicted keys that names a miss's cause.
"""

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

__all__ = ["MAX_PRIORITY", "PRESSURES", "REASONS", "GhostList", "Miss", "TenantLedger",
           "TenantLimits", "TenantPolicy", "TenantUsage", "TierLimits", "check_priority",
           "check_retention", "default_capacity"]
