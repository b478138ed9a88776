"""The Triton kernels on 8-bit pages against the torch reference, through the interpreter.

Shapes stay small (the interpreter runs a program at a time); cases are many. Codes and
scales are bit-equal to the reference for every format (the kernels round on their own
before the fp8 cast and round scales up by their bits); outputs in bfloat16 may differ by
one rounding, as the interpreter truncates float32 -> bfloat16.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

triton = pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from paged_kv.kernels import attention, gather, gather_packed, quant, write  # noqa: E402

from ..core.test_quantised import PAGE_DTYPES, error_bound  # noqa: E402
from .conftest import tolerances  # noqa: E402
from .test_triton_kernels import (  # noqa: E402, F401
    interpreted_kernels,
    make_block_tables,
    offsets,
)

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# (block_size, num_kv_heads, head_dim, K/V dtype)
LAYOUTS = [
    pytest.param(16, 2, 8, torch.float32, id="bs16-h2-d8-fp32"),
    pytest.param(5, 3, 24, torch.float16, id="bs5-h3-d24-fp16"),
    pytest.param(1, 2, 16, torch.bfloat16, id="bs1-h2-d16-bf16"),
]
BATCHES = [pytest.param([1, 6, 17], id="ragged"), pytest.param([9, 0, 2], id="with-empty")]


@pytest.fixture(autouse=True)
def interpreted_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quant helpers the kernels call, made for the interpreter like the kernels."""
    for name in ("encode", "decode", "head_scale", "round_to_fp8"):
        function = getattr(quant, name)
        if not isinstance(function, interpreter.InterpretedFunction):
            monkeypatch.setattr(quant, name, interpreter.InterpretedFunction(function.fn))


def written_pages(kv_cache_dtype: str, seq_lens: list[int], block_size: int, num_heads: int,
                  head_dim: int, dtype: torch.dtype, launcher, outlier: float = 100.0) -> tuple:
    """Random pages and scales, then a ragged batch (with -1 rows) written by `launcher`,
    its keys' head 0 scaled by `outlier`."""
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    slots = torch.cat([block_tables[b, torch.arange(n) // block_size].long() * block_size
                       + torch.arange(n) % block_size for b, n in enumerate(seq_lens)])
    slots = torch.cat([slots, torch.full((2,), -1)])[torch.randperm(slots.shape[0] + 2)]
    key = torch.randn(slots.shape[0], num_heads, head_dim)
    key[:, 0] *= outlier
    key, value = key.to(dtype), torch.randn(slots.shape[0], num_heads, head_dim).to(dtype)
    generator = torch.Generator().manual_seed(7)
    pages = [torch.randn(num_blocks, block_size, num_heads, head_dim,
                         generator=generator).to(PAGE_DTYPES[kv_cache_dtype]) for _ in "kv"]
    scales = [torch.rand(num_blocks, block_size, num_heads, generator=generator)
              .to(torch.bfloat16) for _ in "kv"]
    launcher(key, value, *pages, slots, *scales)
    return (key, value), pages, scales, slots, block_tables


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
def test_write_kv_quantised_matches_reference(kv_cache_dtype: str, block_size: int,
                                              num_heads: int, head_dim: int,
                                              dtype: torch.dtype, seq_lens: list[int]) -> None:
    args = (kv_cache_dtype, seq_lens, block_size, num_heads, head_dim, dtype)
    torch.manual_seed(0)
    originals, want_pages, want_scales, slots, _ = written_pages(*args,
                                                                 write.write_kv_reference)
    torch.manual_seed(0)
    _, got_pages, got_scales, _, _ = written_pages(*args, write.write_kv_triton)
    valid = slots[slots >= 0]
    for name, original, want, got, want_scale, got_scale in zip(
            "kv", originals, want_pages, got_pages, want_scales, got_scales, strict=True):
        assert torch.equal(got_scale, want_scale), f"{name} scales differ from the reference"
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
            f"{name} codes differ from the reference")
        scale = got_scale.flatten(0, 1)[valid]
        read = got.flatten(0, 1)[valid].float() * scale.float()[..., None]
        x = original[slots >= 0].float()
        assert ((read - x).abs() <= error_bound(kv_cache_dtype, x, scale)).all(), (
            f"{name}: a Triton-written element outside the {kv_cache_dtype} bound")


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim", "dtype"), LAYOUTS)
@pytest.mark.parametrize("seq_lens", BATCHES)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gather_kv_quantised_matches_reference(kv_cache_dtype: str, block_size: int,
                                               num_heads: int, head_dim: int,
                                               dtype: torch.dtype, seq_lens: list[int],
                                               packed: bool) -> None:
    torch.manual_seed(1)
    _, pages, scales, _, block_tables = written_pages(
        kv_cache_dtype, seq_lens, block_size, num_heads, head_dim, dtype,
        write.write_kv_reference)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    kw = dict(key_scales=scales[0], value_scales=scales[1], out_dtype=dtype)
    if packed:
        cu_seqlens = offsets(seq_lens)
        args = (*pages, block_tables, seq_lens_t, cu_seqlens)
        want = gather_packed.gather_kv_packed_reference(*args, **kw)
        got = gather_packed.gather_kv_packed_triton(*args, **kw)
    else:
        want = gather.gather_kv_reference(*pages, block_tables, seq_lens_t, 20, **kw)
        got = gather.gather_kv_triton(*pages, block_tables, seq_lens_t, 20, **kw)
    for name, g, w in zip("kv", got, want, strict=True):
        assert g.dtype == dtype, f"{name}: expected {dtype} out, got {g.dtype}"
        # one rounding of the same float32 product: exact, but for the interpreter's bf16
        torch.testing.assert_close(g, w, rtol=2.0 ** -7 if dtype == torch.bfloat16 else 0,
                                   atol=0, msg=f"{name} differs from the reference")


# (block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens)
ATTENTION_CASES = [
    pytest.param(16, 4, 2, 16, torch.float32, [1, 15, 17], [1, 1, 1], id="decode-gqa-fp32"),
    pytest.param(5, 2, 2, 24, torch.float16, [9, 33], [1, 1], id="decode-bs5-fp16"),
    pytest.param(5, 4, 1, 16, torch.bfloat16, [17, 12, 7], [17, 3, 1], id="prefill-bf16"),
    pytest.param(1, 2, 1, 16, torch.float32, [6, 70], [2, 1], id="bs1-multitile-fp32"),
]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "query_lens"), ATTENTION_CASES)
def test_paged_attention_quantised_matches_reference(kv_cache_dtype: str, block_size: int,
                                                     num_q_heads: int, num_kv_heads: int,
                                                     head_dim: int, dtype: torch.dtype,
                                                     seq_lens: list[int],
                                                     query_lens: list[int]) -> None:
    torch.manual_seed(2)
    # no outlier keys: scores of ~100 make the softmax one-hot, and then one bfloat16
    # rounding of a key (the interpreter truncates) decides the winner
    _, pages, scales, _, block_tables = written_pages(
        kv_cache_dtype, seq_lens, block_size, num_kv_heads, head_dim, dtype,
        write.write_kv_reference, outlier=1.0)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim).to(dtype)
    args = (query, *pages, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            offsets(query_lens))
    kw = dict(key_scales=scales[0], value_scales=scales[1])
    want = attention.paged_attention_reference(*args, **kw)
    got = attention.paged_attention_triton(*args, **kw)
    torch.testing.assert_close(got, want, **tolerances(dtype, roundings=2))
