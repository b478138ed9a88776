"""Core cache benchmarks: step bookkeeping, kernel bandwidth against copy_, per-step cost.

Run: ``pytest benchmarks/test_core.py --benchmark-only``. Each group holds the paged op and
its baseline measured in the same run; pytest-benchmark prints their ratio in parentheses.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv import CacheConfig, PagedKVCache
from paged_kv.kernels import gather_kv, write_kv

from .conftest import decoding_cache


@pytest.mark.benchmark(group="step bookkeeping, 256 decoding sequences")
def test_prepare_decode_step(benchmark):
    cache = decoding_cache(256, 500, num_kv_heads=1, head_dim=8)
    step = {i: [7] for i in range(256)}

    def one_step():
        batch = cache.prepare(step)
        return batch.slot_mapping

    # the pool has room for ~2x the prompt, so 4000 steps of one token each still fit
    benchmark.pedantic(one_step, rounds=400, iterations=1, warmup_rounds=20)
    cache.check()


def _bandwidth_case(num_seqs: int = 32, length: int = 1024):
    cache = decoding_cache(num_seqs, length, num_kv_heads=8, head_dim=128)
    batch = cache.prepare({i: 1 for i in range(num_seqs)})
    key_cache, value_cache = cache.pool.layer(0)
    return cache, batch, key_cache, value_cache


@pytest.mark.benchmark(group="gather vs copy_ (32 x 1K tokens, 8x128 fp16)")
def test_gather_kv(benchmark):
    _, batch, key_cache, value_cache = _bandwidth_case()
    length = -(-batch.max_seq_len // 16) * 16  # whole blocks: the fast path
    out = tuple(torch.empty(batch.batch_size, length, 8, 128, dtype=torch.float16)
                for _ in range(2))
    benchmark(gather_kv, key_cache, value_cache, batch.block_tables, batch.seq_lens,
              length, out)


@pytest.mark.benchmark(group="gather vs copy_ (32 x 1K tokens, 8x128 fp16)")
def test_gather_baseline_copy(benchmark):
    _, batch, _, _ = _bandwidth_case()
    shape = (batch.batch_size, -(-batch.max_seq_len // 16) * 16, 8, 128)
    src = [torch.randn(shape).half() for _ in range(2)]
    dst = [torch.empty(shape, dtype=torch.float16) for _ in range(2)]
    benchmark(lambda: [d.copy_(s) for d, s in zip(dst, src, strict=True)])


@pytest.mark.benchmark(group="write vs copy_ (8K tokens, 8x128 fp16)")
def test_write_kv(benchmark):
    """A prefill step's slots: 8 sequences of 1K tokens in their (scattered) blocks."""
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=8, head_dim=128,
                                     num_blocks=1100, dtype=torch.float16))
    for i in range(8):  # interleaved sequences, so each one's blocks are scattered
        cache.add_sequence(i)
        cache.prepare({i: 64})
    batch = cache.prepare({i: 1024 for i in range(8)})
    key_cache, value_cache = cache.pool.layer(0)
    key = torch.randn(batch.num_tokens, 8, 128).half()
    benchmark(write_kv, key, key, key_cache, value_cache, batch.slot_mapping)


@pytest.mark.benchmark(group="write vs copy_ (8K tokens, 8x128 fp16)")
def test_write_kv_random_slots(benchmark):
    """The worst case: every token to a random slot."""
    _, _, key_cache, value_cache = _bandwidth_case()
    slots = torch.randperm(key_cache.shape[0] * key_cache.shape[1])[:8192]
    key = torch.randn(8192, 8, 128).half()
    benchmark(write_kv, key, key, key_cache, value_cache, slots)


@pytest.mark.benchmark(group="write vs copy_ (8K tokens, 8x128 fp16)")
def test_write_baseline_copy(benchmark):
    src = [torch.randn(8192, 8, 128).half() for _ in range(2)]
    dst = [torch.empty(8192, 8, 128, dtype=torch.float16) for _ in range(2)]
    benchmark(lambda: [d.copy_(s) for d, s in zip(dst, src, strict=True)])


@pytest.mark.benchmark(group="per-step cost against sequence length (8 seqs, decode)")
@pytest.mark.parametrize("length", [128, 512, 1024, 2048, 4096])
def test_step_cost_against_length(benchmark, length):
    """prepare + write of one token per sequence: should stay flat as history grows."""
    cache = decoding_cache(8, length, num_kv_heads=8, head_dim=128)
    key = torch.randn(8, 8, 128).half()

    def one_step():
        batch = cache.prepare({i: [3] for i in range(8)})
        cache.write(0, key, key, batch)

    benchmark.pedantic(one_step, rounds=200, iterations=1, warmup_rounds=10)
