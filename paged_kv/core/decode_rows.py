"""The decode step's page-table bookkeeping, in two variants with one signature each.

A decode step of B sequences is ~20 small numpy calls (2-10 us each on a small CPU); one
pass per phase in compiled code (numba, the optional ``fast`` extra) does the same work in
a few microseconds. The numpy variant is the reference and the fallback; `decode_ops`
binds one of the two once per `PageTables`, and the tests run both against each other.

Every function works in place on the page tables' own arrays:

- ``plan(rows, num_tokens, num_blocks, block_ids, protected, block_size)`` -> blocks to
  open, or -1 when a row would write into a protected (shared or indexed) block:
  copy-on-write, left to the general path. Reads only.
- ``commit(rows, token_ids, new_ids, num_tokens, num_blocks, block_ids, token_table,
  block_size, slots, row_blocks, seq_lens, filled, filled_tokens)`` ->
  ``(rows that filled a block, most blocks of a row, longest row)``; for the i-th row that
  filled a block, ``filled[:, i]`` is that row and the block, ``filled_tokens[i]`` the
  block's token ids (so the caller indexes them without gathering them again).
- ``find_bad_row(rows, resident, seen, stamp)`` -> index of the first bad row or -1.
- ``gather(block_ids, rows, width)`` -> ``[B, width]`` a new copy of the first `width`
  columns of `rows` (a step's block tables).
- ``update(block_ids, rows, num_blocks, last_rows, table, kept)`` -> entries written, or
  -1 (nothing written) when `table`, the block tables of `last_rows` as they held `kept`
  blocks each, cannot become those of `rows` by appending: other rows or another order, a
  row with fewer blocks, or more than the table's width (`paged_kv.core.step_table`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..kernels import rows_compiled

try:
    import numba
except ImportError:  # the `fast` extra is not installed: numpy variant
    numba = None


class DecodeOps(NamedTuple):
    """One variant's functions (see the module docstring)."""

    plan: object
    commit: object
    find_bad_row: object
    gather: object
    update: object


def default_compiled() -> bool:
    """The variant page tables take unless told: compiled when numba imports and
    ``PAGED_KV_NUMBA`` is not ``0`` (the switch the compiled CPU copies read too)."""
    return rows_compiled.is_enabled()


def decode_ops(compiled: bool | None = None) -> tuple[bool, DecodeOps]:
    """``(compiled, ops)``: the variant asked for (None: `default_compiled`)."""
    if compiled is None:
        compiled = default_compiled()
    if compiled and numba is None:
        raise ValueError("compiled=True needs numba (pip install -e '.[fast]')")
    return bool(compiled), (_COMPILED if compiled else NUMPY)


# -- the numpy variant ------------------------------------------------------------------
def _plan_numpy(rows, num_tokens, num_blocks, block_ids, protected, block_size):
    old_lens = num_tokens[rows]
    in_place = old_lens % block_size != 0
    # column -1 of an empty row is read but never used: its offset is 0
    last = block_ids[rows, (old_lens - 1) // block_size]
    if (protected[last] & in_place).any():
        return -1
    return int(np.count_nonzero(~in_place))


def _commit_numpy(rows, token_ids, new_ids, num_tokens, num_blocks, block_ids, token_table,
                  block_size, slots, row_blocks, seq_lens, filled, filled_tokens):
    old_lens = num_tokens[rows]
    offsets = old_lens % block_size
    if new_ids.size:
        opened = rows[offsets == 0]
        columns = num_blocks[opened]
        block_ids[opened, columns] = new_ids
        num_blocks[opened] = columns + 1
    np.multiply(block_ids[rows, old_lens // block_size], block_size, out=slots)
    slots += offsets
    if token_ids.size:
        token_table[rows, old_lens] = token_ids
    num_tokens[rows] = old_lens + 1
    seq_lens[:] = old_lens + 1
    row_blocks[:] = num_blocks[rows]
    just_filled = np.flatnonzero(offsets == block_size - 1)
    count = just_filled.size
    if count:
        filled_rows = rows[just_filled]
        filled[0, :count] = filled_rows
        filled[1, :count] = block_ids[filled_rows, row_blocks[just_filled] - 1]
        starts = seq_lens[just_filled] - block_size
        filled_tokens[:count] = token_table[filled_rows[:, None],
                                            starts[:, None] + np.arange(block_size)]
    return count, int(row_blocks.max()), int(seq_lens.max())


def _find_bad_row_numpy(rows, resident, seen, stamp):
    in_range = (rows >= 0) & (rows < resident.size)
    bad = ~in_range
    bad[in_range] |= ~resident[rows[in_range]]
    if not bad.any():  # repeated rows: the first repeat is bad
        _, first = np.unique(rows, return_index=True)
        if first.size == rows.size:
            return -1
        bad[np.setdiff1d(np.arange(rows.size), first)] = True
    return int(bad.argmax())


def _gather_numpy(block_ids, rows, width):
    if rows.size and rows[-1] - rows[0] == rows.size - 1 and (np.diff(rows) == 1).all():
        # one ascending run (a running set admitted together): a slice, ~2x a row gather
        return block_ids[rows[0]: rows[0] + rows.size, :width].copy()
    # slicing columns first makes the row gather a contiguous-row take (~1.5x faster)
    return block_ids[:, :width][rows]


def _update_numpy(block_ids, rows, num_blocks, last_rows, table, kept):
    if not np.array_equal(last_rows, rows):  # (False for another length too)
        return -1
    grown = np.flatnonzero(num_blocks != kept)
    if not grown.size:
        return 0
    old, new = kept[grown], num_blocks[grown]
    if (new < old).any() or new.max() > table.shape[1]:
        return -1
    if (new - old == 1).all():  # a decode step's: one block each
        table[grown, old] = block_ids[rows[grown], old]
    else:
        owner = np.repeat(grown, new - old)
        columns = np.arange(owner.size) - np.repeat(np.cumsum(new - old) - (new - old),
                                                    new - old) + np.repeat(old, new - old)
        table[owner, columns] = block_ids[rows[owner], columns]
    kept[grown] = new
    return int((new - old).sum())


NUMPY = DecodeOps(_plan_numpy, _commit_numpy, _find_bad_row_numpy, _gather_numpy,
                  _update_numpy)


# -- the compiled variant: the same contracts as plain loops ----------------------------
def _plan_loop(rows, num_tokens, num_blocks, block_ids, protected, block_size):
    """Blocks to open, or -1 when a row would write into a protected (shared or indexed)
    block: copy-on-write, left to the general path."""
    num_open = 0
    for i in range(rows.size):
        row = rows[i]
        length = num_tokens[row]
        if length % block_size == 0:
            num_open += 1
        elif protected[block_ids[row, (length - 1) // block_size]]:
            return -1
    return num_open


def _commit_loop(rows, token_ids, new_ids, num_tokens, num_blocks, block_ids, token_table,
                 block_size, slots, row_blocks, seq_lens, filled, filled_tokens):
    """Append one token per row (a new block where the row's last one is full), recording
    its id unless `token_ids` is empty (ids unknown); fills the step's slots, per-row block
    counts and lengths, and each row that just filled a block with that block and its
    tokens. Returns how many rows filled one, the most blocks and the longest row."""
    known = token_ids.size > 0
    opened = 0
    num_filled = 0
    most_blocks = 0
    longest = 0
    for i in range(rows.size):
        row = rows[i]
        length = num_tokens[row]
        offset = length % block_size
        if offset == 0:
            block_ids[row, num_blocks[row]] = new_ids[opened]
            num_blocks[row] += 1
            opened += 1
        block = block_ids[row, length // block_size]
        slots[i] = np.int64(block) * block_size + offset
        if known:
            token_table[row, length] = token_ids[i]
        num_tokens[row] = length + 1
        seq_lens[i] = length + 1
        row_blocks[i] = num_blocks[row]
        most_blocks = max(most_blocks, num_blocks[row])
        longest = max(longest, length + 1)
        if offset == block_size - 1:
            filled[0, num_filled] = row
            filled[1, num_filled] = block
            start = length + 1 - block_size
            filled_tokens[num_filled, :] = token_table[row, start: length + 1]
            num_filled += 1
    return num_filled, most_blocks, longest


def _find_bad_row_loop(rows, resident, seen, stamp):
    """Index of the first entry of `rows` that is out of range, not resident, or repeated;
    -1 when all are fine. `seen` remembers the stamp of the call that last saw each row, so
    no clearing pass is needed between calls."""
    for i in range(rows.size):
        row = rows[i]
        if row < 0 or row >= resident.size or not resident[row] or seen[row] == stamp:
            return i
        seen[row] = stamp
    return -1


def _gather_loop(block_ids, rows, width):
    """``[B, width]`` a new copy of the first `width` columns of `rows`: a plain loop
    numba compiles to a copy a row (a numpy row gather of the 256-row decode step took
    ~87 K instructions with its Python around it, this ~52 K)."""
    out = np.empty((rows.size, width), dtype=block_ids.dtype)
    for i in range(rows.size):
        row = rows[i]
        for j in range(width):
            out[i, j] = block_ids[row, j]
    return out


def _update_loop(block_ids, rows, num_blocks, last_rows, table, kept):
    """Append to `table` (the block tables of `last_rows`, `kept` blocks each) the blocks
    `rows` gained since; -1, having written nothing, when it cannot (see the module
    docstring). Two passes: a refusal must leave the table, which an earlier batch may
    still read, as it was."""
    if rows.size != last_rows.size:
        return -1
    for i in range(rows.size):
        if rows[i] != last_rows[i] or num_blocks[i] < kept[i] \
                or num_blocks[i] > table.shape[1]:
            return -1
    written = 0
    for i in range(rows.size):
        row = rows[i]
        for j in range(kept[i], num_blocks[i]):
            table[i, j] = block_ids[row, j]
        written += num_blocks[i] - kept[i]
        kept[i] = num_blocks[i]
    return written


_COMPILED = (DecodeOps(*(numba.njit(cache=True, nogil=True)(f)
                         for f in (_plan_loop, _commit_loop, _find_bad_row_loop,
                                   _gather_loop, _update_loop)))
             if numba is not None else None)
