"""Engine metrics in a prometheus-client registry of the engine's own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

if TYPE_CHECKING:
    from ..cache import PagedKVCache
    from .outputs import EngineStats


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
        for rank, nbytes in enumerate(pool_bytes_per_rank):
            self.pool_bytes.labels(rank=str(rank)).set(nbytes)
        self._seen = (0, 0, 0)
        # label children resolved once: observe() runs every step
        self._block_gauges = tuple(self.blocks.labels(state=state)
                                   for state in ("live", "cached", "free"))

    def observe(self, stats: EngineStats, num_generated: int) -> None:
        """Update from one step's `Engine.stats` snapshot: gauges are set, counters advance
        by what is new."""
        for gauge, value in zip(self._block_gauges, (stats.num_live_blocks,
                                                     stats.num_cached_blocks,
                                                     stats.num_free_blocks), strict=True):
            gauge.set(value)
        totals = (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.num_preemptions)
        for counter, total, seen in zip((self.prefix_queries, self.prefix_hits, self.preemptions),
                                        totals, self._seen, strict=True):
            counter.inc(total - seen)
        self._seen = totals
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + stats.num_swapped)
        self.generated.inc(num_generated)

    def text(self, cache: PagedKVCache) -> str:
        """Exposition text; token gauges are read now (they need a pass over the tables)."""
        stats = cache.stats()
        self.live_tokens.set(stats.num_live_tokens)
        self.empty_slots.set(stats.num_empty_slots)
        return generate_latest(self.registry).decode()
