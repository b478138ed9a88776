"""`StepTable`: a step's block tables kept from one step to the next and updated by what
changed (vLLM's persistent block table), instead of gathered afresh.

A decode step's batch carries a ``[B, longest row's blocks]`` int32 table. Gathered afresh
it is a new array each step: 1,024 rows x 258 columns is 1 MB written, 0.04-0.06 ms a
step per group in a three-group step at 1,024 rows (docs/benchmarks.md, round 10). From
one step to the next the same rows in the same order change in a few cells: the ~1 in
`block_size` rows that open a block, and, in a window group, the blocks given back. Kept,
the table costs those cells.

Once the longest row outgrows a kept table, the new one keeps spare columns (`SPARE`): as
that row grows on, the batch's table is a view of more of the kept columns, which are zero
past each row's blocks as the tables are. Gathered afresh at every new width, a table of
1,024 rows was gathered again once every `block_size` steps in each group, 0.15-0.25 ms
each time here (the whole table, from memory the step had not touched).

The price is the batch's lifetime: the table is updated in place by the next step, so a
batch is valid until the next step only (as vLLM's and FlashInfer's step metadata). A
caller that drops each batch before preparing the next (the engine) opts in with
`CacheConfig.reuse_block_tables`; by default every batch keeps a table of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .decode_rows import DecodeOps

Gather = Callable[[np.ndarray, np.ndarray, int], np.ndarray]

# columns kept past the width when the longest row outgrew a kept table: it outgrows them
# after `SPARE` more blocks (~`SPARE * block_size` steps), for +16/W on that one gather
SPARE = 16


class StepTable:
    """The last step's block tables, its rows, and the blocks each row held then.

    `PageTables` calls `table` for each step's batch, `replace` when it points a row's
    column at another block, and `forget` when it changes rows any other way (a row
    removed, cut short, swapped, or the rows grown): the next step then gathers afresh.
    Appending blocks needs no call: `table` compares the rows' block counts.
    """

    __slots__ = ("_kept", "_num_blocks", "_position", "_rows", "_table")

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None  # [B] int64 rows, in the batch's order
        self._kept = np.zeros((0, 0), dtype=np.int32)  # [B, W + spare] the tables, kept
        self._table = self._kept  # [B, W] the batch's block tables: a view of `_kept`
        self._num_blocks = np.zeros(0, dtype=np.int64)  # [B] blocks each row had then
        self._position = np.zeros(0, dtype=np.int64)  # row -> its index in the batch, or -1

    def forget(self) -> None:
        """Gather afresh at the next step (the rows changed in a way `table` cannot see)."""
        self._rows = None

    def table(self, block_ids: np.ndarray, rows: np.ndarray, num_blocks: np.ndarray,
              width: int, ops: DecodeOps) -> np.ndarray:
        """The ``[B, width]`` int32 block tables of `rows`, whose block counts are
        `num_blocks` now (`width` their largest): the last step's table with the blocks
        appended since (a view of the kept columns, ``width`` wide), or a new one from
        ``ops.gather`` when the rows or their order changed or the width outgrew the kept
        columns. Valid until the next call: it is updated in place then.

        Parameters
        ----------
        block_ids : np.ndarray
            ``[rows, columns]`` int32, the tables' block ids.
        rows, num_blocks : np.ndarray
            ``[B]`` the batch's rows and each one's block count.
        width : int
            ``num_blocks.max()``.
        ops : DecodeOps
            The tables' variant (`paged_kv.core.decode_rows`): its ``update`` appends,
            its ``gather`` makes a new table.
        """
        outgrown = width > self._kept.shape[1]
        if self._rows is None or outgrown or ops.update(
                block_ids, rows, num_blocks, self._rows, self._kept, self._num_blocks) < 0:
            # spare columns only once the width outgrew the kept ones: a step whose rows
            # change (requests leaving and joining, each step of a loaded server) gathers
            # again at the next step anyway
            return self._renew(block_ids, rows, num_blocks, width, ops.gather,
                               SPARE if outgrown and self._rows is not None else 0)
        if width != self._table.shape[1]:
            self._table = self._kept[:, :width]
        return self._table

    def replace(self, rows: np.ndarray, columns: np.ndarray, block_ids: np.ndarray) -> None:
        """Point the kept table's entries of ``(rows[i], columns[i])`` at ``block_ids[i]``,
        as the tables did (a copy on write, a block given back)."""
        if self._rows is None or not rows.size:
            return
        position = self._position[rows]
        kept = (position >= 0) & (columns < self._num_blocks[np.maximum(position, 0)])
        self._kept[position[kept], columns[kept]] = block_ids[kept]

    def _renew(self, block_ids: np.ndarray, rows: np.ndarray, num_blocks: np.ndarray,
               width: int, gather: Gather, spare: int) -> np.ndarray:
        # a new array, never the old one refilled: a batch made before the change keeps
        # its table. Its `spare` columns are the tables' own (zero past each row's blocks)
        self._kept = gather(block_ids, rows, min(width + spare, block_ids.shape[1]))
        self._table = self._kept[:, :width]
        if self._position.size < block_ids.shape[0]:
            self._position = np.empty(block_ids.shape[0], dtype=np.int64)
        self._position.fill(-1)
        self._position[rows] = np.arange(rows.size)
        self._rows, self._num_blocks = rows.copy(), num_blocks.astype(np.int64)
        return self._table
