"""`PagedKVCache.prepare_decode` with counts (a step as arrays: row handles, packed token
ids, counts) is `prepare` of the same ``{seq_id: tokens}`` mapping: on random admissions,
mixed steps, forks and frees over one group and over full, window and state groups, two
caches return the same batches or errors and end in the same state; and bad arrays are
refused, naming what was wrong, with the cache left exactly as it was."""

from __future__ import annotations

import re

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from paged_kv import CacheConfig, LayerKind, OutOfBlocksError, PagedKVCache
from paged_kv.config import StateSpec
from paged_kv.core.cache import snapshot

from ..conftest import assert_same_snapshot

BLOCK = 4
SEQS = ("a", "b", "c", "d")
LAYOUTS = {"one group": (),
           "full, window and state": (LayerKind(), LayerKind.sliding(2 * BLOCK),
                                      LayerKind.recurrent((StateSpec("s", (1,),
                                                                     torch.float32),)))}

_op = st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(SEQS), st.integers(1, 3 * BLOCK)),
    st.tuples(st.just("step"), st.lists(st.tuples(st.sampled_from(SEQS), st.one_of(
        st.just(1), st.integers(1, 3 * BLOCK))), min_size=1, max_size=4,
        unique_by=lambda t: t[0])),
    st.tuples(st.just("fork"), st.sampled_from(SEQS), st.sampled_from(SEQS)),
    st.tuples(st.just("free"), st.sampled_from(SEQS)),
)


def layout_cache(layout: str, num_blocks: int, num_state_slots: int = 16, *,
                 compiled: bool | None = None, **fields) -> PagedKVCache:
    """A cache of `LAYOUTS[layout]` (the state slots only where it has a state group);
    `fields`: more `CacheConfig` fields, `compiled`: the page tables' variant."""
    kinds = LAYOUTS[layout]
    return PagedKVCache(CacheConfig(
        num_layers=max(len(kinds), 1), num_kv_heads=1, head_dim=2, block_size=BLOCK,
        num_blocks=num_blocks, dtype=torch.float32, layer_kinds=kinds,
        num_state_slots=num_state_slots if kinds else 0, **fields), compiled=compiled)


def outcome(batch) -> tuple:
    """What two caches' batches must agree on: tables, slots, sequences, lengths, offsets."""
    return (batch.block_tables.tolist(), batch.slot_mapping.tolist(), batch.seq_ids,
            batch.seq_lens.tolist(), batch.query_start_loc.tolist())


def fork_or_free(cache: PagedKVCache, kind: str, args: list) -> None:
    """A ``fork`` (parent, child) or ``free`` (sequence) operation of the step tests."""
    if kind == "fork":
        cache.fork(*args)
    else:
        cache.free(args[0])


def _apply(cache: PagedKVCache, op: tuple, step: int, arrays: bool) -> object:
    kind, *args = op
    try:
        if kind == "admit":
            _, batch = cache.admit(args[0], [7 * step + i for i in range(args[1])],
                                   max_tokens=BLOCK + 1)
        elif kind == "step":
            new = {seq: [100 * step + i for i in range(n)] for seq, n in args[0]
                   if seq in cache.tables.row_of}
            if not new:
                return None
            if arrays:
                batch = cache.prepare_decode(cache.rows_of(list(new)),
                                             np.array([t for ts in new.values() for t in ts]),
                                             counts=np.array([len(t) for t in new.values()]))
            else:
                batch = cache.prepare(new)
        else:
            fork_or_free(cache, kind, args)
            return None
    except (KeyError, ValueError, OutOfBlocksError) as exc:
        return type(exc).__name__
    return outcome(batch)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=80, deadline=None)
@given(num_blocks=st.integers(10, 40), ops=st.lists(_op, max_size=25))
def test_prepare_decode_with_counts_is_prepare_of_the_same_mapping(layout, num_blocks, ops):
    caches = [layout_cache(layout, num_blocks) for _ in range(2)]
    for step, op in enumerate(ops):
        outcomes = [_apply(cache, op, step, arrays) for cache, arrays in
                    zip(caches, (False, True), strict=True)]
        assert outcomes[0] == outcomes[1]
        caches[1].check()
    assert_same_snapshot(snapshot(caches[0]), snapshot(caches[1]))
    assert caches[0].take_events() == caches[1].take_events()


@pytest.mark.parametrize("counts, tokens, error, words", [
    ([1], [5], TypeError, "counts: expected 2 ints"),
    ([1.0, 2.0], [5, 6, 7], TypeError, "counts: expected 2 ints"),
    ([1, 0], [5], ValueError, "'b' has 0 new tokens"),
    ([1, 2], [5, 6], ValueError, "expected 3 (the counts' sum), got 2"),
    ([1, 2], [5, -6, 7], ValueError, "token_ids"),
])
def test_bad_arrays_are_refused_and_change_nothing(counts, tokens, error, words):
    cache = layout_cache("full, window and state", 16)
    for seq in ("a", "b"):
        cache.admit(seq, [1, 2, 3])
    rows, before = cache.rows_of(["a", "b"]), snapshot(cache)
    with pytest.raises(error, match=re.escape(words)):
        cache.prepare_decode(rows, np.array(tokens), np.array(counts))
    assert_same_snapshot(before, snapshot(cache))


def test_freed_rows_are_refused():
    cache = layout_cache("one group", 16)
    for seq in ("a", "b"):
        cache.admit(seq, [1, 2, 3])
    rows = cache.rows_of(["a", "b"])
    cache.free("b")
    before = snapshot(cache)
    with pytest.raises(ValueError, match="not resident"):
        cache.prepare_decode(rows, np.array([4, 5]), np.array([1, 1]))
    assert_same_snapshot(before, snapshot(cache))
