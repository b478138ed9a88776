"""A swapped-out sequence comes back exactly: swap-in restores the K/V codes and the 8-bit
scales from the host pool, even when its old device blocks were reused meanwhile."""

from __future__ import annotations

import pytest
import torch

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
