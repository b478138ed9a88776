"""Tests for faults that were planted in the code and that no test caught (issue 20): each
fails with its fault planted again (the fault is named in the docstring)."""

from __future__ import annotations

import pytest
import torch

from paged_kv import PagedKVCache
from paged_kv.serving import sizing
from paged_kv.step.prefix import match_prefix

from ..conftest import tiny_config
from .test_quantised import KV_CACHE_DTYPES, cache_with_sequences


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_swap_in_restores_codes_and_scales_into_overwritten_blocks(kv_cache_dtype):
    """Fault: `swap_in` moves the K/V codes but not the 8-bit scales (or moves nothing).

    The swapped-out sequence's device blocks are all taken and overwritten by another
    sequence with values of another magnitude before it comes back, so nothing of it is
    left on the device: only what the host pool kept can restore it.
    """
    cache, _, _ = cache_with_sequences(kv_cache_dtype, [12, 9], num_host_blocks=8)
    before_k, before_v = cache.gather(0, ["s1"])
    cache.swap_out("s1")
    free_tokens = cache.stats().num_free_blocks * cache.config.block_size
    cache.add_sequence("z")
    batch = cache.prepare({"z": free_tokens})  # every free block, s1's old ones included
    big = torch.randn(free_tokens, 2, 32) * 1000
    cache.write(0, big, -big, batch)
    cache.free("z")
    cache.swap_in("s1")
    k, v = cache.gather(0, ["s1"])
    assert torch.equal(k, before_k) and torch.equal(v, before_v), "swap_in lost codes or scales"
    cache.check()


def test_cuda_pool_is_sized_from_free_not_total_memory(monkeypatch):
    """Fault: the CUDA pool sized from ``mem_get_info``'s total instead of its free bytes."""
    free, total = 3 * 2**30, 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    assert sizing.free_memory_bytes("cuda") == free
    assert sizing.free_memory_bytes(torch.device("cuda", 0)) == free


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
