"""The ``kernels`` workload at small size: each kernel and its ``dst.copy_(src)`` of the same bytes;
paged attention against gather + SDPA and SDPA on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_kv.bench.workloads.kernels import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    PagedSetup,
    copy_baseline,
)
from paged_kv.kernels import copy_blocks, gather_kv, gather_kv_packed, paged_attention, write_kv

CPU = torch.device("cpu")
SETUP = PagedSetup(num_seqs=4, max_len=512, dtype=torch.float16, device=CPU)


def _ops():
    s = SETUP
    new = torch.randn(s.num_tokens, NUM_KV_HEADS, HEAD_DIM).half()
    slots = s.slot_mapping()
    num_slots = s.key_cache.shape[0] * s.key_cache.shape[1]
    random_slots = torch.randperm(num_slots)[: s.num_tokens]
    padded = tuple(s.key_cache.new_empty(4, s.max_len, NUM_KV_HEADS, HEAD_DIM) for _ in "kv")
    packed = tuple(s.key_cache.new_empty(s.num_tokens, NUM_KV_HEADS, HEAD_DIM) for _ in "kv")
    pool = torch.stack([s.key_cache, s.value_cache])[None]
    half = (pool.shape[2] - 1) // 2
    src, dst = torch.arange(1, half + 1), torch.arange(half + 1, 2 * half + 1)
    order = torch.randperm(2 * half, generator=torch.Generator().manual_seed(1)) + 1
    per_token = NUM_KV_HEADS * HEAD_DIM
    return {
        "write_kv": (lambda: write_kv(new, new, s.key_cache, s.value_cache, slots),
                     s.num_tokens * per_token),
        "gather_kv": (lambda: gather_kv(s.key_cache, s.value_cache, s.block_tables,
                                        s.seq_lens, s.max_len, padded), padded[0].numel()),
        "gather_kv_packed": (lambda: gather_kv_packed(s.key_cache, s.value_cache,
                                                      s.block_tables, s.seq_lens,
                                                      s.cu_seqlens, packed),
                             s.num_tokens * per_token),
        "copy_blocks": (lambda: copy_blocks(pool, src, dst), half * 16 * per_token),
        "copy_blocks (scattered ids)": (lambda: copy_blocks(pool, order[:half], order[half:]),
                                        half * 16 * per_token),
        # the worst case of a write: every token to a random slot of the pool
        "write_kv (random slots)": (lambda: write_kv(new, new, s.key_cache, s.value_cache,
                                                     random_slots), s.num_tokens * per_token),
    }


OPS = _ops()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("path", ["paged", "copy_"])
def test_bandwidth(benchmark, op, path):
    fn, num_elements = OPS[op]
    benchmark.group = f"{op} vs copy_ of the same bytes"
    benchmark.extra_info["bytes"] = 2 * num_elements * 2
    benchmark(fn if path == "paged" else copy_baseline(num_elements, torch.float16, CPU))


ATTENTION = PagedSetup(num_seqs=4, max_len=512, dtype=torch.float32, device=CPU)


@pytest.mark.benchmark(group="decode attention, 4 seqs x 512, float32")
@pytest.mark.parametrize("path", ["paged_attention", "gather + SDPA", "SDPA contiguous"])
def test_attention(benchmark, path):
    s = ATTENTION
    query = torch.randn(4, NUM_Q_HEADS, HEAD_DIM)
    mask = (torch.arange(s.max_len)[None, :] < s.seq_lens[:, None])[:, None, None, :]
    k, v = gather_kv(s.key_cache, s.value_cache, s.block_tables, s.seq_lens, s.max_len)
    contiguous = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())

    def sdpa(key, value):
        return F.scaled_dot_product_attention(query[:, :, None], key, value, attn_mask=mask,
                                              enable_gqa=True)

    def gathered():
        key, value = gather_kv(s.key_cache, s.value_cache, s.block_tables, s.seq_lens,
                               s.max_len, (k, v))
        return sdpa(key.transpose(1, 2), value.transpose(1, 2))

    fns = {"paged_attention": lambda: paged_attention(
               query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens,
               torch.arange(5, dtype=torch.int32)),
           "gather + SDPA": gathered, "SDPA contiguous": lambda: sdpa(*contiguous)}
    benchmark(fns[path])
