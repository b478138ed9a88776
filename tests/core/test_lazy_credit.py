"""A step's give-back credit counted only when the step does not fit without it
(`GroupLayout._check`) against the credit counted every step (the path before): on random
decode and prefill steps of forked rows over a full and a sliding-window group in a pool
that runs short, each step raises the same error or returns the same batch, and the caches
end with the same blocks, events and counts."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import given, settings

from paged_kv import CacheConfig, LayerKind, OutOfBlocksError, PagedKVCache
from paged_kv.core.groups.layout import GroupLayout

KINDS = (LayerKind(), LayerKind.sliding(4))
SEQS = ("a", "b", "c")

_op = st.one_of(
    st.tuples(st.just("decode"), st.lists(st.sampled_from(SEQS), min_size=1, max_size=3,
                                          unique=True)),
    st.tuples(st.just("prefill"), st.sampled_from(SEQS), st.integers(1, 6)),
    st.tuples(st.just("fork"), st.sampled_from(SEQS), st.sampled_from(SEQS)),
    st.tuples(st.just("free"), st.sampled_from(SEQS)),
)


def _eager(layout: GroupLayout) -> None:
    """This layout counts every step's credit first, as every step did before."""
    check = layout._check
    layout._check = lambda plan, what, credit, columns: check(
        plan, what, layout._credit(columns) if credit is None else credit, columns)


def _apply(cache: PagedKVCache, op: tuple, token: int) -> object:
    kind, *args = op
    try:
        if kind == "decode":
            rows = cache.rows_of(args[0])
            batch = cache.prepare_decode(rows, np.full(rows.size, token, dtype=np.int64))
            return batch.block_tables.tolist(), batch.slot_mapping.tolist()
        if kind == "prefill":
            batch = cache.prepare({args[0]: [token] * args[1]})
            return batch.block_tables.tolist(), batch.slot_mapping.tolist()
        if kind == "fork":
            cache.fork(*args)
        else:
            cache.free(args[0])
    except (KeyError, ValueError, OutOfBlocksError) as exc:
        return type(exc).__name__, str(exc)
    return None


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(10, 24), ops=st.lists(_op, max_size=25))
def test_lazy_credit_matches_the_credit_counted_every_step(num_blocks, ops):
    caches = []
    for lazy in (False, True):
        cache = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=2,
                                         block_size=2, num_blocks=num_blocks,
                                         dtype=torch.float32, layer_kinds=KINDS))
        if not lazy:
            _eager(cache._layout)
        cache.admit("a", [1, 2, 3, 4, 5])
        caches.append(cache)
    for step, op in enumerate(ops):
        outcomes = [_apply(cache, op, 100 + step) for cache in caches]
        assert outcomes[0] == outcomes[1]
    for cache in caches:
        cache.check()
    assert caches[0].stats() == caches[1].stats()
    assert caches[0].take_events() == caches[1].take_events()
