"""A step's decode head (`StepPlan.head`: its first rows of one known token each, committed
as a decode step, the rest as any step) changes nothing a caller can see: on random
admissions (prefix hits among them), mixed steps, forks and frees over one group and over
full, window and state groups, a cache that splits every such step and one that never
does return the same batches or errors, give the same events block by block, in order, and
end in the same state."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from paged_kv import OutOfBlocksError, PagedKVCache
from paged_kv.core.cache import snapshot
from paged_kv.core.step import plan as plan_module
from paged_kv.core.step.commit import StepCommitter

from ..conftest import assert_same_snapshot
from .test_prepare_counts import BLOCK, LAYOUTS, fork_or_free, layout_cache, outcome

NEVER = 1 << 30

NAMES = tuple("abcdefgh")
_KINDS = st.sampled_from(("admit",) * 3 + ("mixed",) * 3 + ("step",) * 2 + ("fork", "free"))


def _draw_op(data, resident: list) -> tuple:
    """One operation over the `resident` sequences (drawn so that most of them apply)."""
    kind = data.draw(_KINDS)
    absent = [name for name in NAMES if name not in resident]
    if (kind in ("mixed", "step", "fork", "free") and not resident) or \
            (kind in ("admit", "fork") and not absent):
        kind = "admit" if absent else "free"
    if kind == "admit":  # prompts from a few prefixes: admissions hit cached blocks
        return (kind, data.draw(st.sampled_from(absent)), data.draw(st.integers(0, 2)),
                data.draw(st.integers(1, 3 * BLOCK)))
    if kind == "mixed":  # a running batch: each one token, one of them a chunk, last
        chunk = data.draw(st.sampled_from(resident))
        rows = [(seq, 1, data.draw(st.sampled_from((False,) * 5 + (True,))))
                for seq in resident if seq != chunk]
        return ("step", [*rows, (chunk, data.draw(st.integers(1, 3 * BLOCK)), False)])
    if kind == "step":  # any rows, any counts (some as a count: ids unknown), any order
        seqs = data.draw(st.lists(st.sampled_from(resident), min_size=1, unique=True))
        return ("step", [(seq, data.draw(st.one_of(st.just(1), st.integers(1, 3 * BLOCK))),
                          data.draw(st.sampled_from((False,) * 4 + (True,))))
                         for seq in seqs])
    if kind == "fork":
        return (kind, data.draw(st.sampled_from(resident)), data.draw(st.sampled_from(absent)))
    return (kind, data.draw(st.sampled_from(resident)))


def _apply(cache: PagedKVCache, op: tuple, step: int) -> object:
    kind, *args = op
    try:
        if kind == "admit":
            seq, prefix, length = args
            _, batch = cache.admit(seq, [prefix * 1000 + i for i in range(length)],
                                   max_tokens=BLOCK + 1)
        elif kind == "step":
            new = {seq: n if as_count else [100 * step + i for i in range(n)]
                   for seq, n, as_count in args[0]}
            batch = cache.prepare(new)
        else:
            fork_or_free(cache, kind, args)
            return None
    except OutOfBlocksError as exc:
        return type(exc).__name__
    return (*outcome(batch), [b.block_tables.tolist() for b in batch.groups[1:2]])


SPLITS = []  # the heads the splitting caches committed, over every example


def _run(layout: str, num_blocks: int, ops, split_at: int = 1) -> None:
    """Each op (a list, or drawn from `ops` when it is hypothesis' data) on a cache that
    never splits and on one that splits at `split_at` rows: the same outcomes, states and
    events."""
    caches = [layout_cache(layout, num_blocks, 64) for _ in range(2)]
    split = StepCommitter._commit_split

    def spy(self, plan, new_ids, filled):
        SPLITS.append(plan.head)
        return split(self, plan, new_ids, filled)

    count = len(ops) if isinstance(ops, list) else ops.draw(st.integers(8, 40))
    for step in range(count):
        op = ops[step] if isinstance(ops, list) else _draw_op(
            ops, list(caches[0].tables.row_of))
        outcomes = []
        for cache, head in zip(caches, (NEVER, split_at), strict=True):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(plan_module, "MIN_DECODE_HEAD", head)
                patch.setattr(StepCommitter, "_commit_split", spy)
                outcomes.append(_apply(cache, op, step))
        assert outcomes[0] == outcomes[1]
        # each op's events, block by block and in order: the split indexes its head's
        # blocks in a call of their own, so an event may list fewer blocks
        events = [_per_block(cache.take_events()) for cache in caches]
        assert events[0] == events[1]
        for found in events:
            stored = {entry[2]: i for i, entry in enumerate(found) if entry[0] == "stored"}
            assert all(stored.get(entry[3], -1) < i for i, entry in enumerate(found)
                       if entry[0] == "stored")  # a block's parent is stored before it
        caches[1].check()
    assert_same_snapshot(snapshot(caches[0]), snapshot(caches[1]))


def _per_block(events: list) -> list[tuple]:
    """Each event's blocks, one entry each: (kind, block, key, parent, token bytes)."""
    flat = []
    for event in events:
        count = len(event.block_ids)
        width = len(event.token_ids) // count if count else 0
        for i, block in enumerate(event.block_ids):
            flat.append((event.kind, block, event.keys[i] if event.keys else None,
                         event.parents[i] if event.parents else None,
                         event.token_ids[i * width: (i + 1) * width]))
    return flat


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_decode_head_commits_as_the_general_path(layout):
    SPLITS.clear()

    @settings(max_examples=120, deadline=None)
    @given(num_blocks=st.integers(12, 48), data=st.data())
    def check(num_blocks, data):
        _run(layout, num_blocks, data)

    check()
    assert len(SPLITS) > 100 and max(SPLITS) > 3  # the split ran, on heads of several rows


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_running_batch_beside_a_new_prompt_splits(layout):
    """Twenty decoding sequences (their prompts sharing blocks; some fill a block in the
    steps) beside a new prompt's chunks: at the default threshold the twenty are the head."""
    names = [f"s{i}" for i in range(20)]
    ops = [("admit", name, i % 3, 2 * BLOCK + i % BLOCK) for i, name in enumerate(names)]
    ops += [("admit", "new", 1, 2)]
    ops += [("step", [(name, 1, False) for name in names] + [("new", BLOCK + 1, False)])
            for _ in range(BLOCK + 1)]
    ops += [("fork", "s0", "child"), ("free", "s1")]
    ops += [("step", [(name, 1, False) for name in names if name != "s1"]
             + [("child", 1, False), ("new", 2, False)])]
    SPLITS.clear()
    _run(layout, 256, ops, plan_module.MIN_DECODE_HEAD)
    groups = 1 if layout == "one group" else 2  # the attention groups commit it
    assert SPLITS.count(20) == (BLOCK + 1) * groups
