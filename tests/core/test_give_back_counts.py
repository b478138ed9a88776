"""The window give-back's counts without `np.unique` where no block repeats: `distinct`
against a set, and `GroupLayout._gone` (which blocks every owner gives back) against the
sort-and-count it skips, on random block ids and owner counts (shared prompt blocks, and
forks giving one block back twice)."""

from __future__ import annotations

import types

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from paged_kv.core.groups.groups import distinct
from paged_kv.core.groups.layout import GroupLayout

NUM_BLOCKS = 12


def _gone_by_sort(ids: np.ndarray, refcount: np.ndarray) -> np.ndarray:
    """The first entry of each block whose every owner gives it back, by `np.unique`."""
    unique, first, counts = np.unique(ids, return_index=True, return_counts=True)
    return first[counts == refcount[unique]]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=1, max_size=10),
       extra=st.lists(st.integers(0, 2), min_size=NUM_BLOCKS, max_size=NUM_BLOCKS))
def test_gone_matches_the_sort(ids, extra):
    ids = np.array(ids, dtype=np.int64)
    # every block given back has at least as many owners as entries, some more
    refcount = np.bincount(ids, minlength=NUM_BLOCKS) + np.array(extra)
    refcount[np.bincount(ids, minlength=NUM_BLOCKS) == 0] = 0
    layout = types.SimpleNamespace(allocator=types.SimpleNamespace(refcount=refcount))
    assert distinct(ids, refcount) == (len(set(ids.tolist())) == ids.size)
    gone = GroupLayout._gone(layout, ids)
    # callers count the blocks (the credit) or the rows they belong to (`freed`): the
    # same entries, in any order
    assert sorted(gone.tolist()) == sorted(_gone_by_sort(ids, refcount).tolist())
