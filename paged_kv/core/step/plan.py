"""A step in three phases: parse, plan, commit; and an admission, planned the same way.

Every entry of `PagedKVCache` that takes blocks (``prepare``, ``prepare_decode``,
``add_sequence``, ``admit``; ``num_blocks_needed`` plans only) runs the same way::

    step = parse_step(...)             # parse: validate the caller's input, change nothing
    plan = planner.plan(step)          # read the tables and the allocator, change nothing
    planner.check(plan, "prepare()")   # the one "requested > obtainable" test (`fits`)
    batch = committer.commit(plan)     # allocate, copy-on-write, extend rows, index blocks

and an admission likewise: `plan_admission` (the prompt's keys, its cached prefix, the
blocks its first tokens take), `check`, then `StepCommitter.add_row` or `.admit`. The
engine's scheduler plans its admissions with the same `plan_admission` and tests them with
the same `fits` (against what the step has reserved) before it adds the sequence.

So validate-then-commit rests on one number, ``plan.requested`` (with ``plan.revived``, the
cached blocks an admission's prefix hits take out of the obtainable ones). The plan and
the commit each take one of three shapes for speed (a decode step of known tokens with no
copy in a few array ops or compiled loops, a single sequence in scalar arithmetic, anything
else with arrays, whose leading one-token rows may commit as a decode step: `StepPlan.head`);
they agree by construction, and the tests compare them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ...config import CacheConfig
from ...errors import OutOfBlocksError
from ..allocator import BlockAllocator
from ..batch import SeqId
from ..page_table import PageTables
from .parse import Step
from .prefix import find_prefix

_NONE = np.empty(0, dtype=np.int64)
_NO_COPIES = (_NONE, _NONE, _NONE)
# the fewest leading one-token rows a step commits as a decode step (`StepPlan.head`):
# below it the split's fixed cost (two commits, a joined batch) outweighs the compiled loop
MIN_DECODE_HEAD = 16


class StepPlan(NamedTuple):
    """What a step will take, decided before anything changes (a tuple, cheap to build
    on every decode step).

    Attributes
    ----------
    step : Step
        The parsed step.
    requested : int
        Blocks the step takes: new blocks plus copy-on-write copies.
    new_blocks : np.ndarray or None
        ``[B]`` blocks each row opens; None for a decode step without copies (its commit
        opens a block for each row whose last block is full).
    copies : tuple of np.ndarray
        Copy-on-write: ``[C]`` rows, the column of each row's partly filled last block, and
        that block (the copy's source).
    head : int
        How many of the step's first rows take one known token each and copy no block: a
        mixed step's decoding rows (a running batch's, before new prompts' chunks), which
        the commit takes as a decode step (`PageTables.commit_decode`, its blocks indexed
        as a decode step's) and the rest as any step. 0: none (a decode step's plan, a
        single row, or fewer than `MIN_DECODE_HEAD`); their `new_blocks` are counted all
        the same, and `copies` are only the other rows'.
    """

    step: Step
    requested: int
    new_blocks: np.ndarray | None
    copies: tuple[np.ndarray, np.ndarray, np.ndarray] = _NO_COPIES
    revived: int = 0  # a step revives no cached block
    head: int = 0

    def per_sequence(self) -> np.ndarray:
        """``[B]`` int64 blocks each sequence takes (a copy counted for the one making it)."""
        if not len(self.copies[0]):  # no copy (the usual step): no membership pass
            return self.new_blocks.copy()
        return self.new_blocks + np.isin(self.step.rows, self.copies[0])


class Admission(NamedTuple):
    """What adding a sequence will take, decided before anything changes.

    Attributes
    ----------
    seq_id : hashable
    tokens : np.ndarray or None
        ``[T]`` int32 the prompt (None: none given, nothing looked up).
    root : bytes or None
        The salted key its first block chains from (None: prefix caching is off).
    keys : list of bytes
        The keys of the prompt's full blocks, from its first (empty when not looked up);
        its row keeps them, so its blocks are indexed under them as they fill.
    data : bytes
        Those blocks' token bytes.
    pieces : list of bytes
        The blocks after the hits, one slice of `data` each (empty when the plan left the
        keys after the first miss to the commit).
    hits : list of int
        The cached blocks of its longest prefix; ``num_hit`` tokens.
    count : int
        Tokens after the hits that it prepares now (`admit`; 0 for `add_sequence`).
    requested : int
        New blocks those tokens take.
    revived : int
        Hits that are cached now: sharing them takes them out of the obtainable blocks (0
        when it prepares no tokens: then it takes no block and always fits).
    generation : int
        The cache's mutation count when it was planned: `PagedKVCache.commit_admission`
        commits it as it is while the count is unchanged, and plans again otherwise.
    """

    seq_id: SeqId
    tokens: np.ndarray | None
    root: bytes | None
    keys: list[bytes]
    data: bytes
    pieces: list[bytes]
    hits: list[int]
    num_hit: int
    count: int
    requested: int
    revived: int
    generation: int = -1

    @property
    def chain(self) -> bytes | None:
        """The key the block after the hits chains from (None: never indexed)."""
        return self.keys[len(self.hits) - 1] if self.hits else self.root

    def missing(self, block_size: int) -> tuple[bytes, list[bytes], np.ndarray]:
        """The prompt's full blocks after the hits, as a lower tier knows them: the key the
        first chains from, their keys, ``[len(keys) * block_size]`` their token ids (never
        the block holding the last token, which is always computed)."""
        end = (len(self.tokens) - 1) // block_size if self.tokens is not None else 0
        keys = self.keys[len(self.hits): end]
        start = len(self.hits) * block_size
        return self.chain, keys, self.tokens[start: start + len(keys) * block_size]


def plan_admission(allocator: BlockAllocator, block_size: int, seq_id: SeqId,
                   tokens: np.ndarray | None, root: bytes | None, *,
                   keys: Sequence[bytes] = (), max_tokens: int | None = 0,
                   complete: bool = True) -> Admission:
    """The plan of adding `seq_id` (arguments validated): its prompt's keys (only those
    `keys` lacks are hashed; with ``complete=False`` only to the first miss, see
    `find_prefix`) and cached prefix, and the blocks of its next `max_tokens` tokens after
    that prefix (None: the rest of the prompt). Changes nothing.

    `root` is None when prefix caching is off or the prompt is not to be looked up (it
    asks for every position's log-probabilities): then nothing is hashed or found.
    """
    if tokens is None or root is None or not len(tokens):
        keys, data, pieces, hits = [], b"", [], []
    else:
        keys, data, pieces, hits = find_prefix(allocator, tokens, block_size, root, keys,
                                               complete=complete)
    num_hit = len(hits) * block_size
    count = 0 if tokens is None else len(tokens) - num_hit
    count = count if max_tokens is None else min(count, max_tokens)
    requested = -(-(num_hit + count) // block_size) - len(hits)
    # an admission that prepares no token takes no block: its hits only move from cached
    # to live, and it always fits, so they are not counted for it
    revived = allocator.count_cached(hits) if hits and count else 0
    return Admission(seq_id, tokens, root, keys, data, pieces, hits, num_hit, count,
                     requested, revived)


def fits(plan: StepPlan | Admission, obtainable: int) -> bool:
    """The one capacity rule: whether the blocks `plan` takes (and the cached ones its
    prefix hits revive) are among `obtainable` (free plus evictable cached, less what a
    scheduler has promised to this step already)."""
    return plan.requested + plan.revived <= obtainable


def check_capacity(allocator: BlockAllocator, plan: StepPlan | Admission, what: str, *,
                   root: bytes | None = None, credit: int = 0) -> None:
    """Raise `OutOfBlocksError` unless `plan` `fits` in the blocks obtainable now: every
    path of the cache (a step, an admission, a layout of several groups) checks here.

    Parameters
    ----------
    root : bytes, optional
        An admission's salt root: its tenant's reservation counts for it (a step's blocks
        are the obtainable ones, reservations kept from everyone).
    credit : int
        Blocks the step gives back before it takes any (a window's blocks).
    """
    obtainable = allocator.obtainable(root) + credit  # its own reservation counts for it
    if not fits(plan, obtainable):
        raise OutOfBlocksError(plan.requested, obtainable - plan.revived, what)


class StepPlanner:
    """Plans steps and admissions over the owners, and checks them; changes nothing
    (`StepCommitter` applies the plans).

    Parameters
    ----------
    tables : PageTables
    allocator : BlockAllocator
    config : CacheConfig
    """

    def __init__(self, tables: PageTables, allocator: BlockAllocator,
                 config: CacheConfig) -> None:
        self._tables, self._allocator = tables, allocator
        self._block_size = config.block_size
        self._indexing = config.enable_prefix_caching

    def plan_admission(self, seq_id: SeqId, tokens: np.ndarray | None, root: bytes | None, *,
                       keys: Sequence[bytes] = (), max_tokens: int | None = 0,
                       complete: bool = False) -> Admission:
        """`plan_admission` over this cache's owners (`root` the salt's; None when prefix
        caching is off or the prompt is not looked up). Unless `complete`, keys past the
        first miss are hashed by the commit, as it indexes those blocks."""
        return plan_admission(self._allocator, self._block_size, seq_id, tokens,
                              root if self._indexing else None, keys=keys,
                              max_tokens=max_tokens, complete=complete)

    @property
    def indexing(self) -> bool:
        """Whether the blocks it plans are indexed for prefix reuse."""
        return self._indexing

    def check(self, plan: StepPlan | Admission, what: str = "prepare()", *,
              root: bytes | None = None) -> None:
        """`check_capacity` of `plan` over this planner's allocator (`root`: an
        admission's salt, whose reservation counts for it)."""
        check_capacity(self._allocator, plan, what, root=root)

    # -- plan (no visible change) -----------------------------------------------------------
    def plan(self, step: Step, *, fast: bool = True, decode: bool | None = None) -> StepPlan:
        """The plan of a parsed step; ``fast=False`` always gives per-row block counts,
        ``decode=True`` says the step is one token a row (skipping the test)."""
        if fast and (step.is_decode if decode is None else decode):
            requested = self._tables.plan_decode(step.rows, self._allocator.protected)
            if requested >= 0:  # else a last block must be copied: the general plan
                return StepPlan(step, requested, None)
        if step.rows.size == 1:
            return self._plan_one(step)
        return self._plan_rows(step, self._decode_head(step) if fast else 0)

    def _plan_one(self, step: Step) -> StepPlan:
        # scalar arithmetic: array bookkeeping costs more than it saves at B = 1
        tables, block_size = self._tables, self._block_size
        row = int(step.rows[0])
        old_len = int(tables.num_tokens[row])
        have = int(tables.num_blocks[row])
        need = -(-(old_len + int(step.counts[0])) // block_size) - have
        if old_len % block_size and self._allocator.protected[tables.block_ids[row, have - 1]]:
            source = tables.block_ids[row, have - 1: have].astype(np.int64)
            copies = (step.rows[:1], np.array([have - 1]), source)
            return StepPlan(step, need + 1, np.array([need]), copies)
        return StepPlan(step, need, np.array([need]))

    def _decode_head(self, step: Step) -> int:
        """How many of `step`'s first rows the commit may take as a decode step
        (`StepPlan.head`): the leading rows of one known token each, when there are at
        least `MIN_DECODE_HEAD` of them and none writes into a protected block; else 0."""
        counts = step.counts
        if counts.size < MIN_DECODE_HEAD or counts[0] != 1:
            return 0
        single = (counts == 1) & step.has_ids
        head = single.size if single.all() else int(single.argmin())
        if head < MIN_DECODE_HEAD or head == counts.size:  # all one token: not a mixed step
            return 0
        # the compiled count of a decode step (-1: a row must copy on write)
        if self._tables.plan_decode(step.rows[:head], self._allocator.protected) < 0:
            return 0
        return head

    def _plan_rows(self, step: Step, head: int = 0) -> StepPlan:
        rows, block_size = step.rows, self._block_size
        old_lens = self._tables.num_tokens[rows]
        old_num_blocks = self._tables.num_blocks[rows]
        new_blocks = -(-(old_lens + step.counts) // block_size) - old_num_blocks
        # the head writes into no protected block (`_decode_head`): no copy to look for
        copies = self._plan_copies(rows[head:], old_lens[head:], old_num_blocks[head:])
        return StepPlan(step, int(new_blocks.sum()) + len(copies[0]), new_blocks, copies,
                        head=head)

    def _plan_copies(self, rows: np.ndarray, old_lens: np.ndarray,
                     old_num_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows whose partly filled last block must not be written in place (shared, or
        indexed so its cached prefix stays intact), and which block they copy.

        When every owner of a shared block writes in this step, the first keeps the
        original (unless it is indexed).
        """
        partial = (old_lens % self._block_size != 0).nonzero()[0]
        columns = old_num_blocks[partial] - 1
        last = self._tables.block_ids[rows[partial], columns].astype(np.int64)
        must_copy = self._allocator.protected[last]
        if not must_copy.any():
            return _NO_COPIES
        partial, columns, last = (a[must_copy] for a in (partial, columns, last))
        refcount = self._allocator.refcount[last]
        _, first, writers = np.unique(last, return_index=True, return_counts=True)
        keep = first[(writers == refcount[first]) & ~self._allocator.indexed[last[first]]]
        copy = np.setdiff1d(np.arange(partial.size), keep, assume_unique=True)
        return rows[partial[copy]], columns[copy], last[copy]
