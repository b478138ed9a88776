"""Block tables kept from step to step (`CacheConfig.reuse_block_tables`,
`paged_kv.core.step_table`) are the tables a fresh gather gives: on random runs of decode
steps of the same rows (blocks opening, a window giving blocks back, copies on write after
forks) among admissions, mixed steps, forks, frees, cuts and swaps, over one group and over
full, window and state groups, a cache that keeps its tables and one that gathers them
afresh return the same batches or errors and end in the same state. A batch made before a
change of rows keeps its table."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from paged_kv import OutOfBlocksError, PagedKVCache
from paged_kv.core.cache import snapshot
from paged_kv.core.decode_rows import numba
from paged_kv.core.step_table import StepTable

from ..conftest import assert_same_snapshot
from .test_prepare_counts import BLOCK, LAYOUTS, layout_cache, outcome

NAMES = tuple("abcdef")
VARIANTS = [False] + ([True] if numba is not None else [])  # the update in numpy, compiled
_KINDS = st.sampled_from(("decode",) * 8 + ("admit",) * 2 + ("mixed", "chunks", "fork",
                                                               "free", "truncate", "swap"))


def _cache(layout: str, num_blocks: int, reuse: bool,
           compiled: bool | None = None) -> PagedKVCache:
    return layout_cache(layout, num_blocks, 64, compiled=compiled, num_host_blocks=64,
                        reuse_block_tables=reuse)


def _draw_op(data, cache: PagedKVCache) -> tuple:
    """One operation, drawn from what `cache` holds so that most of them apply."""
    tables = cache.tables
    known = list(tables.row_of)
    resident = [s for s in known if not tables.swapped[tables.row_of[s]]]
    absent = [name for name in NAMES if name not in known]
    kind = data.draw(_KINDS)
    if kind in ("decode", "mixed", "chunks", "fork", "free", "truncate") and not resident:
        kind = "admit" if absent else "swap"
    if kind in ("admit", "fork") and not absent:
        kind = "decode" if resident else "swap"
    if kind == "swap" and not known:
        kind = "admit"
    if kind == "decode":  # the running rows in their order, now and then ids unknown
        return (kind, resident, data.draw(st.sampled_from((True,) * 5 + (False,))))
    if kind == "admit":  # prompts from a few prefixes: admissions share blocks
        return (kind, data.draw(st.sampled_from(absent)), data.draw(st.integers(0, 2)),
                data.draw(st.integers(1, 3 * BLOCK)))
    if kind == "mixed":  # the running rows, one of them a chunk, last
        chunk = data.draw(st.sampled_from(resident))
        return (kind, [(s, 1) for s in resident if s != chunk]
                + [(chunk, data.draw(st.integers(1, 3 * BLOCK)))])
    if kind == "chunks":  # the running rows in their order, any counts: rows gain blocks
        return ("mixed", [(s, data.draw(st.integers(1, 3 * BLOCK))) for s in resident])
    if kind == "fork":
        return (kind, data.draw(st.sampled_from(resident)), data.draw(st.sampled_from(absent)))
    if kind == "swap":
        return (kind, data.draw(st.sampled_from(known)))
    seq = data.draw(st.sampled_from(resident))
    if kind == "truncate":
        return (kind, seq, data.draw(st.integers(0, tables.num_tokens_of(seq))))
    return (kind, seq)


def _apply(cache: PagedKVCache, op: tuple, step: int) -> object:
    kind, *args = op
    try:
        if kind == "decode":
            seqs, known = args
            tokens = np.arange(len(seqs)) + 100 * step if known else None
            batch = cache.prepare_decode(cache.rows_of(seqs), tokens)
        elif kind == "mixed":
            batch = cache.prepare({s: [100 * step + i for i in range(n)] for s, n in args[0]})
        elif kind == "admit":
            seq, prefix, length = args
            _, batch = cache.admit(seq, [prefix * 1000 + i for i in range(length)],
                                   max_tokens=BLOCK + 1)
        elif kind == "swap":
            seq = args[0]
            swapped = cache.tables.swapped[cache.tables.row_of[seq]]
            (cache.swap_in if swapped else cache.swap_out)(seq)
            return None
        elif kind == "truncate":
            cache.truncate(*args)
            return None
        elif kind == "fork":
            cache.fork(*args)
            return None
        else:
            cache.free(args[0])
            return None
    except (OutOfBlocksError, ValueError) as exc:
        return type(exc).__name__
    # every attention group's batch (a state group's has no tables)
    return [outcome(b) for b in batch.groups or (batch,) if hasattr(b, "block_tables")]


class _Counts:
    """How the kept tables were made over a run: afresh, or updated (and then, with
    appended blocks, with entries pointed elsewhere)."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.fresh = self.updated = self.replaced = 0
        table, renew, replace = StepTable.table, StepTable._renew, StepTable.replace

        def count_table(kept, *args):
            before = self.fresh
            out = table(kept, *args)
            self.updated += self.fresh == before
            return out

        def count_renew(kept, *args):
            self.fresh += 1
            return renew(kept, *args)

        def count_replace(kept, rows, columns, block_ids):
            self.replaced += kept._rows is not None and bool(rows.size)
            return replace(kept, rows, columns, block_ids)

        patch.setattr(StepTable, "table", count_table)
        patch.setattr(StepTable, "_renew", count_renew)
        patch.setattr(StepTable, "replace", count_replace)


def _run(layout: str, compiled: bool, num_blocks: int, data, counts: _Counts) -> None:
    fresh = _cache(layout, num_blocks, False)
    kept = _cache(layout, num_blocks, True, compiled)
    for step in range(data.draw(st.integers(10, 50))):
        op = _draw_op(data, fresh)
        assert _apply(kept, op, step) == _apply(fresh, op, step)
        kept.check()
    assert_same_snapshot(snapshot(fresh), snapshot(kept))


@pytest.mark.parametrize("compiled", VARIANTS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kept_tables_are_the_gathered_tables(layout, compiled):
    with pytest.MonkeyPatch.context() as patch:
        counts = _Counts(patch)

        @settings(max_examples=100, deadline=None)
        @given(num_blocks=st.integers(16, 64), data=st.data())
        def check(num_blocks, data):
            _run(layout, compiled, num_blocks, data, counts)

        check()
    # the kept path ran: tables updated in place, and (a window's give-backs, copies on
    # write) entries pointed at other blocks
    assert counts.updated > 200 and counts.replaced > (20 if len(LAYOUTS[layout]) else 0)


def test_a_batch_made_before_a_change_of_rows_keeps_its_table():
    cache = _cache("one group", 64, True)
    for seq, length in (("a", 3 * BLOCK - 2), ("b", 2 * BLOCK - 1)):
        cache.admit(seq, [ord(seq) * 1000 + i for i in range(length)], max_tokens=8)
    rows = cache.rows_of(["a", "b"])
    first = cache.prepare_decode(rows, np.array([7, 8]))  # b's second block fills
    second = cache.prepare_decode(rows, np.array([9, 9]))  # b opens a third: same width
    assert second.block_tables.data_ptr() == first.block_tables.data_ptr()  # updated
    assert first.block_tables[1, 2].item() == second.block_tables[1, 2].item() != 0
    kept = second.block_tables.clone()
    cache.free("b")
    third = cache.prepare_decode(cache.rows_of(["a"]), np.array([5]))
    assert third.block_tables.data_ptr() != second.block_tables.data_ptr()  # made afresh
    assert torch.equal(second.block_tables, kept)  # the batch before keeps its table


def test_a_longer_row_widens_the_kept_table_without_a_gather():
    """Once the longest row outgrew a kept table, the new one keeps spare columns: as the
    row opens more blocks, the batch's table widens over them, in the same memory, with
    no gather, and is the table a fresh gather gives (zero past each row's blocks)."""
    cache = _cache("one group", 64, True)
    for seq, length in (("a", 2 * BLOCK - 1), ("b", 2)):
        cache.admit(seq, [ord(seq) * 1000 + i for i in range(length)], max_tokens=4 * BLOCK)
    rows = cache.rows_of(["a", "b"])
    cache.prepare_decode(rows, np.array([7, 8]))  # a's second block fills: two columns
    outgrown = cache.prepare_decode(rows, np.array([9, 9]))  # a opens a third: gathered
    assert tuple(outgrown.block_tables.shape) == (2, 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepTable, "_renew", lambda *args: pytest.fail("gathered afresh"))
        for token in range(BLOCK):  # a fills its third block, then opens a fourth
            batch = cache.prepare_decode(rows, np.array([token, token]))
    assert tuple(batch.block_tables.shape) == (2, 4)
    assert batch.block_tables.data_ptr() == outgrown.block_tables.data_ptr()
    assert np.array_equal(batch.block_tables.numpy(), cache.tables.gather(rows, 4))
    assert batch.block_tables[0, 3].item() != 0 and batch.block_tables[1, 3].item() == 0


def test_the_switch_takes_a_bool_and_default_batches_own_their_tables():
    with pytest.raises(ValueError, match="reuse_block_tables: expected a bool"):
        _cache("one group", 64, "yes")
    cache = _cache("one group", 64, False)
    cache.admit("a", [1, 2, 3], max_tokens=8)
    rows = cache.rows_of(["a"])
    first = cache.prepare_decode(rows, np.array([4]))
    second = cache.prepare_decode(rows, np.array([5]))
    assert first.block_tables.data_ptr() != second.block_tables.data_ptr()
