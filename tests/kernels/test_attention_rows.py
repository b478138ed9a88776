"""Decode rows attended one by one on their own blocks (`paged_kv.kernels.attention_rows`)
against a dense float64 reference over each row's unpaged keys, and against the batched path:
float dtypes, GQA / MQA / MHA, block sizes dividing the lengths or not, ragged lengths,
consecutive and scattered blocks, windows and chunks, with and without a workspace. Pages
are random everywhere, so a key read from outside a row's view shows up."""

from __future__ import annotations

import pytest
import torch

from paged_kv.kernels import attention_reference, attention_rows, paged_attention_reference

from .conftest import cdiv, tolerances

pytestmark = pytest.mark.usefixtures("torch_backend")

# (block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, kind)
CASES = [
    pytest.param(16, 8, 2, 64, torch.float32, [1, 15, 16, 17, 33, 70], {}, id="gqa4-bs16-fp32"),
    pytest.param(5, 4, 4, 8, torch.float16, [3, 5, 40, 21], {}, id="mha-bs5-fp16"),
    pytest.param(5, 8, 1, 16, torch.bfloat16, [12, 1, 30, 9], {}, id="mqa-bs5-bf16"),
    pytest.param(16, 8, 2, 32, torch.float32, [50, 33, 100, 7], {"window": 20},
                 id="window20-bs16-fp32"),
    pytest.param(5, 4, 2, 16, torch.float16, [70, 40, 9], {"chunk": 32}, id="chunk32-bs5-fp16"),
    pytest.param(4, 4, 2, 16, torch.float32, [13, 40], {"window": 100},
                 id="window-past-the-sequence-bs4-fp32"),
    pytest.param(16, 4, 2, 16, torch.bfloat16, [17, 64, 5], {"window": 16, "chunk": 24},
                 id="window-and-chunk-bs16-bf16"),
]


def _inputs(block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens, *,
            consecutive, seed=0):
    """Decode inputs (one query a row) over random pages, and each row's keys and values
    ``[L, Hkv, D]`` read back from its blocks."""
    generator = torch.Generator().manual_seed(seed)
    width = max(cdiv(n, block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 1
    ids = torch.arange(1, num_blocks) if consecutive else \
        torch.randperm(num_blocks - 1, generator=generator) + 1
    tables = ids.view(len(seq_lens), width).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in "kv")
    rows = []
    for b, n in enumerate(seq_lens):
        positions = torch.arange(n)
        blocks = tables[b, positions // block_size].long()
        rows.append((key_cache[blocks, positions % block_size],
                     value_cache[blocks, positions % block_size]))
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=generator).to(dtype)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    inputs = (query, key_cache, value_cache, tables,
              torch.tensor(seq_lens, dtype=torch.int32), starts)
    return inputs, rows


def _dense(query, rows, scale, window=0, chunk=0):
    """Float64: the last position of each row over the keys it sees, repeat_kv for GQA."""
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, (key, value) in enumerate(rows):
        position = key.shape[0] - 1
        first = max(position - window + 1, 0) if window else 0
        if chunk:
            first = max(first, position // chunk * chunk)
        group = query.shape[1] // key.shape[1]
        k, v = (t[first:].double().repeat_interleave(group, dim=1) for t in (key, value))
        scores = torch.einsum("hd,thd->ht", query[b].double(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out.to(query.dtype)


@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "kind"), CASES)
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("workspace", ["none", "fits", "too-small"])
@pytest.mark.parametrize("planes", ["apart", "one-storage"])
def test_rows_on_their_own_match_dense_attention(monkeypatch, block_size, num_q_heads,
                                                 num_kv_heads, head_dim, dtype, seq_lens, kind,
                                                 consecutive, workspace, planes):
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 0)  # every decode row on its own
    inputs, rows = _inputs(block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens,
                           consecutive=consecutive)
    if planes == "one-storage":  # the pool's layer: V's pages right after K's, one gather
        layer = torch.stack(inputs[1:3])
        inputs = (inputs[0], layer[0], layer[1], *inputs[3:])
        assert attention_rows._both_planes(*inputs[1:3]) is not None
    size = 2 * inputs[3].shape[1] * block_size * num_kv_heads * head_dim
    space = {"none": None, "fits": torch.full((size,), float("nan"), dtype=dtype),
             "too-small": torch.empty(8, dtype=dtype)}[workspace]
    scale = 0.7 if dtype == torch.bfloat16 else None
    got = paged_attention_reference(*inputs, scale=scale, workspace=space, **kind)
    want = _dense(inputs[0], rows, head_dim ** -0.5 if scale is None else scale, **kind)
    torch.testing.assert_close(got, want, **tolerances(dtype))


@pytest.mark.parametrize(("block_size", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                          "seq_lens", "kind"), CASES)
def test_rows_on_their_own_match_the_batched_path(monkeypatch, block_size, num_q_heads,
                                                  num_kv_heads, head_dim, dtype, seq_lens, kind):
    inputs, _ = _inputs(block_size, num_q_heads, num_kv_heads, head_dim, dtype, seq_lens,
                        consecutive=False, seed=3)
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 1 << 60)  # none on its own
    batched = paged_attention_reference(*inputs, **kind)
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 0)
    own = paged_attention_reference(*inputs, **kind)
    torch.testing.assert_close(own, batched, **tolerances(dtype))


def test_decode_rows_beside_prefill_chunks(monkeypatch):
    """Prefill chunks keep their path; the decode rows between them go on their own."""
    inputs, rows = _inputs(16, 8, 2, 32, torch.float32, [40, 33, 70, 5], consecutive=False)
    query = torch.randn(40 + 1 + 1 + 5, 8, 32)
    starts = torch.tensor([0, 40, 41, 42, 47], dtype=torch.int32)  # 40, 1, 1, 5 queries
    attended = []
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 0)
    monkeypatch.setattr(attention_rows, "attend_one",
                        lambda q, *a: attended.append(1) or _one(q, *a))
    got = paged_attention_reference(query, *inputs[1:5], starts)
    assert len(attended) == 2
    decode = query[[40, 41]]
    torch.testing.assert_close(got[[40, 41]], _dense(decode, rows[1:3], 32 ** -0.5))
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 1 << 60)
    batched = paged_attention_reference(query, *inputs[1:5], starts)
    torch.testing.assert_close(got, batched, **tolerances(torch.float32))


_one = attention_rows.attend_one


def test_both_planes_only_when_values_follow_keys():
    """One gather for K and V reads ``2 * num_blocks`` pages from K's first: only where V's
    pages are exactly the next ``num_blocks`` of the same storage, with K's strides."""
    layer = torch.randn(2, 6, 4, 2, 8)
    both = attention_rows._both_planes(layer[0], layer[1])
    assert both is not None and torch.equal(both, layer.view(12, 4, 2, 8))
    assert attention_rows._both_planes(layer[1], layer[0]) is None  # V before K
    assert attention_rows._both_planes(layer[0], layer[0]) is None
    assert attention_rows._both_planes(layer[0], layer[1].clone()) is None  # another storage
    wider = torch.randn(2, 7, 4, 2, 8)
    assert attention_rows._both_planes(wider[0, :6], wider[1, :6]) is None  # a gap between
    halves = torch.randn(6, 4, 2, 16)
    assert attention_rows._both_planes(halves[..., :8], halves[..., 8:]) is None  # strided


def test_which_rows_go_on_their_own(monkeypatch):
    """At least OWN_ROW_BYTES of keys read, and every column within the table."""
    inputs, _ = _inputs(4, 4, 2, 8, torch.float32, [8, 7, 12, 30], consecutive=True)
    token_bytes = 2 * 8 * 4
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 8 * token_bytes)
    query, key_cache, value_cache, tables, seq_lens, starts = inputs
    out = torch.zeros_like(query)
    short = tables[:, :3].contiguous()  # row 3 (30 tokens, 8 blocks) runs past it
    left = attention_rows.attend_rows(query, key_cache, value_cache, short, seq_lens, starts,
                                      torch.arange(4), None, out, None)
    assert left.tolist() == [1, 3]  # 7 tokens: too few; 30: past the table
    assert out[1].eq(0).all() and out[3].eq(0).all() and out[0].ne(0).any()
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 31 * token_bytes)
    untouched = torch.zeros_like(query)  # no row reads 31 keys: all left, nothing written
    rows = torch.arange(4)
    assert attention_rows.attend_rows(query, key_cache, value_cache, tables, seq_lens, starts,
                                      rows, None, untouched, None) is rows
    assert untouched.eq(0).all()
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 8 * token_bytes)
    window = attention_reference.AttentionKind(window=4).first_visible
    left = attention_rows.attend_rows(query, key_cache, value_cache, tables, seq_lens, starts,
                                      torch.arange(4), None, out, None, window)
    assert left.tolist() == [0, 1, 2, 3]  # a window of 4 reads 4 keys a row


def test_eight_bit_pages_keep_the_batched_path(monkeypatch):
    inputs, _ = _inputs(16, 4, 2, 16, torch.float32, [40, 70], consecutive=False)
    codes = tuple(torch.randint(-127, 128, c.shape, dtype=torch.int8) for c in inputs[1:3])
    scales = tuple(torch.rand(c.shape[:3]).to(torch.bfloat16) / 64 for c in codes)
    monkeypatch.setattr(attention_rows, "OWN_ROW_BYTES", 0)
    monkeypatch.setattr(attention_reference, "attend_rows",
                        lambda *a: pytest.fail("8-bit pages went row by row"))
    got = paged_attention_reference(inputs[0], *codes, *inputs[3:], key_scales=scales[0],
                                    value_scales=scales[1])
    assert got.isfinite().all()
