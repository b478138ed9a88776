"""CacheStats: every block in exactly one state, bytes equal to the pool's, sharing counted."""

from __future__ import annotations

import torch

from paged_kv import PagedKVCache

from ..conftest import tiny_config


def _partition_holds(cache: PagedKVCache) -> None:
    s = cache.stats()
    assert s.num_live_blocks + s.num_cached_blocks + s.num_free_blocks == s.num_blocks - 1
    assert s.total_bytes == cache.pool.kv.nbytes == cache.config.total_bytes
    assert s.live_bytes == s.num_live_blocks * cache.config.bytes_per_block
    assert s.num_live_tokens + s.num_empty_slots == s.num_live_blocks * cache.config.block_size


def test_total_bytes_is_the_pool_and_an_empty_cache_is_all_free():
    cache = PagedKVCache(tiny_config(dtype=torch.bfloat16, num_blocks=33))
    s = cache.stats()
    assert s.total_bytes == cache.pool.kv.nbytes == 33 * cache.config.bytes_per_block
    assert (s.num_live_blocks, s.num_cached_blocks, s.num_free_blocks) == (0, 0, 32)
    assert s.sequences == () and s.usage == 0.0


def test_live_tokens_and_empty_slots():
    cache = PagedKVCache(tiny_config())  # block_size 4
    cache.add_sequence("a")
    cache.add_sequence("b")
    cache.prepare({"a": list(range(6)), "b": 3})
    s = cache.stats()
    assert s.num_live_blocks == 3 and s.num_live_tokens == 9 and s.num_empty_slots == 3
    assert [q.num_empty_slots for q in s.sequences] == [2, 1]
    assert [q.seq_id for q in s.sequences] == ["a", "b"]
    _partition_holds(cache)


def test_fork_shares_blocks_and_counts_savings():
    cache = PagedKVCache(tiny_config())
    cache.add_sequence("p")
    cache.prepare({"p": list(range(10))})  # 3 blocks, last holds 2 tokens
    for i in range(3):
        cache.fork("p", f"c{i}")
    s = cache.stats()
    assert s.num_live_blocks == 3 and s.num_shared_blocks == 3
    assert s.bytes_saved_by_sharing == 3 * 3 * cache.config.bytes_per_block
    assert s.num_live_tokens == 10, "shared slots are physical: counted once"
    assert all(q.num_shared_blocks == 3 for q in s.sequences)
    # each child's first write copies the shared partial block (copy-on-write)
    cache.prepare({"c0": [1], "c1": [1]})
    s = cache.stats()
    assert s.num_live_blocks == 5 and s.num_shared_blocks == 3
    # full blocks: 4 owners each (3 saved); the partial one: p and c2 left (1 saved)
    assert s.bytes_saved_by_sharing == (3 * 2 + 1) * cache.config.bytes_per_block
    _partition_holds(cache)
    cache.check()


def test_prefix_hits_are_counted_and_shared():
    cache = PagedKVCache(tiny_config())
    prompt = list(range(11))
    assert cache.add_sequence("a", prompt) == 0
    cache.prepare({"a": prompt})
    assert cache.add_sequence("b", prompt) == 8  # 2 full blocks; the last token recomputed
    s = cache.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (22, 8)
    assert s.num_shared_blocks == 2 and s.bytes_saved_by_sharing == 2 * cache.config.bytes_per_block
    assert s.prefix_hit_rate == 8 / 22


def test_freed_prefix_is_cached_not_free_and_revives_on_hit():
    cache = PagedKVCache(tiny_config())
    prompt = list(range(9))
    cache.add_sequence("a", prompt)
    cache.prepare({"a": prompt})
    cache.free("a")
    s = cache.stats()
    assert (s.num_live_blocks, s.num_cached_blocks) == (0, 2), "full blocks stay reusable"
    assert s.num_free_blocks == s.num_blocks - 3 and s.usage == 0.0
    assert cache.add_sequence("b", prompt) == 8
    s = cache.stats()
    assert (s.num_live_blocks, s.num_cached_blocks) == (2, 0)
    _partition_holds(cache)


def test_eviction_takes_tails_first_and_prefix_outlives_them():
    cache = PagedKVCache(tiny_config(num_blocks=6))  # 5 usable
    prompt = list(range(12))
    cache.add_sequence("a", prompt)
    cache.prepare({"a": [*prompt, 99]})  # 4 blocks, 3 full and indexed
    cache.free("a")
    cache.allocator.take_events()
    cache.add_sequence("b")
    cache.prepare({"b": 3 * 4})  # needs 3: the 2 free + 1 cached, evicted
    evicted = [e for e in cache.allocator.take_events() if e.kind == "evicted"]
    assert [e.block_ids for e in evicted] == [(3,)], "the tail block goes first"
    assert cache.add_sequence("c", [*prompt, 5]) == 8, "the prefix survived eviction"
    cache.check()


def test_swapped_blocks_are_accounted_in_the_host_pool():
    cache = PagedKVCache(tiny_config())
    cache.add_sequence("a")
    cache.prepare({"a": 7})
    cache.swap_out("a")
    s = cache.stats()
    assert s.num_live_blocks == 0 and s.num_swapped_blocks == 2 and s.num_swap_outs == 1
    assert s.sequences[0].is_swapped
    cache.swap_in("a")
    assert cache.stats().num_live_blocks == 2 and cache.stats().num_swapped_blocks == 0


def test_reset_prefix_cache_drops_only_cached_blocks():
    cache = PagedKVCache(tiny_config())
    for seq_id, prompt in (("a", list(range(8))), ("b", list(range(20, 29)))):
        cache.add_sequence(seq_id, prompt)
        cache.prepare({seq_id: prompt})
    cache.free("a")
    assert cache.reset_prefix_cache() == 2
    s = cache.stats()
    assert s.num_cached_blocks == 0 and s.num_live_blocks == 3
    assert cache.add_sequence("c", list(range(20, 29))) == 0, "the index was emptied"
    cache.check()


def _write_all(cache: PagedKVCache, batch, base: float) -> None:
    """Write K = V = base + token index (per layer and step) so reads can be checked."""
    values = base + torch.arange(batch.num_tokens, dtype=torch.float32)
    kv = values[:, None, None].expand(batch.num_tokens, 2, 4).contiguous()
    for layer in range(2):
        cache.write(layer, kv, kv, batch)


def test_truncate_into_an_indexed_block_copies_it_before_writing():
    cache = PagedKVCache(tiny_config())
    prompt = list(range(9))
    cache.add_sequence("a", prompt)
    _write_all(cache, cache.prepare({"a": prompt}), 0.0)
    cache.truncate("a", 6)  # block 1 (tokens 4-7) was full and indexed, now partial
    _write_all(cache, cache.prepare({"a": [50, 51]}), 100.0)
    assert cache.add_sequence("b", prompt) == 8, "the cached prefix survives the rewrite"
    keys, _ = cache.gather(0, ["a", "b"])
    assert keys[1, :8, 0, 0].tolist() == [float(i) for i in range(8)], "cached K/V intact"
    assert keys[0, :8, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 100, 101], "a sees its rewrite"
    assert cache.tables.num_tokens_of("a") == 8 and cache.stats().num_live_blocks == 3
    cache.check()


def test_fork_truncate_free_then_write_does_not_corrupt_the_prefix_cache():
    """The shared kept block loses its other owner before the write: still copied."""
    cache = PagedKVCache(tiny_config())
    prompt = list(range(1, 9))
    cache.add_sequence("a", prompt)
    _write_all(cache, cache.prepare({"a": prompt}), 0.0)
    cache.fork("a", "b")
    cache.truncate("a", 6)
    cache.free("b")
    _write_all(cache, cache.prepare({"a": [99]}), -1.0)
    assert cache.add_sequence("c", [*prompt, 5]) == 8
    keys, _ = cache.gather(0, ["c"])
    assert keys[0, :8, 0, 0].tolist() == [float(i) for i in range(8)], "prefix overwritten"
    cache.check()
