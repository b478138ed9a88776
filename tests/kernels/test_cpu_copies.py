"""The CPU copies' faster paths against plain per-block / per-token loops, bit for bit, on
random bytes (signalling-NaN payloads included): `copy_blocks` by runs of consecutive
blocks and by rows (scattered ids), and the zero-padded `gather_kv` sequence by sequence,
across layouts, dtypes, ragged lengths, and consecutive and scattered block ids."""

from __future__ import annotations

import pytest
import torch

from paged_kv.kernels import copy as copy_module
from paged_kv.kernels import gather_kv
from paged_kv.kernels import rows as rows_module
from paged_kv.kernels.copy import copy_blocks_reference

from .test_rows import _random_bytes, numba_switch  # noqa: F401 (autouse: both paths)

# one-byte pages are int8 / uint8 (float8 and 4-bit codes are copied as their raw bytes)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8]


def _loop_copy(pool: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    expected = pool.view(torch.uint8).clone()
    for s, d in zip(src, dst, strict=True):
        expected[:, :, d] = pool.view(torch.uint8)[:, :, s]
    return expected


def _id_pairs(kind: str, num_copies: int, num_blocks: int, seed: int
              ) -> tuple[list[int], list[int]]:
    """(src, dst) ids, disjoint: one run each, runs of a few blocks, or scattered."""
    if kind == "consecutive":
        return list(range(1, 1 + num_copies)), list(range(1 + num_copies, 1 + 2 * num_copies))
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    if kind == "scattered":
        return order[:num_copies], order[num_copies:2 * num_copies]
    src, dst = [], []  # runs of 3: consecutive on both sides, in random places
    starts = [b * 3 for b in order if b * 3 + 3 <= num_blocks][: -(-num_copies // 3) * 2]
    for i, start in enumerate(starts):
        (src if i % 2 == 0 else dst).extend(range(start, start + 3))
    n = min(len(src), len(dst), num_copies)
    return src[:n], dst[:n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["consecutive", "runs", "scattered"])
@pytest.mark.parametrize(("num_layers", "block_shape", "num_copies"),
                         [(1, (4, 2, 8), 3), (3, (16, 1, 6), 40), (2, (5, 3, 5), 20)])
def test_copy_blocks_moves_every_byte_as_a_loop_does(dtype, kind, num_layers, block_shape,
                                                     num_copies):
    num_blocks = 3 * num_copies + 4
    pool = _random_bytes((num_layers, 2, num_blocks, *block_shape), dtype, num_copies)
    src, dst = _id_pairs(kind, num_copies, num_blocks, seed=7)
    expected = _loop_copy(pool, src, dst)
    copy_blocks_reference(pool, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(pool.view(torch.uint8), expected)


# each path called directly, whatever the dispatch would pick
PATHS = {
    "runs": lambda pool, src, dst: copy_module._copy_runs(pool, copy_module._runs(src, dst)),
    "slices": lambda pool, src, dst: copy_module._copy_slices(pool,
                                                               copy_module._runs(src, dst)),
    "rows": copy_module._copy_rows,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_the_run_slice_and_row_paths_agree(monkeypatch, path):
    """In chunks smaller than the copy, so the row path's buffer is reused."""
    monkeypatch.setattr(copy_module, "_CHUNK_BYTES", 3 * 4 * 2 * 8 * 2)
    for kind in ("consecutive", "runs", "scattered"):
        pool = _random_bytes((2, 2, 70, 4, 2, 8), torch.float16, 3)
        src, dst = _id_pairs(kind, 21, 70, seed=11)
        expected = _loop_copy(pool, src, dst)
        PATHS[path](pool, torch.tensor(src), torch.tensor(dst))
        assert torch.equal(pool.view(torch.uint8), expected), (path, kind)


def test_runs_are_found_where_both_ids_step_by_one():
    runs = copy_module._runs(torch.tensor([4, 5, 6, 9, 10, 2]),
                             torch.tensor([20, 21, 30, 31, 32, 7]))
    assert runs == [(4, 20, 2), (6, 30, 1), (9, 31, 2), (2, 7, 1)]


def test_which_copies_take_the_slice_path():
    pool = torch.empty(1, 2, 600, 16, 8, 128, dtype=torch.float16)  # 32 KiB blocks
    scattered = copy_module._runs(torch.arange(0, 80, 2), torch.arange(1, 81, 2))
    assert copy_module._by_slices(pool, scattered)  # 80 calls of 32 KiB
    small = torch.empty(1, 2, 600, 4, 2, 8, dtype=torch.float16)  # 256-byte blocks
    assert not copy_module._by_slices(small, scattered)  # 80 calls of 256 bytes: rows
    assert not copy_module._by_slices(pool[:, :, :300], scattered)  # not contiguous


# past the end, negative, a run crossing the end, a valid run before a bad one
@pytest.mark.parametrize(("src", "dst"), [([3], [10]), ([10], [3]), ([-1], [4]),
                                          ([2, 3], [9, 10]), ([1, 5], [2, 10])])
def test_ids_past_the_pool_raise_and_copy_nothing(src, dst):
    pool = _random_bytes((2, 2, 10, 4, 2, 8), torch.float16, 5)
    before = pool.clone()
    with pytest.raises(IndexError, match="block ids must lie in"):
        copy_module._copy_slices(pool, copy_module._runs(torch.tensor(src), torch.tensor(dst)))
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))


def _pages(lens: list[int], block_size: int, dtype: torch.dtype, seed: int, *,
           consecutive: bool, spare_columns: int = 1):
    width = max(-(-n // block_size) for n in lens) + spare_columns
    num_blocks = len(lens) * width + 1
    generator = torch.Generator().manual_seed(seed)
    ids = torch.arange(1, num_blocks) if consecutive else \
        torch.randperm(num_blocks - 1, generator=generator) + 1
    tables = ids.view(len(lens), width).to(torch.int32)
    key = _random_bytes((num_blocks, block_size, 2, 8), dtype, seed)
    value = _random_bytes((num_blocks, block_size, 2, 8), dtype, seed + 1)
    return key, value, tables, torch.tensor(lens, dtype=torch.int32)


def _padded_loop(cache, tables, lens, length):
    out = torch.zeros(len(lens), length, *cache.shape[2:], dtype=cache.dtype)
    for b, n in enumerate(lens):
        for t in range(n):
            out[b, t] = cache[int(tables[b, t // cache.shape[1]]), t % cache.shape[1]]
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("lens", [[37, 16, 64, 5], [48, 48], [1, 90, 33, 0], [130, 7], [0],
                                  [0, 0]])
@pytest.mark.parametrize("pad_extra", [0, 3, 16])
@pytest.mark.parametrize("consecutive", [False, True])
def test_the_padded_gather_by_sequences_equals_a_token_loop(monkeypatch, dtype, lens,
                                                            pad_extra, consecutive):
    """Zero padding, T a multiple of the block size or not, the by-sequence path forced
    (and, with the default threshold, whichever path the sizes choose); empty sequences, and
    T = 0 (an empty prompt's batch: the by-sequence path declines it)."""
    block_size = 16
    key, value, tables, seq_lens = _pages(lens, block_size, dtype, len(lens),
                                          consecutive=consecutive)
    length = max(lens) + pad_extra
    expected = [_padded_loop(c, tables, lens, length) for c in (key, value)]
    for threshold in (rows_module._SEQ_CALL_BYTES, 0):
        monkeypatch.setattr(rows_module, "_SEQ_CALL_BYTES", threshold)
        # stale bytes where the padding goes
        out = tuple(torch.full((len(lens), length, 2, 8 * dtype.itemsize), 7,
                               dtype=torch.uint8).view(dtype) for _ in "kv")
        got = gather_kv(key, value, tables, seq_lens, length, out)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), threshold


def test_when_the_padded_gather_goes_sequence_by_sequence(monkeypatch):
    key, value, tables, seq_lens = _pages([40, 200], 16, torch.float16, 0, consecutive=False)
    out = tuple(torch.empty(2, 208, 2, 8, dtype=torch.float16) for _ in "kv")
    # 176 padding tokens of 32 bytes: less than the two sequences' calls cost
    assert not rows_module.gather_padded_by_blocks(key, value, tables, seq_lens, 208, out)
    # T not a multiple of the block size, 120 tokens a sequence: token rows would cost more
    out_odd = tuple(torch.empty(2, 205, 2, 8, dtype=torch.float16) for _ in "kv")
    assert rows_module.gather_padded_by_blocks(key, value, tables, seq_lens, 205, out_odd)
    monkeypatch.setattr(rows_module, "_SEQ_CALL_BYTES", 0)
    assert rows_module.gather_padded_by_blocks(key, value, tables, seq_lens, 208, out)
    # lengths past the table, or outputs of another shape: the one-call gather's to do
    assert not rows_module.gather_padded_by_blocks(key, value, tables[:, :2], seq_lens, 208,
                                                   out)
    assert not rows_module.gather_padded_by_blocks(key, value, tables, seq_lens, 200, out)


@pytest.mark.parametrize("order", ["in-order", "reversed"])
@pytest.mark.parametrize("lens", [[37, 16, 64, 5], [3, 2, 1], [90, 0, 33]])
def test_the_packed_copy_spills_only_into_spans_copied_later(order, lens):
    """A sequence's last block copied whole lands partly in the next spans, which are copied
    after it; spans out of order (or a spill past the end) take the token rows instead."""
    key, value, tables, _ = _pages(lens, 4, torch.float16, 5, consecutive=False)
    starts, position = [], 0
    for n in lens:
        starts.append(position)
        position += n
    if order == "reversed":  # the same spans, the last sequence first in the output
        starts = [sum(lens) - start - n for start, n in zip(starts, lens, strict=True)]
    outs = tuple(torch.full((sum(lens), 2, 8), 7.0, dtype=torch.float16) for _ in "kv")
    rows_module.gather_packed_blocks((key, value), tables, lens, starts, outs)
    for cache, out in zip((key, value), outs, strict=True):
        expected = _padded_loop(cache, tables, lens, max(lens))
        for b, (start, n) in enumerate(zip(starts, lens, strict=True)):
            assert torch.equal(out[start:start + n].view(torch.uint8),
                               expected[b, :n].view(torch.uint8)), (b, order)
