"""StepBatch fields against a per-sequence loop, including FlashInfer's CSR form."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_kv import PagedKVCache, PageTables

from ..conftest import tiny_config

CASES = [
    pytest.param(4, [(0, 5), (3, 1), (4, 4), (7, 9)], id="mixed-bs4"),
    pytest.param(1, [(0, 3), (2, 1)], id="bs1"),
    pytest.param(5, [(0, 1), (14, 1), (15, 1), (16, 2), (0, 33)], id="decode-bs5"),
]


@pytest.mark.parametrize(("block_size", "lengths"), CASES)
def test_step_batch_matches_a_loop(block_size, lengths):
    cache = PagedKVCache(tiny_config(block_size=block_size, num_blocks=80))
    rng = np.random.default_rng(0)
    for i, (old, _) in enumerate(lengths):
        cache.add_sequence(i)
        # interleave other sequences so block ids are not contiguous
        cache.add_sequence(("noise", i))
        cache.prepare({("noise", i): int(rng.integers(1, 7))})
        if old:
            cache.prepare({i: old})
    batch = cache.prepare({i: rng.integers(0, 50, n).tolist() for i, (_, n) in
                           enumerate(lengths)})
    slot_mapping, offset = [], 0
    for row, (old, n) in enumerate(lengths):
        blocks = cache.tables.blocks(row).tolist()
        assert batch.block_tables[row, : len(blocks)].tolist() == blocks
        assert not batch.block_tables[row, len(blocks):].any(), "padding is the null block"
        assert batch.seq_lens[row] == old + n
        assert batch.query_start_loc[row] == offset
        slot_mapping += [blocks[p // block_size] * block_size + p % block_size
                         for p in range(old, old + n)]
        assert batch.kv_indices[batch.kv_indptr[row]:batch.kv_indptr[row + 1]].tolist() == blocks
        assert batch.kv_last_page_len[row] == (old + n - 1) % block_size + 1
        offset += n
    assert batch.slot_mapping.tolist() == slot_mapping
    assert batch.num_tokens == offset and batch.query_start_loc[-1] == offset
    assert batch.max_seq_len == max(o + n for o, n in lengths)
    assert batch.block_tables.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64
    assert batch.seq_ids == tuple(range(len(lengths)))


def test_rows_grow_past_the_initial_size():
    tables = PageTables(block_size=2, max_num_seqs=2, max_blocks=1)
    for i in range(5):
        row = tables.add(i)
        tables.append_blocks(np.array([row]), np.array([3]), np.array([i + 1] * 3))
        tables.set_num_tokens(np.array([row]), np.array([6]))
    assert tables.blocks(4).tolist() == [5, 5, 5] and tables.num_tokens_of(0) == 6
    tables.check()


def test_row_lookup_is_not_stale_after_a_sequence_leaves():
    cache = PagedKVCache(tiny_config())
    for seq_id in "abc":
        cache.add_sequence(seq_id)
    cache.prepare({"a": 1, "b": 1})
    cache.free("a")
    cache.add_sequence("a")  # same id, new row
    batch = cache.prepare({"a": 2, "b": 1})
    assert batch.seq_lens.tolist() == [2, 2]
    cache.check()
