"""Engine metrics in a prometheus-client registry of the engine's own."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .outputs import EngineStats
from .tenant_stats import tenant_blocks

if TYPE_CHECKING:
    from ..core.accounting import CacheStats
    from ..core.cache import PagedKVCache
    from ..tiers.manager import TierManager, TiersStats
    from .scheduler import Scheduler

OBSERVE_PERIOD_S = 0.25  # how often steps refresh the metrics (scrapes always do)

# per-tier counters: TierStats field -> (metric name, help)
TIER_COUNTERS = {
    "hit_tokens": ("paged_kv_tier_hit_tokens", "Prompt tokens whose K/V came from the tier"),
    "misses": ("paged_kv_tier_misses", "Blocks looked up in the tier and not found"),
    "verify_failures": ("paged_kv_tier_verify_failures",
                        "Values that failed verification (deleted, never served)"),
    "written_blocks": ("paged_kv_tier_written_blocks", "Blocks written to the tier"),
}
# the tiers' own counters: TiersStats field -> (metric name, help)
FETCH_COUNTERS = {
    "dropped_writes": ("paged_kv_tier_dropped_writes",
                       "Blocks not written down: the write queue was full"),
    "deadline_fallbacks": ("paged_kv_tier_deadline_fallbacks",
                           "Fetches past their deadline (the request recomputed)"),
    "skipped_fetches": ("paged_kv_tier_skipped_fetches",
                        "Fetches not made: recomputing was estimated faster"),
}


def engine_stats(scheduler: Scheduler, cache: PagedKVCache,
                 tiers: TierManager | None) -> EngineStats:
    """`Engine.stats`: the queues of `scheduler`, the counters of `cache`'s allocator and
    `tiers`' stats (None: none), and the live blocks by tenant (`tenant_blocks`)."""
    allocator, reports = cache.allocator, scheduler.reports
    return EngineStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped), num_preemptions=scheduler.num_preemptions,
        num_live_blocks=allocator.num_live_blocks,
        num_cached_blocks=allocator.num_cached_blocks,
        num_free_blocks=allocator.num_free_blocks,
        prefix_query_tokens=allocator.prefix_query_tokens,
        prefix_hit_tokens=allocator.prefix_hit_tokens,
        num_loading=len(scheduler.loading),
        tiers=None if tiers is None else tiers.stats(),
        tenant_blocks=tenant_blocks(scheduler.running, cache),
        prefix_misses=dict(reports.misses),
        tenant_prefix_tokens={t: (q, h) for t, (q, h) in reports.tokens.items()})


class EngineMetrics:
    """Blocks by state, tokens, prefix-cache and preemption counters, request queues."""

    def __init__(self, pool_bytes_per_rank: list[int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.blocks = Gauge("paged_kv_blocks", "KV blocks by state", ["state"], registry=r)
        self.live_tokens = Gauge("paged_kv_live_tokens", "Tokens held in live blocks",
                                 registry=r)
        self.empty_slots = Gauge("paged_kv_empty_slots", "Allocated but unfilled slots",
                                 registry=r)
        self.prefix_queries = Counter("paged_kv_prefix_query_tokens",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("paged_kv_prefix_hit_tokens",
                                   "Prompt tokens found in the prefix cache", registry=r)
        self.preemptions = Counter("paged_kv_preemptions", "Sequences preempted", registry=r)
        self.running = Gauge("paged_kv_running_requests", "Sequences running", registry=r)
        self.waiting = Gauge("paged_kv_waiting_requests", "Sequences waiting or swapped",
                             registry=r)
        self.generated = Counter("paged_kv_generated_tokens", "Tokens generated", registry=r)
        self.pool_bytes = Gauge("paged_kv_pool_bytes", "KV pool bytes by tensor-parallel rank",
                                ["rank"], registry=r)
        # a hybrid layout's blocks by layer kind, and what its window rows gave back
        self.kind_blocks = Gauge("paged_kv_blocks_by_kind", "KV blocks held by sequences, "
                                 "by layer kind (hybrid layouts)", ["kind"], registry=r)
        self.given_back = Gauge("paged_kv_given_back_blocks", "Blocks window and chunked "
                                "layers gave back as their window moved on (cumulative)",
                                registry=r)
        self.given_back_bytes = Gauge("paged_kv_given_back_bytes", "Bytes of those blocks "
                                      "(cumulative)", registry=r)
        self.states = _StateMetrics(r)  # a model with recurrent layers: its state slab
        for rank, nbytes in enumerate(pool_bytes_per_rank):
            self.pool_bytes.labels(rank=str(rank)).set(nbytes)
        self._seen = (0, 0, 0)
        self._pending, self._observed_at = 0, 0.0  # tokens not yet counted; last observe
        self._tier_metrics: _TierMetrics | None = None
        self.tenants = _TenantMetrics(r)
        # label children resolved once: observe() runs several times a second
        self._block_gauges = tuple(self.blocks.labels(state=state)
                                   for state in ("live", "cached", "free"))

    def after_step(self, stats: Callable[[], EngineStats], num_generated: int) -> None:
        """Count a step's tokens; read `stats` and update the rest at most every
        `OBSERVE_PERIOD_S` (gauges and catch-up counters lose nothing by waiting, and every
        scrape observes first), not at every step."""
        self._pending += num_generated
        now = time.monotonic()
        if now - self._observed_at >= OBSERVE_PERIOD_S:
            self.observe(stats(), 0)

    def observe(self, stats: EngineStats, num_generated: int) -> None:
        """Update from an `Engine.stats` snapshot: gauges are set, counters advance by what
        is new (`num_generated` tokens besides those `after_step` counted)."""
        self._observed_at = time.monotonic()
        num_generated, self._pending = num_generated + self._pending, 0
        for gauge, value in zip(self._block_gauges, (stats.num_live_blocks,
                                                     stats.num_cached_blocks,
                                                     stats.num_free_blocks), strict=True):
            gauge.set(value)
        totals = (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.num_preemptions)
        for counter, total, seen in zip((self.prefix_queries, self.prefix_hits, self.preemptions),
                                        totals, self._seen, strict=True):
            counter.inc(total - seen)
        self._seen = totals
        if stats.tiers is not None:
            if self._tier_metrics is None:
                self._tier_metrics = _TierMetrics(self.registry)
            self._tier_metrics.observe(stats.tiers)
        self.tenants.observe(stats)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + stats.num_swapped)
        self.generated.inc(num_generated)

    def text(self, cache: PagedKVCache) -> str:
        """Exposition text; token gauges are read now (they need a pass over the tables)."""
        stats = cache.stats()
        self.live_tokens.set(stats.num_live_tokens)
        self.empty_slots.set(stats.num_empty_slots)
        for kind, count in stats.blocks_by_kind:
            self.kind_blocks.labels(kind=kind).set(count)
        if stats.blocks_by_kind:
            self.given_back.set(stats.num_given_back)
            self.given_back_bytes.set(stats.bytes_given_back)
        if stats.state_bytes:
            self.states.observe(stats)
        return generate_latest(self.registry).decode()


class _StateMetrics:
    """The state slab of a model with recurrent layers: slots and bytes by use (a running
    sequence's live state, a prefix checkpoint), checkpoints written / hit / evicted."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.slots = Gauge("paged_kv_states", "State slab slots by use (live: a running "
                           "sequence's state; checkpoint: a prefix cache's)", ["use"],
                           registry=registry)
        self.bytes = Gauge("paged_kv_state_bytes", "Bytes of the state slab by use (slab: "
                           "all of it)", ["use"], registry=registry)
        self.events = Gauge("paged_kv_state_checkpoints", "State checkpoints written, served "
                            "to a prefix hit, evicted (cumulative)", ["event"],
                            registry=registry)

    def observe(self, stats: CacheStats) -> None:
        """Set every gauge from `stats` (`PagedKVCache.stats`)."""
        self.slots.labels(use="live").set(stats.num_live_states)
        self.slots.labels(use="checkpoint").set(stats.num_checkpoints)
        self.bytes.labels(use="slab").set(stats.state_bytes)
        self.bytes.labels(use="checkpoint").set(stats.checkpoint_bytes)
        for event, total in (("written", stats.checkpoints_written),
                             ("hit", stats.checkpoints_hit),
                             ("evicted", stats.checkpoints_evicted)):
            self.events.labels(event=event).set(total)


class _TierMetrics:
    """The tiers' metrics: contents by tier, counters by tier, fetch durations."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Gauge("paged_kv_tier_blocks", "Blocks held by tier", ["tier"],
                            registry=registry)
        self.bytes = Gauge("paged_kv_tier_bytes", "Bytes held by tier", ["tier"],
                           registry=registry)
        self.tenant_blocks = Gauge("paged_kv_tier_tenant_blocks", "Blocks held by tier and "
                                   "tenant (\"\": no salt, or one a policy does not name)",
                                   ["tier", "tenant"], registry=registry)
        self.counters = {field: Counter(name, doc, ["tier"], registry=registry)
                         for field, (name, doc) in TIER_COUNTERS.items()}
        self.fetch_counters = {field: Counter(name, doc, registry=registry)
                               for field, (name, doc) in FETCH_COUNTERS.items()}
        self.fetch_seconds = Histogram(
            "paged_kv_tier_fetch_seconds", "Seconds from a fetch's start to its end",
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0), registry=registry)
        self._seen: dict[tuple[str, str], int] = {}

    def _advance(self, counter, key: tuple[str, str], total: int) -> None:
        counter.inc(total - self._seen.get(key, 0))
        self._seen[key] = total

    def observe(self, stats: TiersStats) -> None:
        for tier in stats.tiers:
            self.blocks.labels(tier=tier.tier).set(tier.blocks)
            self.bytes.labels(tier=tier.tier).set(tier.bytes)
            for tenant, blocks in tier.tenant_blocks.items():
                self.tenant_blocks.labels(tier=tier.tier, tenant=tenant).set(blocks)
            for field, counter in self.counters.items():
                self._advance(counter.labels(tier=tier.tier), (tier.tier, field),
                              getattr(tier, field))
        for field, counter in self.fetch_counters.items():
            self._advance(counter, ("", field), getattr(stats, field))
        new = stats.fetches - self._seen.get(("", "fetches"), 0)
        for seconds in stats.recent_fetch_seconds[-new:] if new > 0 else ():
            self.fetch_seconds.observe(seconds)
        self._seen[("", "fetches")] = stats.fetches


class _TenantMetrics:
    """Blocks by tenant and state, prefix misses by reason and tenant, prefix tokens by
    tenant. Tenant ``""``: requests without a salt (and, under a policy, salts it does not
    name). Labels are tenants, so their number is the server's tenants (its API keys') or,
    in a library, the salts its caller uses."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Gauge("paged_kv_tenant_blocks", "KV blocks by tenant and state: live "
                            "(running requests'), cached (evictable, retained included; "
                            "with a tenant policy), retained (with a tenant policy)",
                            ["tenant", "state"], registry=registry)
        self.misses = Counter("paged_kv_prefix_misses", "Requests whose first uncached "
                              "prompt block missed, by reason and tenant",
                              ["reason", "tenant"], registry=registry)
        self.queries = Counter("paged_kv_tenant_prefix_query_tokens", "Prompt tokens looked "
                               "up in the prefix cache, by tenant (at first admission)",
                               ["tenant"], registry=registry)
        self.hits = Counter("paged_kv_tenant_prefix_hit_tokens", "Prompt tokens found in "
                            "the prefix cache, by tenant (at first admission)",
                            ["tenant"], registry=registry)
        self._shown: set[tuple[str, str]] = set()  # gauge labels set before
        self._seen: dict[tuple, int] = {}  # counter totals already counted

    def _advance(self, counter, key: tuple, total: int) -> None:
        seen = self._seen.get(key, 0)
        if total != seen:
            counter.inc(total - seen)
            self._seen[key] = total

    def observe(self, stats: EngineStats) -> None:
        now = {(tenant, state): count for tenant, state, count in stats.tenant_blocks}
        # a tenant whose sequences all finished reads 0, not its last count
        for tenant, state in self._shown - now.keys():
            self.blocks.labels(tenant=tenant, state=state).set(0)
        for (tenant, state), count in now.items():
            self.blocks.labels(tenant=tenant, state=state).set(count)
        self._shown |= now.keys()
        for (reason, tenant), total in stats.prefix_misses.items():
            self._advance(self.misses.labels(reason=reason, tenant=tenant),
                          ("miss", reason, tenant), total)
        for tenant, (queried, hit) in stats.tenant_prefix_tokens.items():
            self._advance(self.queries.labels(tenant=tenant), ("query", tenant), queried)
            self._advance(self.hits.labels(tenant=tenant), ("hit", tenant), hit)
