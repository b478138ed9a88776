"""The ``quantised`` workload at small size: write_kv / gather_kv on float16, int8 and fp8 pages
(the torch path), with the tokens each format fits in 1 GiB and its attention error as
``extra_info``."""

from __future__ import annotations

import pytest
import torch

from paged_kv import CacheConfig
from paged_kv.bench.workloads.kernels import HEAD_DIM, NUM_KV_HEADS, PagedSetup
from paged_kv.bench.workloads.quantised import attention_errors
from paged_kv.kernels import gather_kv, write_kv

SETUP = PagedSetup(num_seqs=4, max_len=512, dtype=torch.float16, device=torch.device("cpu"))
FORMATS = ["auto", "int8", "fp8_e4m3"]
ERRORS = attention_errors()


def _pages(kv_cache_dtype: str) -> tuple[tuple, tuple]:
    if kv_cache_dtype == "auto":
        return (SETUP.key_cache, SETUP.value_cache), (None, None)
    dtype = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=1,
                        kv_cache_dtype=kv_cache_dtype).cache_dtype
    pages = tuple(torch.zeros(SETUP.key_cache.shape, dtype=dtype) for _ in "kv")
    return pages, tuple(torch.zeros(SETUP.key_cache.shape[:3], dtype=torch.bfloat16)
                        for _ in "kv")


@pytest.mark.benchmark(group="quantised: write_kv + gather_kv, 4 seqs x 512, 8 x 128")
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_write_then_gather(benchmark, kv_cache_dtype):
    pages, scales = _pages(kv_cache_dtype)
    new = torch.randn(SETUP.num_tokens, NUM_KV_HEADS, HEAD_DIM).half()
    slots = SETUP.slot_mapping()
    out = tuple(torch.empty(4, SETUP.max_len, NUM_KV_HEADS, HEAD_DIM).half() for _ in "kv")
    kw = {} if scales[0] is None else dict(key_scales=scales[0], value_scales=scales[1])

    def step():
        write_kv(new, new, *pages, slots, *scales)
        return gather_kv(*pages, SETUP.block_tables, SETUP.seq_lens, SETUP.max_len, out, **kw)

    keys, _ = benchmark(step)
    shape = dict(num_layers=32, num_kv_heads=32, head_dim=128, dtype=torch.float16)
    config = CacheConfig.for_memory(1 << 30, kv_cache_dtype=kv_cache_dtype, **shape)
    benchmark.extra_info.update(
        tokens_in_1_gib=config.num_usable_blocks * config.block_size,
        attention_error=ERRORS["float16 pages" if kv_cache_dtype == "auto" else kv_cache_dtype])
    first = new[:SETUP.seq_lens[0]].float()
    assert (keys[0, :SETUP.seq_lens[0]].float() - first).abs().max() <= 0.1 * first.abs().max()
