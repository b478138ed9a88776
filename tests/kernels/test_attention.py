"""`paged_attention` (torch backend) against SDPA on each sequence's contiguous K/V.

Each sequence's K/V is random, written into random non-contiguous blocks of a random-filled
pool; the test keeps the contiguous copy and computes, per sequence, float32 SDPA with an
explicit bottom-right causal mask (query j of n sees keys ``0 .. L - n + j``), cast back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from paged_kv.kernels import paged_attention, paged_attention_reference

from .conftest import TOLERANCES, cdiv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [16, 5]
HEAD_DIMS = [8, 64]
# both sides compute in float32 and cast, so outputs differ by float32 noise plus one rounding
RAGGED = [1, 15, 16, 17, 33]
# (block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, query_lens, scale)
CASES = [
    pytest.param(16, 8, 2, 64, torch.float32, RAGGED, [1] * 5, None,
                 id="decode-gqa8on2-bs16-d64-fp32"),
    pytest.param(5, 4, 4, 8, torch.float16, RAGGED, [1] * 5, None, id="decode-mha4-bs5-d8-fp16"),
    pytest.param(5, 8, 2, 8, torch.bfloat16, RAGGED, [1] * 5, 0.7,
                 id="decode-gqa-bs5-d8-bf16-scale"),
    pytest.param(5, 8, 2, 64, torch.bfloat16, [17, 33, 20], [4, 8, 3], None,
                 id="prefill-chunks-gqa-bs5-d64-bf16"),
    pytest.param(16, 4, 4, 8, torch.float32, [40, 16, 23], [9, 5, 16], 0.25,
                 id="prefill-chunks-mha-bs16-d8-fp32-scale"),
    pytest.param(16, 8, 2, 8, torch.float16, [1, 33, 16, 40, 5], [1, 7, 16, 1, 5], None,
                 id="mixed-gqa-bs16-d8-fp16"),
    pytest.param(5, 4, 4, 64, torch.float32, [12, 1, 30, 9], [12, 1, 4, 1], 1.3,
                 id="mixed-mha-bs5-d64-fp32-scale"),
    pytest.param(16, 8, 2, 64, torch.bfloat16, [37], [37], None,
                 id="full-prefill-gqa-bs16-d64-bf16"),
    pytest.param(5, 4, 4, 8, torch.float32, [15, 20, 9], [4, 0, 9], None,
                 id="empty-query-row-bs5-d8-fp32"),
]
IMPLS = [pytest.param(paged_attention, id="public"),
         pytest.param(paged_attention_reference, id="ref")]


pytestmark = pytest.mark.usefixtures("torch_backend")


def offsets(lengths: list[int]) -> torch.Tensor:
    """``[len + 1]`` int32 prefix sums (query_start_loc)."""
    result = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    result[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return result


def paged_inputs(block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, seq_lens: list[int], query_lens: list[int]
                 ) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, torch.Tensor]]]:
    """paged_attention's positional inputs, and each sequence's contiguous (K, V) [L, Hkv, D].

    Blocks come from randperm of ids 1..N-1 (block 0 is the null block); the pool is randn
    everywhere, so reading a padding entry or a slot past a length shows up in the result.
    """
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 1 + sum(needed) + 3
    block_ids = (torch.randperm(num_blocks - 1)[: sum(needed)] + 1).split(needed)
    block_tables = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    pool = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    contiguous = []
    for row, (ids, seq_len) in enumerate(zip(block_ids, seq_lens, strict=True)):
        block_tables[row, : len(ids)] = ids
        key = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
        for position in range(seq_len):
            block, offset = int(ids[position // block_size]), position % block_size
            pool[0, block, offset] = key[position]
            pool[1, block, offset] = value[position]
        contiguous.append((key, value))
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, dtype=dtype)
    inputs = (query, pool[0], pool[1], block_tables, torch.tensor(seq_lens, dtype=torch.int32),
              offsets(query_lens))
    return inputs, contiguous


def sdpa_reference(query: torch.Tensor, contiguous: list[tuple[torch.Tensor, torch.Tensor]],
                   query_lens: list[int], scale: float) -> torch.Tensor:
    """Per sequence: float32 SDPA of q [1, Hq, n, D] over GQA-repeated K/V [1, Hq, L, D]."""
    num_q_heads = query.shape[1]
    outputs, start = [], 0
    for (key, value), num_queries in zip(contiguous, query_lens, strict=True):
        seq_len, num_kv_heads = key.shape[:2]
        q = query[start:start + num_queries].float().transpose(0, 1)[None]
        k, v = (t.float().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
                .transpose(0, 1)[None] for t in (key, value))
        key_pos = torch.arange(seq_len)[None, :]
        query_pos = torch.arange(num_queries)[:, None]
        mask = key_pos <= seq_len - num_queries + query_pos  # [n, L]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        outputs.append(attended[0].transpose(0, 1).to(query.dtype))  # [n, Hq, D]
        start += num_queries
    return torch.cat(outputs)


def test_cases_cover_every_block_size_head_dim_and_dtype() -> None:
    cases = [param.values for param in CASES]
    assert {case[0] for case in cases} == set(BLOCK_SIZES)
    assert {case[3] for case in cases} == set(HEAD_DIMS)
    assert {case[4] for case in cases} == set(DTYPES)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "query_lens", "scale"), CASES)
def test_paged_attention_matches_sdpa(impl: Callable[..., torch.Tensor], block_size: int,
                                      num_q_heads: int, num_kv_heads: int, head_dim: int,
                                      dtype: torch.dtype, seq_lens: list[int],
                                      query_lens: list[int], scale: float | None,
                                      request: pytest.FixtureRequest) -> None:
    case = request.node.callspec.id
    inputs, contiguous = paged_inputs(block_size, num_q_heads, num_kv_heads, head_dim, dtype,
                                      seq_lens, query_lens)
    pool_before = inputs[1].clone(), inputs[2].clone()
    actual = impl(*inputs, scale=scale)
    expected = sdpa_reference(inputs[0], contiguous, query_lens,
                              head_dim ** -0.5 if scale is None else scale)
    assert actual.shape == (sum(query_lens), num_q_heads, head_dim), f"{case}: shape"
    assert actual.dtype == dtype, f"{case}: dtype {actual.dtype}"
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype],
                               msg=lambda message: f"{case}: {message}")
    assert torch.equal(inputs[1], pool_before[0]) and torch.equal(inputs[2], pool_before[1]), (
        f"{case}: attention wrote into the pool")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_into_out(impl: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
    seq_lens, query_lens, scale = [12, 1, 30, 9], [12, 1, 4, 1], 0.4
    inputs, contiguous = paged_inputs(5, 8, 2, 8, dtype, seq_lens, query_lens)
    out = torch.randn(inputs[0].shape, dtype=dtype)  # noise: every row must be overwritten
    result = impl(*inputs, scale=scale, out=out)
    assert result is out, f"{dtype}: did not return the out buffer"
    expected = sdpa_reference(inputs[0], contiguous, query_lens, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype],
                               msg=lambda message: f"out= {dtype}: {message}")
