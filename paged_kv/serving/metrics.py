"""Engine metrics in a prometheus-client registry of the engine's own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

if TYPE_CHECKING:
    from ..cache import PagedKVCache
    from .scheduler import Scheduler


class EngineMetrics:
    """Blocks by state, tokens, prefix-cache and preemption counters, request queues."""

    def __init__(self) -> None:
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
        self._seen = (0, 0, 0)
        # label children resolved once: observe() runs every step
        self._block_gauges = tuple(self.blocks.labels(state=state)
                                   for state in ("live", "cached", "free"))

    def observe(self, cache: PagedKVCache, scheduler: Scheduler, num_generated: int) -> None:
        """Update from one step from the owners' counters (no per-sequence work): gauges
        are set, counters advance by what is new."""
        allocator = cache.allocator
        for gauge, value in zip(self._block_gauges, (allocator.num_live_blocks,
                                                     allocator.num_cached_blocks,
                                                     allocator.num_free_blocks), strict=True):
            gauge.set(value)
        totals = (allocator.prefix_query_tokens, allocator.prefix_hit_tokens,
                  scheduler.num_preemptions)
        for counter, total, seen in zip((self.prefix_queries, self.prefix_hits, self.preemptions),
                                        totals, self._seen, strict=True):
            counter.inc(total - seen)
        self._seen = totals
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting) + len(scheduler.swapped))
        self.generated.inc(num_generated)

    def text(self, cache: PagedKVCache) -> str:
        """Exposition text; token gauges are read now (they need a pass over the tables)."""
        stats = cache.stats()
        self.live_tokens.set(stats.num_live_tokens)
        self.empty_slots.set(stats.num_empty_slots)
        return generate_latest(self.registry).decode()
