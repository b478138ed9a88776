"""A decode step's forecast (`GroupLayout.forecast`): the plans and give-backs that
`num_blocks_needed` of row handles works out are reused by `prepare_decode` of the same
handles while the cache is unchanged, and never after a change. Two caches of full +
sliding + state groups take the same random steps, forks, frees and admissions; one
counts every step's blocks first (a scheduler's order), sometimes with a fork or a free
in between, the other never does: their batches, snapshots and obtainable blocks agree."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import given, settings

from paged_kv import CacheConfig, LayerKind, PagedKVCache
from paged_kv.config import StateSpec
from paged_kv.core.groups.layout import GroupLayout

KINDS = (LayerKind(), LayerKind.sliding(8),
         LayerKind.recurrent((StateSpec("ssm", (1,), torch.float32),)))


def _cache() -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_layers=3, num_kv_heads=1, head_dim=2, block_size=4,
                                    num_blocks=256, max_num_seqs=24, layer_kinds=KINDS,
                                    num_state_slots=96))


def _batch_arrays(batch) -> list[list]:
    """Every group's batch as lists: block tables, lengths, slots (or the state's slots
    and checkpoint indices)."""
    out = []
    for group in batch.groups:
        if hasattr(group, "host_arrays"):
            out.append([a.tolist() for a in group.host_arrays] + [group.slot_mapping.tolist()])
        else:
            out.append([group.slots.tolist(), group.emit_tokens.tolist(),
                        group.emit_slots.tolist()])
    return out


def _bookkeeping(cache: PagedKVCache) -> tuple:
    """The allocator, every group's rows and the state slots' index (not the pool)."""
    return (cache.allocator.snapshot(), cache.tables.snapshot(),
            tuple(g.snapshot() for g in cache.groups if g.holds_blocks),
            cache.state_group.slots.snapshot())


# an operation between one step's block count and the step: nothing, a fork of a running
# sequence (its shared last block must then be copied), a free, a new sequence, or a
# truncation to no tokens (the rows' handles stay valid: only the generation tells)
BETWEEN = st.sampled_from(["none", "none", "fork", "free", "add", "truncate"])


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 13), min_size=2, max_size=5),
       between=st.lists(BETWEEN, min_size=1, max_size=8), pick=st.integers(0, 1 << 16))
def test_a_counted_step_matches_an_uncounted_one(lengths, between, pick):
    counted, plain = _cache(), _cache()
    seqs = list(range(len(lengths)))
    for cache in (counted, plain):
        for i, length in enumerate(lengths):
            cache.add_sequence(i, None)
            cache.prepare({i: list(range(100 * i, 100 * i + length))})
    for step_index, op in enumerate(between):
        rows = counted.rows_of(seqs)
        needed = counted.num_blocks_needed(rows)
        target, new = seqs[pick % len(seqs)], 1000 + step_index
        for cache in (counted, plain):
            if op == "fork":
                cache.fork(target, new)
            elif op == "free" and len(seqs) > 1:
                cache.free(target)
            elif op == "add":
                cache.add_sequence(new, None)
                cache.prepare({new: [7, 8, 9]})
            elif op == "truncate" and counted.groups[1].can_truncate(int(rows[0]), 0):
                cache.truncate(seqs[0], 0)  # its window gave nothing back yet
        if op == "fork" or op == "add":
            seqs.append(new)
        elif op == "free" and len(seqs) > 1:
            seqs.remove(target)
        tokens = np.full(len(seqs), step_index, dtype=np.int32)
        # `rows` stay the handles counted only when nothing changed in between
        counted_rows = rows if op in ("none", "truncate") else counted.rows_of(seqs)
        obtainable = counted.allocator.num_obtainable_blocks
        batch = counted.prepare_decode(counted_rows, tokens)
        expected = plain.prepare_decode(plain.rows_of(seqs), tokens)
        if op == "none":
            assert obtainable - counted.allocator.num_obtainable_blocks <= needed
        assert _batch_arrays(batch) == _batch_arrays(expected), f"step {step_index} ({op})"
        assert _bookkeeping(counted) == _bookkeeping(plain), f"step {step_index} ({op})"
        counted.check()


def test_the_step_reuses_the_count_of_the_same_rows_only_while_nothing_changed(monkeypatch):
    cache = _cache()
    for i in range(3):
        cache.add_sequence(i, None)
        cache.prepare({i: list(range(5 + i))})
    forecasts = []
    forecast = GroupLayout.forecast
    monkeypatch.setattr(GroupLayout, "forecast",
                        lambda self, *a: forecasts.append(1) or forecast(self, *a))
    rows = cache.rows_of([0, 1, 2])
    cache.num_blocks_needed(rows)
    cache.prepare_decode(rows, np.array([1, 2, 3]))
    assert len(forecasts) == 1  # the count's plans, reused by the step
    cache.num_blocks_needed(rows)
    cache.fork(0, 9)  # a change in between: the step plans again
    cache.prepare_decode(rows, np.array([1, 2, 3]))
    assert len(forecasts) == 3
    cache.num_blocks_needed(rows)
    cache.prepare_decode(np.array(rows), np.array([1, 2, 3]))  # a writable copy: planned
    assert len(forecasts) == 5
    cache.prepare_decode(rows, np.array([1, 2, 3]))  # a forecast is taken once
    assert len(forecasts) == 6
