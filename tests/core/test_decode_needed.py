"""A decode step's blocks per row (`LayerGroup.needed_per_row`, which counts a step without
copies from the lengths) against the general plan's (`StepPlanner.plan(fast=False)`), in
every group of a full + sliding + state cache, over random prompt lengths, forks (whose
shared last blocks must be copied) and steps."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import given, settings

from paged_kv import CacheConfig, LayerKind, PagedKVCache
from paged_kv.config import StateSpec
from paged_kv.core.step.parse import Step, decode_columns

KINDS = (LayerKind(), LayerKind.sliding(8),
         LayerKind.recurrent((StateSpec("ssm", (1,), torch.float32),)))


def _cache() -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_layers=3, num_kv_heads=1, head_dim=2, block_size=4,
                                    num_blocks=256, max_num_seqs=16, layer_kinds=KINDS,
                                    num_state_slots=64))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5),
       forks=st.lists(st.integers(0, 4), max_size=3), steps=st.integers(1, 6))
def test_decode_needed_per_row_matches_the_general_plan(lengths, forks, steps):
    cache = _cache()
    seqs = []
    for i, length in enumerate(lengths):
        cache.add_sequence(i, None)
        cache.prepare({i: list(range(100 * i, 100 * i + length))})
        seqs.append(i)
    for j, parent in enumerate(forks):
        if parent < len(lengths):
            cache.fork(parent, 50 + j)  # shares the parent's last block: a copy to make
            seqs.append(50 + j)
    for step_index in range(steps):
        rows = cache.rows_of(seqs)
        step = Step(tuple(seqs), rows, *decode_columns(rows.size, True),
                    np.full(rows.size, step_index, dtype=np.int32))
        for group in cache.groups:
            expected = (np.zeros(rows.size, dtype=np.int64) if not group.holds_blocks
                        else group.planner.plan(step, fast=False).per_sequence())
            assert group.needed_per_row(step).tolist() == expected.tolist()
        needed = cache.num_blocks_needed(rows)
        obtainable = cache.allocator.num_obtainable_blocks
        cache.prepare_decode(rows, np.full(rows.size, step_index, dtype=np.int32))
        assert obtainable - cache.allocator.num_obtainable_blocks <= needed
