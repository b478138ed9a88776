"""The decode step's page-table bookkeeping as two compiled loops (numba, optional).

A decode step of B sequences is ~20 small numpy calls (2-10 us each on a small CPU); one
pass per phase in compiled code does the same work in a few microseconds. The numpy path
in `PageTables` stays the reference and the fallback: this module is used only when numba
imports and ``PAGED_KV_NUMBA`` is not ``0``, and the tests run both against each other.
"""

from __future__ import annotations

import os

import numpy as np

try:
    import numba
except ImportError:  # the `fast` extra is not installed: numpy path
    numba = None


def enabled() -> bool:
    """Whether page tables built now use the compiled decode step."""
    return numba is not None and os.environ.get("PAGED_KV_NUMBA", "1") != "0"


def _plan_decode(rows, num_tokens, num_blocks, block_ids, protected, block_size):
    """``(blocks to open, columns needed)``, or ``(-1, 0)`` when a row would write into a
    protected (shared or indexed) block: copy-on-write, left to the general path."""
    num_open = 0
    columns = 0
    for i in range(rows.size):
        row = rows[i]
        length = num_tokens[row]
        if length % block_size == 0:
            num_open += 1
            columns = max(columns, num_blocks[row] + 1)
        elif protected[block_ids[row, (length - 1) // block_size]]:
            return -1, 0
    return num_open, columns


def _commit_decode(rows, token_ids, new_ids, num_tokens, num_blocks, block_ids, token_table,
                   block_size, slots, row_blocks, seq_lens, filled):
    """Append one token per row (a new block where the row's last one is full), recording
    its id unless `token_ids` is empty (ids unknown); fills the step's slots, per-row block
    counts and lengths, and the positions of rows that just filled a block. Returns how
    many rows filled one."""
    known = token_ids.size > 0
    opened = 0
    num_filled = 0
    for i in range(rows.size):
        row = rows[i]
        length = num_tokens[row]
        offset = length % block_size
        if offset == 0:
            block_ids[row, num_blocks[row]] = new_ids[opened]
            num_blocks[row] += 1
            opened += 1
        slots[i] = np.int64(block_ids[row, length // block_size]) * block_size + offset
        if known:
            token_table[row, length] = token_ids[i]
        num_tokens[row] = length + 1
        seq_lens[i] = length + 1
        row_blocks[i] = num_blocks[row]
        if offset == block_size - 1:
            filled[num_filled] = i
            num_filled += 1
    return num_filled


def _find_bad_row(rows, resident, seen, stamp):
    """Index of the first entry of `rows` that is out of range, not resident, or repeated;
    -1 when all are fine. `seen` remembers the stamp of the call that last saw each row, so
    no clearing pass is needed between calls."""
    for i in range(rows.size):
        row = rows[i]
        if row < 0 or row >= resident.size or not resident[row] or seen[row] == stamp:
            return i
        seen[row] = stamp
    return -1


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view, so every call has the same array type (numba compiles one
    specialisation per type: read-only and writable arrays are two)."""
    view = array.view()
    view.flags.writeable = False
    return view


if numba is not None:
    # cache=True keeps the machine code beside the module: only the first process compiles
    plan_decode = numba.njit(cache=True, nogil=True)(_plan_decode)
    commit_decode = numba.njit(cache=True, nogil=True)(_commit_decode)
    find_bad_row = numba.njit(cache=True, nogil=True)(_find_bad_row)
else:
    plan_decode = commit_decode = find_bad_row = None
