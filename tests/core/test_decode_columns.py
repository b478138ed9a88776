"""A decode step grows the page tables' columns in its commit, never in its plan: a row
opening a block past the last column gets one (both variants of the row loops), and a
count, a plan or a step refused for want of blocks leaves the tables exactly as they were,
their width included."""

from __future__ import annotations

import numpy as np
import pytest

from paged_kv import OutOfBlocksError, PagedKVCache
from paged_kv.core.cache import snapshot
from paged_kv.core.page_table import PageTables

from ..conftest import assert_same_snapshot, tiny_config

BLOCK = 4


def _full_rows(compiled: bool, blocks: int) -> tuple[PageTables, np.ndarray]:
    """Tables two columns wide: row "a" holds `blocks` full blocks, row "b" one token."""
    tables = PageTables(BLOCK, max_num_seqs=2, max_blocks=2, compiled=compiled)
    rows = np.array([tables.add("a"), tables.add("b")])
    tables.append_blocks(rows, np.array([blocks, 1]), np.arange(1, blocks + 2))
    tables.set_num_tokens(rows, np.array([blocks * BLOCK, 1]))
    return tables, rows


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
def test_a_row_opening_a_block_past_the_last_column_gets_one(compiled):
    tables, rows = _full_rows(compiled, blocks=2)  # "a" fills both columns
    before = tables.snapshot()
    assert tables.plan_decode(rows, np.zeros(16, dtype=bool)) == 1  # "a" opens a block
    assert tables.snapshot() == before  # the plan grew nothing
    slots, num_blocks, *_ = tables.commit_decode(rows, np.array([7, 8], np.int32),
                                                 np.array([9]))
    assert tables.blocks("a").tolist() == [1, 2, 9] and num_blocks.tolist() == [3, 1]
    assert slots.tolist() == [9 * BLOCK, 3 * BLOCK + 1]
    assert tables.gather(rows, 3).tolist() == [[1, 2, 9], [3, 0, 0]]


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
def test_a_full_row_not_opening_a_block_grows_nothing(compiled):
    """"a" holds both columns but its last block has room: no column is added."""
    tables, rows = _full_rows(compiled, blocks=2)
    tables.set_num_tokens(rows, np.array([2 * BLOCK - 1, 4]))  # "b" opens, "a" does not
    width = tables.block_ids.shape[1]
    tables.commit_decode(rows, np.array([7, 8], np.int32), np.array([9]))
    assert tables.block_ids.shape[1] == width
    assert tables.blocks("b").tolist() == [3, 9]


def test_a_refused_decode_step_at_the_last_column_changes_nothing():
    """A row of 16 full blocks (the tables' first width) and no block left: counting and
    planning its step, then the step itself, which is refused, leave the cache as it was."""
    cache = PagedKVCache(tiny_config(num_blocks=17))
    cache.add_sequence("a")
    cache.prepare({"a": list(range(16 * BLOCK))})  # 16 blocks: the pool's last 16
    rows, before = cache.rows_of(["a"]), snapshot(cache)
    assert cache.num_blocks_needed(rows) == 1
    assert_same_snapshot(before, snapshot(cache), "num_blocks_needed()")
    with pytest.raises(OutOfBlocksError):
        cache.prepare_decode(rows, np.array([5]))
    assert_same_snapshot(before, snapshot(cache), "a refused prepare_decode()")
