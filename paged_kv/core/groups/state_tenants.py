"""`CheckpointShares`: each tenant's share of the state slab's checkpoints.

A tenant's quota and reservation (`paged_kv.tenants.TenantPolicy`) are blocks of the
pool; the checkpoints of a model with recurrent layers live in the state slab beside it,
so the same limits apply there as the same fraction of the slab that they are of the pool
(as they do in each tier: `TenantPolicy.tier_limits`, tier ``"states"``):

- **quota**: a tenant at its quota of checkpoints replaces its own least valuable one
  (`CheckpointPolicy`'s order) rather than taking a free slot or another's;
- **reservation**: another tenant's new checkpoint never evicts one of a tenant that holds
  no more than its reservation. A live state (a running sequence's) may: it must run, and
  a reservation protects what is cached, not what runs — the same rule as the pool, where
  live blocks are never the ledger's.

A tenant never reads another's checkpoint by construction: a checkpoint is indexed under
its block's chained key, which starts from the tenant's salted root.
"""

from __future__ import annotations

from ...keys import root_hash
from ...tenants.policy import TenantPolicy

STATES_TIER = "states"  # the slab, as `TenantPolicy.tier_limits` names a place


class CheckpointShares:
    """Which tenant owns each checkpoint slot, counted against its limits.

    Parameters
    ----------
    policy : TenantPolicy
    num_slots : int
        Slots of the slab (the limits scale by ``num_slots / (num_blocks - 1)``).
    num_blocks : int
        Blocks of the pool the policy's limits are of.
    """

    def __init__(self, policy: TenantPolicy, num_slots: int, num_blocks: int) -> None:
        names = [None, *policy.tenants]  # tenant 0: every salt the policy does not name
        self.names = names
        self._tenant = {root_hash(name): i for i, name in enumerate(names) if name}
        limits = [policy.tier_limits(name, STATES_TIER, num_slots, num_blocks)
                  for name in names]
        self.quota = [limit.quota for limit in limits]
        self.reservation = [limit.reservation for limit in limits]
        self.held = [0] * len(names)  # checkpoints of each tenant now
        self._owner: dict[int, int] = {}  # checkpoint slot -> its tenant

    def tenant_of_root(self, root: bytes | None) -> int:
        """The tenant a prompt under `root` (its salted root key) belongs to."""
        return self._tenant.get(root, 0) if root is not None else 0

    def owner(self, slot: int) -> int:
        return self._owner[slot]

    def at_quota(self, tenant: int) -> bool:
        """Whether `tenant` holds its quota of checkpoints (a new one replaces its own)."""
        quota = self.quota[tenant]
        return quota is not None and self.held[tenant] >= quota

    def evictable_by(self, tenant: int):
        """``slot -> bool``: whether a new checkpoint of `tenant` may evict the checkpoint
        in `slot` (its own, or another's above that one's reservation)."""
        return lambda slot: (self._owner[slot] == tenant
                             or self.held[self._owner[slot]] > self.reservation[
                                 self._owner[slot]])

    def own(self, tenant: int):
        """``slot -> bool``: whether the checkpoint in `slot` is `tenant`'s."""
        return lambda slot: self._owner[slot] == tenant

    def add(self, slot: int, tenant: int) -> None:
        self._owner[slot] = tenant
        self.held[tenant] += 1

    def remove(self, slot: int) -> None:
        self.held[self._owner.pop(slot)] -= 1

    def matches(self, slots: set[int]) -> bool:
        """Whether the owners are exactly the checkpoints in `slots`, counted right."""
        counts = [0] * len(self.names)
        for tenant in self._owner.values():
            counts[tenant] += 1
        return set(self._owner) == slots and counts == self.held

    def snapshot(self) -> tuple:
        return tuple(sorted(self._owner.items())), tuple(self.held)
