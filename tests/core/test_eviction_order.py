"""Which cached blocks go first when the allocator must evict: the least recently freed
sequence before the others, and a sequence's tail before its prefix (so a shared prefix
outlives the answers that followed it). Each test names the fault it catches."""

from __future__ import annotations

from paged_kv import PagedKVCache
from paged_kv.core.step.prefix import match_prefix

from ..conftest import tiny_config


def _cache_with_freed(prompts: dict[str, list[int]]) -> PagedKVCache:
    """Each prompt prepared and freed in order: their full blocks are cached."""
    cache = PagedKVCache(tiny_config(num_blocks=9, block_size=4))  # 8 usable
    for seq_id, prompt in prompts.items():
        cache.add_sequence(seq_id, prompt)
        cache.prepare({seq_id: prompt})
    for seq_id in prompts:
        cache.free(seq_id)
    return cache


def test_the_least_recently_freed_sequence_is_evicted_first():
    """Fault: the most recently freed sequence's blocks put at the evict-first end."""
    a, b = list(range(100, 109)), list(range(200, 209))  # 2 full blocks + 1 token each
    cache = _cache_with_freed({"a": a, "b": b})
    assert cache.stats().num_cached_blocks == 4 and cache.stats().num_free_blocks == 4
    cache.add_sequence("c")
    cache.prepare({"c": 6 * 4})  # the 4 free blocks, then 2 cached ones evicted
    assert match_prefix(cache.allocator, a, 4) == 0, "a was freed first: it goes first"
    assert match_prefix(cache.allocator, b, 4) == 8, "b, freed last, must survive"
    cache.check()


def test_a_sequences_tail_is_evicted_before_its_prefix():
    """Fault: a freed sequence's blocks evicted head first (its shared prefix lost first)."""
    a = list(range(100, 109))
    cache = _cache_with_freed({"a": a})
    cache.add_sequence("c")
    cache.prepare({"c": 7 * 4})  # 6 free blocks + one cached evicted
    assert match_prefix(cache.allocator, a, 4) == 4, "the prefix block outlives the tail"
