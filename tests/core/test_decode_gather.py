"""The decode step's block-table gather (`PageTables.gather`: a compiled loop, or without
numba rows in one ascending run as one slice and any other order row by row) gives each
row's blocks (`PageTables.block_ids`), whatever order `rows_of` is asked in, step after
step."""

from __future__ import annotations

import numpy as np
import pytest

from paged_kv import CacheConfig, PagedKVCache

SEQS = [f"s{i}" for i in range(6)]


def _cache() -> PagedKVCache:
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4,
                                     num_blocks=96, max_num_seqs=8))
    for i, seq in enumerate(SEQS):
        cache.add_sequence(seq)
        cache.prepare({seq: list(range(3 + 2 * i))})
    return cache


@pytest.mark.parametrize("order", [SEQS, SEQS[2:5], SEQS[::-1], [SEQS[0], SEQS[2], SEQS[1]],
                                   [SEQS[0], SEQS[2], SEQS[3]]])
def test_decode_block_tables_are_each_rows_blocks(order):
    cache = _cache()
    rows = cache.rows_of(order)
    for step in range(6):  # the same rows array, step after step, through new blocks
        batch = cache.prepare_decode(rows, np.full(len(order), step, dtype=np.int32))
        tables = batch.block_tables.numpy()
        for i, row in enumerate(rows.tolist()):
            held = int(cache.tables.num_blocks[row])
            assert tables[i, :held].tolist() == cache.tables.block_ids[row, :held].tolist()
            assert not tables[i, held:].any()
    # a writable copy of the handles is validated and gathered afresh
    batch = cache.prepare_decode(np.array(rows), np.zeros(len(order), dtype=np.int32))
    assert batch.block_tables.shape[0] == len(order)
