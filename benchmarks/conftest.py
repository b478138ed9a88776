"""Shared fixtures for the pytest-benchmark suite (``pytest benchmarks/ --benchmark-only``)."""

from __future__ import annotations

import numpy as np
import torch

from paged_kv import CacheConfig, PagedKVCache


def decoding_cache(num_seqs: int, prompt_len: int, *, num_layers: int = 1, num_kv_heads: int = 8,
                   head_dim: int = 128, dtype: torch.dtype = torch.float16,
                   enable_prefix_caching: bool = True, seed: int = 0) -> PagedKVCache:
    """A cache holding `num_seqs` prefilled sequences of ragged lengths around `prompt_len`."""
    block_size = 16
    num_blocks = num_seqs * (prompt_len * 2 // block_size + 8) + 2
    config = CacheConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                         enable_prefix_caching=enable_prefix_caching)
    cache = PagedKVCache(config)
    rng = np.random.default_rng(seed)
    for i in range(num_seqs):
        prompt = rng.integers(0, 32000, prompt_len + int(rng.integers(0, 16))).tolist()
        cache.add_sequence(i, prompt)
        cache.prepare({i: prompt})
    return cache
