"""The torch path's decode rows, sorted by length and attended in batches each padded to
its own longest (`attention_reference._length_buckets`): every row's output equals plain
attention over its own keys, whatever batch it fell into, for ragged lengths, GQA, and
batches of 1 to 70 rows; and a window still sees only its last keys."""

from __future__ import annotations

import pytest
import torch

from paged_kv.kernels.attention_reference import _length_buckets, paged_attention_reference


def _case(num_seqs: int, block_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9 * block_size, (num_seqs,), generator=generator)
    width = int(lens.max()) // block_size + 1
    num_blocks = num_seqs * width + 1
    key = torch.randn(num_blocks, block_size, 2, 8, generator=generator)
    value = torch.randn(num_blocks, block_size, 2, 8, generator=generator)
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1)[:num_seqs * width] \
        .view(num_seqs, width).to(torch.int32)
    query = torch.randn(num_seqs, 4, 8, generator=generator)
    return query, key, value, tables, lens.to(torch.int32)


def _dense(query, key, value, table, length, window: int = 0):
    """One decode row: plain attention of its query over its keys (GQA: 2 query heads a
    KV head), the last `window` keys only when given."""
    block_size = key.shape[1]
    positions = torch.arange(length)
    k = key[table[positions // block_size].long(), positions % block_size]  # [T, 2, 8]
    v = value[table[positions // block_size].long(), positions % block_size]
    if window:
        k, v = k[-window:], v[-window:]
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # [T, 4, 8]
    weights = torch.softmax(torch.einsum("hd,thd->ht", query, k) * 8 ** -0.5, -1)
    return torch.einsum("ht,thd->hd", weights, v)


@pytest.mark.parametrize("num_seqs", [1, 15, 16, 17, 70])
@pytest.mark.parametrize("block_size", [4, 16])
def test_every_decode_row_is_its_own_attention(num_seqs, block_size):
    query, key, value, tables, lens = _case(num_seqs, block_size, num_seqs)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    out = paged_attention_reference(query, key, value, tables, lens, starts)
    for b in range(num_seqs):
        torch.testing.assert_close(out[b], _dense(query[b], key, value, tables[b],
                                                  int(lens[b])), rtol=1e-5, atol=1e-5)


def test_a_window_in_batches_sees_its_last_keys():
    query, key, value, tables, lens = _case(40, 4, 7)
    starts = torch.arange(41, dtype=torch.int32)
    out = paged_attention_reference(query, key, value, tables, lens, starts, window=6)
    for b in range(40):
        torch.testing.assert_close(out[b], _dense(query[b], key, value, tables[b],
                                                  int(lens[b]), window=6),
                                   rtol=1e-5, atol=1e-5)


def test_batches_cover_every_row_once_sorted_by_length():
    lens = torch.tensor([5, 90, 3, 3, 70, 12] * 20)
    rows = torch.arange(lens.numel())
    batches = _length_buckets(rows, lens, 16)
    assert 1 < len(batches) <= 8
    assert sorted(torch.cat(batches).tolist()) == rows.tolist()
    ordered = lens[torch.cat(batches)]
    assert torch.equal(ordered, ordered.sort().values)
