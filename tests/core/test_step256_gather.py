"""The decode step's per-step conversions: the block-table gather of both page-table
variants (`paged_kv.core.decode_rows`), the row chains set in one C loop, and evicted blocks
converted to an array once for the index's and the allocator's flags."""

from __future__ import annotations

import numpy as np
import pytest

from paged_kv.core.allocator import BlockAllocator
from paged_kv.core.decode_rows import NUMPY, decode_ops, numba
from paged_kv.core.page_table import PageTables
from paged_kv.core.prefix_index import PrefixIndex

VARIANTS = [NUMPY] + ([decode_ops(True)[1]] if numba is not None else [])
# rows in one ascending run, a permutation, a set spanning a run's width but out of order
# (its ends differ by its size - 1: only the step-by-step test tells it from a run), one row
ROWS = [[2, 3, 4, 5], [7, 0, 5, 2, 9], [3, 5, 4, 6], [8]]


@pytest.mark.parametrize("ops", VARIANTS, ids=lambda ops: ops.gather.__name__)
@pytest.mark.parametrize("rows", ROWS, ids=str)
@pytest.mark.parametrize("width", [1, 3, 7])
def test_gather_copies_the_first_columns_of_each_row(ops, rows, width):
    rng = np.random.default_rng(len(rows) * 10 + width)
    block_ids = rng.integers(1, 1000, (12, 8)).astype(np.int32)
    rows = np.array(rows, dtype=np.int64)
    rows.flags.writeable = False  # as the cache hands them to the compiled variant
    out = ops.gather(block_ids, rows, width)
    case = f"rows {rows.tolist()} width {width}"
    assert out.dtype == np.int32 and out.shape == (rows.size, width), case
    assert np.array_equal(out, block_ids[rows, :width]), case
    out[:] = 0  # a copy: the table is untouched
    assert block_ids[rows, :width].all(), case


def test_set_chains_sets_each_row_and_refuses_a_length_mismatch():
    tables = PageTables(block_size=4)
    rows = [tables.add(seq) for seq in "abc"]
    tables.set_chains(rows[::-1], [b"c", b"b", b"a"])
    assert tables.chains(rows) == [b"a", b"b", b"c"]
    with pytest.raises(ValueError, match="2 rows but 1 chains"):
        tables.set_chains(rows[:2], [b"x"])
    assert tables.chains(rows) == [b"a", b"b", b"c"]  # nothing changed


def test_remove_with_the_ids_array_equals_remove_without():
    indexes = [PrefixIndex(8), PrefixIndex(8)]
    for index in indexes:
        index.insert([b"k1", b"k2", b"k3"], [1, 4, 6], [b"a", b"b", b"c"], [b"", b"k1", b"k2"],
                     b"abc", lambda *args: None)
    assert indexes[0].remove([6, 1]) == indexes[1].remove([6, 1], np.array([6, 1]))
    assert indexes[0].snapshot() == indexes[1].snapshot()
    assert indexes[1].indexed.tolist() == [False] * 4 + [True] + [False] * 3


def test_an_eviction_clears_the_evicted_blocks_flags():
    """Blocks evicted by an allocation leave the index and stop being write-protected
    (the one array `_unindex` makes serves both flag arrays)."""
    allocator = BlockAllocator(6)
    ids = allocator.allocate(5).tolist()
    for i, block in enumerate(ids):
        allocator.register(block, bytes([i]) * 32, b"t%d" % i)
    allocator.free(ids, unique=True)  # all cached, tail first
    taken = allocator.allocate(3)  # evicts the three least recently freed
    assert sorted(taken.tolist()) == sorted(ids[2:])
    assert not allocator.indexed[taken].any() and not allocator.protected[taken].any()
    assert allocator.indexed[ids[:2]].all() and allocator.protected[ids[:2]].all()
    allocator.check_invariants()
