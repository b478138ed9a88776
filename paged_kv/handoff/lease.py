"""The prefill engine's leases: a request's prompt blocks, encoded as tier values
(`paged_kv.tiers.codec`: self-verifying), held in host memory until the decode engine
releases them or they expire.

Only host bytes are leased: the device blocks were freed as usual (they stay in the prefix
cache as cached blocks), so a decode engine that never comes can hold nothing but these
bytes, and only until the lease expires. The table is bounded by bytes: a new lease that
does not fit pushes out the oldest lease of the tenant holding the most bytes (counted as
evicted), so one tenant's flood of hand-offs pushes out its own leases before another's.
Thread-safe: the engine's thread adds leases, the hand-off server's thread reads, extends
and drops them.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import threading
import time
from collections.abc import Callable

EXPIRED_MEMORY = 4096  # lease ids remembered after expiry, to tell "expired" from "unknown"


@dataclasses.dataclass
class Lease:
    """One request's leased blocks: key -> encoded value, when it expires, its tenant."""

    values: dict[bytes, bytes]
    expiry: float
    tenant: str | None
    nbytes: int


class LeaseTable:
    """Leases by id (hex), bounded by `max_bytes`, each living `lease_s` past its last
    heartbeat.

    Parameters
    ----------
    lease_s : float
    max_bytes : int
    clock : callable
        Seconds, monotonic (a test's fake clock).
    """

    def __init__(self, lease_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self.max_bytes, self._clock = lease_s, max_bytes, clock
        self._leases: collections.OrderedDict[str, Lease] = collections.OrderedDict()
        # leases gone (expired, evicted or released) -> why, the last `EXPIRED_MEMORY`
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.expired = self.evicted = self.released = 0  # cumulative

    def create(self, values: dict[bytes, bytes], tenant: str | None) -> str | None:
        """Lease `values` (key -> encoded block); its id, or None when they alone exceed
        the table's bound."""
        nbytes = sum(len(v) for v in values.values())
        if nbytes > self.max_bytes:
            return None
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._expire()
            while self.nbytes + nbytes > self.max_bytes and self._leases:
                self._drop(self._victim(tenant, nbytes), "evicted")
                self.evicted += 1
            self._leases[lease_id] = Lease(values, self._clock() + self.lease_s, tenant, nbytes)
            self.nbytes += nbytes
        return lease_id

    def get(self, lease_id: str, keys: list[bytes]) -> list[bytes | None] | str:
        """The values of `keys` (None: not in the lease), or why there are none:
        ``"expired"`` (or evicted, or released) or ``"unknown"``."""
        with self._lock:
            self._expire()
            lease = self._leases.get(lease_id)
            if lease is None:
                return "expired" if lease_id in self._gone else "unknown"
            return [lease.values.get(key) for key in keys]

    def heartbeat(self, lease_id: str) -> bool:
        """Extend a live lease by `lease_s` from now; False when it is gone."""
        with self._lock:
            self._expire()
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            lease.expiry = self._clock() + self.lease_s
            return True

    def release(self, lease_id: str) -> bool:
        """Drop a lease (the decode engine has its blocks, or gave up); False if gone."""
        with self._lock:
            if lease_id not in self._leases:
                return False
            self._drop(lease_id, "released")
            self.released += 1
            return True

    def sweep(self) -> None:
        """Drop the leases past their expiry (every other call does too)."""
        with self._lock:
            self._expire()

    @property
    def live(self) -> int:
        """Leases held now."""
        return len(self._leases)

    def _victim(self, tenant: str | None, nbytes: int) -> str:
        """The lease to push out: the oldest of the tenant holding the most bytes, the new
        lease's `nbytes` counted to its `tenant`."""
        held: dict[str | None, int] = {tenant: nbytes}
        for lease in self._leases.values():
            held[lease.tenant] = held.get(lease.tenant, 0) + lease.nbytes
        ranked = sorted(held, key=held.__getitem__, reverse=True)
        for heaviest in ranked:  # (the new lease's tenant may hold nothing yet)
            for lease_id, lease in self._leases.items():
                if lease.tenant == heaviest:
                    return lease_id
        raise AssertionError("a full lease table without a lease")

    def _expire(self) -> None:
        now = self._clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.expiry < now]:
            self._drop(lease_id, "expired")
            self.expired += 1

    def _drop(self, lease_id: str, why: str) -> None:
        lease = self._leases.pop(lease_id)
        self.nbytes -= lease.nbytes
        self._gone[lease_id] = why
        while len(self._gone) > EXPIRED_MEMORY:
            self._gone.popitem(last=False)
