"""A mixed step indexes its one-block rows in one batch (`index_full_blocks`) the way the
per-row chains did before: on random admissions, mixed steps (rows taking one token beside
rows taking chunks that fill several blocks or none) and frees, a cache on the batched path
and a cache indexing every row through its own chain (`index_row_blocks`, the path before)
return the same batches, index the same keys for the same tokens and give every row the
same chain, and both pass their own checks after every step."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from paged_kv import CacheConfig, LayerKind, OutOfBlocksError, PagedKVCache
from paged_kv.core.step import commit, prefix

BLOCK = 4
SEQS = ("a", "b", "c", "d")
BASE = list(range(1000, 1000 + 5 * BLOCK))  # a prefix prompts share: admitted hits

_op = st.one_of(
    # a prompt: a shared prefix of 0-5 blocks, then its own tokens
    st.tuples(st.just("admit"), st.sampled_from(SEQS), st.integers(0, 5 * BLOCK),
              st.integers(1, 3 * BLOCK), st.integers(1, 4 * BLOCK)),
    # a mixed step: each listed sequence (those admitted) takes 1 token (as often as not)
    # or a chunk of up to 3 blocks
    st.tuples(st.just("step"), st.lists(st.tuples(st.sampled_from(SEQS), st.one_of(
                                            st.just(1), st.integers(1, 3 * BLOCK))),
                                        min_size=1, max_size=4, unique_by=lambda t: t[0])),
    st.tuples(st.just("free"), st.sampled_from(SEQS)),
)


def per_row(allocator, tables, rows, old_lens, new_lens, block_size) -> None:
    """The path before: every filling row through its own chain."""
    first, end = old_lens // block_size, new_lens // block_size
    for i in np.flatnonzero(end > first).tolist():
        prefix.index_row_blocks(allocator, tables, int(rows[i]), int(first[i]), int(end[i]),
                                block_size)


def _apply(cache: PagedKVCache, op: tuple, fresh: iter) -> object:
    kind, *args = op
    try:
        if kind == "admit":
            seq, shared, own, chunk = args
            prompt = BASE[:shared] + [next(fresh) for _ in range(own)]
            _, batch = cache.admit(seq, prompt, max_tokens=chunk)
        elif kind == "step":
            step = {seq: [next(fresh) for _ in range(n)] for seq, n in args[0]
                    if seq in cache.tables.row_of}
            if not step:
                return None
            batch = cache.prepare(step)
        else:
            cache.free(args[0])
            return None
    except (KeyError, ValueError, OutOfBlocksError) as exc:
        return type(exc).__name__, str(exc)
    return batch.block_tables.tolist(), batch.slot_mapping.tolist()


def _indexed(cache: PagedKVCache) -> dict[bytes, bytes]:
    """``{key: the tokens of the block indexed under it}``."""
    allocator, tables = cache.allocator, cache.tables
    found = {}
    for seq_id in list(tables.row_of):
        row = tables.row_of[seq_id]
        for column, block in enumerate(tables.block_ids[row, : tables.num_blocks[row]]):
            key = allocator.block_hash(int(block))
            if key is not None:
                found[key] = tables.token_ids[row, column * BLOCK:(column + 1) * BLOCK].tobytes()
    return found


@pytest.mark.parametrize("kinds", [(), (LayerKind(), LayerKind.sliding(2 * BLOCK))],
                         ids=["one group", "full and window"])
@settings(max_examples=120, deadline=None)
@given(num_blocks=st.integers(12, 48), ops=st.lists(_op, max_size=30))
def test_batched_mixed_step_index_matches_per_row_chains(kinds, num_blocks, ops):
    caches = [PagedKVCache(CacheConfig(num_layers=max(len(kinds), 1), num_kv_heads=1,
                                       head_dim=2, block_size=BLOCK, num_blocks=num_blocks,
                                       dtype=torch.float32, layer_kinds=kinds))
              for _ in range(2)]
    fresh = [iter(range(1, 1 << 20)), iter(range(1, 1 << 20))]  # the same tokens for both
    batched = commit.index_full_blocks
    for op in ops:
        outcomes = []
        for cache, tokens, path in zip(caches, fresh, (batched, per_row), strict=True):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(commit, "index_full_blocks", path)
                outcomes.append(_apply(cache, op, tokens))
            cache.check()
        assert outcomes[0] == outcomes[1]
        assert _indexed(caches[0]) == _indexed(caches[1])
        rows = [cache.tables.rows().tolist() for cache in caches]
        assert rows[0] == rows[1]
        assert caches[0].tables.chains(rows[0]) == caches[1].tables.chains(rows[1])
    assert caches[0].stats() == caches[1].stats()
