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


def test_4bit_rows_against_their_targets():
    """int4 / nvfp4 capacity at head_dim 128 is the bytes' arithmetic; attention cosine on
    outlier keys is near 1 for every variant; both targets are judged."""
    from paged_kv.bench.workloads import quantised4 as q4

    figures, _ = q4.capacity_figures()
    ratios = {f.name.split(", ")[1]: f.ratio for f in figures}
    # float16 512 B a token-head pair against 64 + 16 (int4) and 64 + 8 (nvfp4)
    assert ratios["int4 pages (Llama-2-7B shape"] == pytest.approx(256 / 80, rel=0.01)
    assert ratios["nvfp4 pages (Llama-2-7B shape"] == pytest.approx(256 / 72, rel=0.01)
    cosines, _ = q4.cosine_figures()
    assert len(cosines) == len(q4.VARIANTS)
    assert all(0.98 < f.value.median <= 1.0 for f in cosines)
    verdicts = q4.targets(figures + cosines)
    assert len(verdicts) == 2
    assert all(v.startswith(("met: ", "MISSED: ")) for v in verdicts.values())


def test_4bit_decode_and_greedy_rows():
    """Decode speed rows against int8 pages (the quick sizes), and greedy agreement with
    float pages on the demo model: int8 nearly always agrees, 4-bit first tokens at least
    tests/core/test_pages4.py's bounds."""
    from paged_kv.bench.scale import QUICK
    from paged_kv.bench.workloads import quantised4 as q4

    speeds = q4.decode_figures(QUICK)
    assert len(speeds) == len(q4.VARIANTS)
    assert all(f.value.median > 0 and f.baseline.median > 0 for f in speeds)
    figures, info = q4.agreement_figures()
    agreement = {f.name.rsplit(", ", 1)[1]: f.value.median for f in figures}
    assert agreement["int8"] >= 0.9
    bounds = {"int4": 10, "int4+rotation": 11, "nvfp4": 6, "nvfp4+rotation": 7}
    for variant, at_least in bounds.items():
        first = int(info[f"4-bit: first tokens equal to float pages', {variant}"].split("/")[0])
        assert first >= at_least and 0 < agreement[variant] <= 1
