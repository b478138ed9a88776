"""The hand-off's Prometheus metrics (both roles) and its once-a-minute fallback log."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .config import REASONS
from .lease import LeaseTable

logger = logging.getLogger("paged_kv.handoff")
LOG_EVERY_S = 60.0  # one log line per fallback reason per minute
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HandoffMetrics:
    """``paged_kv_handoffs_total{role}``, ``paged_kv_handoff_bytes_total``,
    ``paged_kv_handoff_seconds`` (bandwidth: bytes_total / seconds_sum),
    ``paged_kv_handoff_leases{state}``, ``paged_kv_handoff_leases_expired_total`` and
    ``paged_kv_handoff_fallbacks_total{reason}`` (every reason exported from the start, 0)."""

    def __init__(self, role: str, leases: LeaseTable | None = None) -> None:
        self.role, self.leases = role, leases
        self.registry = registry = CollectorRegistry()
        self.handoffs = Counter("paged_kv_handoffs", "Requests handed off (prefill: leased; "
                                "decode: pages loaded from the prefill engine)", ["role"],
                                registry=registry)
        self.handoffs.labels(role)
        self.bytes = Counter("paged_kv_handoff_bytes", "Bytes of pages handed off",
                             registry=registry)
        self.seconds = Histogram("paged_kv_handoff_seconds", "Seconds per hand-off (prefill: "
                                 "copying out; decode: the transfer)", buckets=_SECONDS,
                                 registry=registry)
        self.fallbacks = Counter("paged_kv_handoff_fallbacks", "Hand-offs a decode engine "
                                 "could not load, by reason", ["reason"], registry=registry)
        for reason in REASONS:
            self.fallbacks.labels(reason)
        self.live = Gauge("paged_kv_handoff_leases", "Leases held now", ["state"],
                          registry=registry)
        self.expired = Counter("paged_kv_handoff_leases_expired", "Leases that expired "
                               "(or were pushed out by newer ones) unreleased",
                               registry=registry)
        self._expired_seen = 0
        self._logged: dict[str, float] = {}

    def handoff(self, nbytes: int, seconds: float) -> None:
        """One hand-off done."""
        self.handoffs.labels(self.role).inc()
        self.bytes.inc(nbytes)
        self.seconds.observe(seconds)

    def fallback(self, reason: str, detail: str) -> None:
        """Count a fallback; log it unless `reason` was logged in the last minute."""
        self.fallbacks.labels(reason).inc()
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            logger.warning("kv hand-off fell back (%s): %s", reason, detail)

    def text(self) -> str:
        """The exposition, lease gauges as of now."""
        if self.leases is not None:
            self.leases.sweep()
            self.live.labels("live").set(self.leases.live)
            gone = self.leases.expired + self.leases.evicted
            self.expired.inc(gone - self._expired_seen)
            self._expired_seen = gone
        return generate_latest(self.registry).decode()
