"""The CPU row copies (`paged_kv.kernels.rows`): bit-exact whatever the bytes are (NaN
payloads, signalling ones included: rows moved as 16-byte elements must not be computed
on), for row sizes with and without a wide element, and the packed gather by block rows
equal to a per-token loop for ragged lengths. Every test here and in test_cpu_copies runs
twice: with the compiled loops (`rows_compiled`, where numba is installed) and with the
torch paths alone (``PAGED_KV_NUMBA=0``)."""

from __future__ import annotations

import pytest
import torch

from paged_kv.kernels import gather_kv_packed
from paged_kv.kernels.rows import index_copy_rows, wide


@pytest.fixture(autouse=True, params=["compiled", "torch"])
def numba_switch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``PAGED_KV_NUMBA`` on (where numba imports) or off: the torch paths stay tested."""
    monkeypatch.setenv("PAGED_KV_NUMBA", "1" if request.param == "compiled" else "0")
    return request.param


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern of `dtype` likely: random bytes, plus signalling-NaN doubles."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    if nbytes >= 16:
        # a signalling NaN as a double (exponent all ones, quiet bit clear, payload 1)
        raw[:8] = torch.tensor([1, 0, 0, 0, 0, 0, 0xF0, 0x7F], dtype=torch.uint8)
    return raw.view(dtype).view(shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8,
                                   torch.uint8])
@pytest.mark.parametrize("row", [(8, 16), (3, 5), (1, 4), (2, 8)])
def test_index_copy_rows_moves_every_byte_as_it_is(dtype, row):
    target = _random_bytes((40, *row), dtype, 0)
    source = _random_bytes((13, *row), dtype, 1)
    index = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:13]
    expected = target.view(torch.uint8).clone()
    expected.view(40, -1)[index] = source.reshape(13, -1).view(torch.uint8) \
        .view(13, -1)
    index_copy_rows(target, index, source)
    assert torch.equal(target.view(torch.uint8), expected)


def test_a_non_contiguous_source_and_rows_without_a_wide_element():
    target = torch.zeros(10, 3, dtype=torch.float16)
    assert wide(target) is target  # 6 bytes a row: no wider element divides it
    source = torch.randn(4, 6).to(torch.float16)[:, ::2]  # strided rows
    index_copy_rows(target, torch.tensor([1, 3, 5, 7]), source)
    assert torch.equal(target[[1, 3, 5, 7]], source)
    assert wide(torch.zeros(4, 8, dtype=torch.float16)).dtype == torch.complex128


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("lens", [[37, 16, 64, 5], [48, 48], [1, 90, 33]])
def test_the_packed_gather_by_block_rows_equals_a_token_loop(block_size, lens):
    generator = torch.Generator().manual_seed(len(lens))
    width = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * width + 1
    key = torch.randn(num_blocks, block_size, 2, 8, generator=generator).to(torch.float16)
    value = torch.randn(num_blocks, block_size, 2, 8, generator=generator).to(torch.float16)
    tables = (torch.randperm(num_blocks - 1, generator=generator)[:len(lens) * width] + 1) \
        .view(len(lens), width).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    out_k, out_v = gather_kv_packed(key, value, tables, seq_lens, cu)
    for b, n in enumerate(lens):
        for t in range(n):
            block = int(tables[b, t // block_size])
            assert torch.equal(out_k[int(cu[b]) + t], key[block, t % block_size])
            assert torch.equal(out_v[int(cu[b]) + t], value[block, t % block_size])
