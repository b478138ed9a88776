"""`PageTables`: per-sequence block ids, token counts and prefix keys as numpy rows.

Row r of the preallocated arrays belongs to one sequence::

    block_ids[r]  = [b0, b1, b2, 0, 0, ...]   # its blocks in token order, 0 past num_blocks[r]
    num_tokens[r] = 37                          # tokens written or reserved
    token_ids[r]  = [t0, t1, ..., t36, ...]    # ids of known tokens (for prefix keys)

so a step's block tables and slot mapping are built by slicing and arithmetic, never by a
Python loop over tokens. Rows and columns grow by doubling when a sequence needs more.
"""

from __future__ import annotations

import collections

import numpy as np

from .._checks import read_only
from ..errors import ensure
from .batch import RowNames, SeqId
from .decode_rows import decode_ops
from .step_table import StepTable

_NO_TOKENS = np.empty(0, dtype=np.int32)  # the decode step's "ids unknown"


class PageTables:
    """Owns each sequence's row: block ids, token count, known token ids, prefix keys (the
    salted root it chains from, the key of its last indexed block, and the keys it was
    admitted with, under which its blocks are indexed as they fill).

    The only writer of those rows; it never frees a block (the allocator does) and never
    touches a tensor.

    Parameters
    ----------
    block_size : int
    max_num_seqs, max_blocks : int
        Initial rows and columns (both grow by doubling).
    compiled : bool, optional
        Run the decode step's bookkeeping compiled (numba) or in numpy; default
        ``paged_kv.core.decode_rows.default_compiled()`` (the ``PAGED_KV_NUMBA`` variable).

    Examples
    --------
    >>> tables = PageTables(block_size=4)
    >>> row = tables.add("a")
    >>> tables.append_blocks(np.array([row]), np.array([2]), np.array([7, 3]))
    >>> tables.set_num_tokens(np.array([row]), np.array([5]))
    >>> tables.blocks("a").tolist(), tables.num_tokens_of("a")
    ([7, 3], 5)
    """

    def __init__(self, block_size: int, max_num_seqs: int = 256, max_blocks: int = 16, *,
                 compiled: bool | None = None) -> None:
        self.block_size = block_size
        self._row_of: dict[SeqId, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._block_ids = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self._num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self._num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self._token_ids = np.zeros((max_num_seqs, max_blocks * block_size), dtype=np.int32)
        self._chain: list[bytes | None] = [None] * max_num_seqs
        self._root: list[bytes | None] = [None] * max_num_seqs  # salted root key per row
        # per row, the keys it was admitted with and their blocks' token bytes (or None):
        # its blocks are indexed under them as they fill, not hashed again
        self._ahead: list[tuple[list[bytes], bytes] | None] = [None] * max_num_seqs
        self._swapped = np.zeros(max_num_seqs, dtype=bool)
        self._resident = np.zeros(max_num_seqs, dtype=bool)  # has a row, blocks on the device
        self._seq_of_row: list[SeqId | None] = [None] * max_num_seqs
        self._version = 0  # bumped whenever the seq_id -> row mapping or residency changes
        self._compiled, self._decode = decode_ops(compiled)
        self._seen = np.zeros(max_num_seqs, dtype=np.int64)  # compiled row check's stamps
        self._stamp = 0
        self._last_lookup: tuple[int, tuple, np.ndarray] = (-1, (), np.empty(0, np.int64))
        self._last_resolved: tuple = (-1, None, None, ())  # version, handle, rows, seq_ids
        self._names: tuple = (-1, ())  # version, the owner of every row then
        self._filled = np.empty((2, 0), dtype=np.int64)  # commit_decode's scratch
        self._filled_tokens = np.empty((0, block_size), dtype=np.int32)
        self._step_table: StepTable | None = None  # None: every batch gets a new table
        self._refresh_views()

    def _refresh_views(self) -> None:
        # read-only views made once (not per access): the step's hot path reads them often
        self.block_ids = read_only(self._block_ids)     # [rows, width] int32
        self.num_blocks = read_only(self._num_blocks)   # [rows] int64
        self.num_tokens = read_only(self._num_tokens)   # [rows] int64
        self.token_ids = read_only(self._token_ids)     # [rows, width * block_size] int32
        self.swapped = read_only(self._swapped)         # [rows] bool

    # -- queries --------------------------------------------------------------------------
    @property
    def compiled(self) -> bool:
        """Whether the decode step's bookkeeping runs compiled (numba) here."""
        return self._compiled

    @property
    def seq_ids(self) -> tuple[SeqId, ...]:
        """Sequences with a row, in insertion order."""
        return tuple(self._row_of)

    @property
    def row_of(self) -> dict[SeqId, int]:
        """Mapping of sequence id to row (do not mutate)."""
        return self._row_of

    def rows_of(self, seq_ids: tuple[SeqId, ...]) -> np.ndarray:
        """``[B]`` int64 rows of `seq_ids` (KeyError for an unknown one).

        Decode steps repeat the same batch, so the last answer is reused while no sequence
        has gained or lost a row since.
        """
        last_version, last_ids, last_rows = self._last_lookup
        if last_version == self._version and last_ids == seq_ids:
            return last_rows
        rows = np.fromiter(map(self._row_of.__getitem__, seq_ids), dtype=np.int64,
                           count=len(seq_ids))
        rows.flags.writeable = False
        self._last_lookup = (self._version, seq_ids, rows)
        return rows

    def resolve_rows(self, what: str, rows: object) -> tuple[np.ndarray, RowNames]:
        """Validate row handles of resident sequences, each once; returns them as ``[B]``
        int64 and the sequences they belong to (looked up when first read).

        A read-only array that was validated last time, with no row added, removed or
        swapped since, is accepted without another pass (the steady decode state).
        """
        version, handle, last_rows, last_ids = self._last_resolved
        if rows is handle and version == self._version:
            return last_rows, last_ids
        array = np.asarray(rows)
        if array.ndim != 1 or array.dtype.kind not in "iu" or array.size == 0:
            raise TypeError(f"{what}: rows must be a non-empty 1-d int array (from rows_of()), "
                            f"got dtype {array.dtype} and shape {array.shape}")
        # a read-only copy: one array type for the compiled variant (it specialises on
        # writability), and the batch's ids, read later, outlive a caller reusing its array
        array = read_only(np.array(array, dtype=np.int64))
        num_rows = self._resident.shape[0]
        self._stamp += 1
        if self._decode.find_bad_row(array, self._resident, self._seen, self._stamp) >= 0:
            if array.min() < 0 or array.max() >= num_rows or not self._resident[array].all():
                bad = [int(r) for r in array if not 0 <= r < num_rows or not self._resident[r]]
                raise ValueError(f"{what}: rows {bad[:5]} are not resident sequences (freed, "
                                 f"swapped out, or never handed out by rows_of())")
            mark = np.full(num_rows, -1, dtype=np.int64)
            mark[array] = np.arange(array.size)
            if not (mark[array] == np.arange(array.size)).all():
                raise ValueError(f"{what}: a row appears twice in rows")
        if self._names[0] != self._version:  # one snapshot of the row owners per version
            self._names = (self._version, tuple(self._seq_of_row))
        seq_ids = RowNames(array, self._names[1])
        if isinstance(rows, np.ndarray) and not rows.flags.writeable:
            self._last_resolved = (self._version, rows, array, seq_ids)
        return array, seq_ids

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    def chains(self, rows: list[int]) -> list[bytes | None]:
        """`chain` of each of `rows`."""
        return list(map(self._chain.__getitem__, rows))  # a C loop: no bytecode per row

    def set_chains(self, rows: list[int], chains: list[bytes | None]) -> None:
        """Set `chain` of each of `rows`."""
        if len(rows) != len(chains):
            raise ValueError(f"set_chains(): {len(rows)} rows but {len(chains)} chains")
        collections.deque(map(self._chain.__setitem__, rows, chains), maxlen=0)  # a C loop

    def chain(self, row: int) -> bytes | None:
        """Prefix key of the row's last full block (None: its tokens cannot be indexed)."""
        return self._chain[row]

    def root(self, row: int) -> bytes | None:
        """The salted key the row's first block chains from (None: no prefix caching)."""
        return self._root[row]

    def ahead(self, row: int) -> tuple[list[bytes], bytes] | None:
        """The keys of the row's full blocks, from its first, that it was admitted with, and
        the token bytes they were hashed from (None: none given)."""
        return self._ahead[row]

    def rows(self) -> np.ndarray:
        """``[num_seqs]`` int64 rows in use, in insertion order."""
        return np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))

    def check(self, null_prefix: np.ndarray | None = None) -> None:
        """Raise `InvariantError` if a row's blocks disagree with its token count.

        `null_prefix` (``[rows]``, optional): how many leading entries of each row are the
        null block by design (blocks a window layer's row gave back); none elsewhere.
        """
        rows = self.rows()
        expected = -(-self._num_tokens[rows] // self.block_size)
        bad = np.flatnonzero(self._num_blocks[rows] != expected)
        ensure(bad.size == 0, f"rows {rows[bad].tolist()} hold a wrong number of blocks")
        columns = np.arange(self._block_ids.shape[1])
        in_use = columns < self._num_blocks[:, None]
        if null_prefix is not None:
            ensure(not self._block_ids[columns < null_prefix[:, None]].any(),
                   "a row holds a block its window gave back")
            in_use &= columns >= null_prefix[:, None]
        ensure(not (self._block_ids[in_use] == 0).any(), "a row points at the null block")
        ensure(not self._block_ids[~in_use].any(), "a row has entries past its blocks")
        free = np.array(self._free_rows, dtype=np.int64)
        ensure(not self._num_blocks[free].any(), "a free row holds blocks")

    def blocks(self, seq_id: SeqId) -> np.ndarray:
        """``[num_blocks]`` int64 block ids of `seq_id`, in token order."""
        row = self._row_of[seq_id]
        return self._block_ids[row, : self._num_blocks[row]].astype(np.int64)

    def num_tokens_of(self, seq_id: SeqId) -> int:
        """Tokens of `seq_id`."""
        return int(self._num_tokens[self._row_of[seq_id]])

    def owners(self, num_pool_blocks: int, swapped: bool = False) -> np.ndarray:
        """``[num_pool_blocks]`` count of rows holding each block (of the host pool when
        `swapped`, of the device pool otherwise)."""
        rows = self.rows()
        rows = rows[self._swapped[rows] == swapped]
        in_use = np.arange(self._block_ids.shape[1]) < self._num_blocks[rows, None]
        return np.bincount(self._block_ids[rows][in_use], minlength=num_pool_blocks)

    # -- mutators -------------------------------------------------------------------------
    def add(self, seq_id: SeqId, chain: bytes | None = None, root: bytes | None = None,
            ahead: tuple[list[bytes], bytes] | None = None) -> int:
        """Give `seq_id` an empty row and return it; `chain` is the key its next full
        block chains from, `root` its salted root key, `ahead` the keys it was admitted
        with (see `ahead`)."""
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self._seq_of_row[row] = seq_id
        self._resident[row] = True
        self._version += 1
        self._chain[row], self._root[row], self._ahead[row] = chain, root, ahead
        return row

    def remove(self, seq_id: SeqId) -> np.ndarray:
        """Drop `seq_id`'s row; returns the block ids it held, in token order."""
        blocks = self.blocks(seq_id)
        row = self._row_of.pop(seq_id)
        self._version += 1
        self._forget_step()
        self._block_ids[row, : blocks.size] = 0
        self._num_blocks[row] = self._num_tokens[row] = 0
        self._swapped[row] = False
        self._resident[row] = False
        self._seq_of_row[row] = None
        self._chain[row] = self._root[row] = self._ahead[row] = None
        self._free_rows.append(row)
        return blocks

    def append_blocks(self, rows: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """Append ``counts[i]`` of `block_ids` (consumed in order) to row ``rows[i]``."""
        new_num_blocks = self._num_blocks[rows] + counts
        if new_num_blocks.size and new_num_blocks.max() > self._block_ids.shape[1]:
            self._grow_columns(int(new_num_blocks.max()))
        owner = np.repeat(rows, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        columns = np.repeat(self._num_blocks[rows], counts) + np.arange(owner.size) - first
        self._block_ids[owner, columns] = block_ids
        self._num_blocks[rows] = new_num_blocks

    def plan_decode(self, rows: np.ndarray, protected: np.ndarray) -> int:
        """Blocks a decode step of `rows` (one token each) opens; -1 when a row would write
        into a block `protected` marks (shared or indexed), i.e. needs copy-on-write.
        Changes nothing (`commit_decode` grows the columns it needs): a plan, a count or a
        step refused for want of blocks leaves the tables as they were."""
        return self._decode.plan(rows, self._num_tokens, self._num_blocks, self._block_ids,
                                 protected, self.block_size)

    def commit_decode(self, rows: np.ndarray, token_ids: np.ndarray | None,
                      block_ids: np.ndarray) -> tuple:
        """Append one token to each of `rows` (after `plan_decode`), a new block from
        `block_ids` (in order) for each row whose last block is full; records the tokens'
        ids unless `token_ids` is None (unknown).

        Returns
        -------
        slots, num_blocks, seq_lens : np.ndarray
            ``[B]`` int64 slot of each new token, ``[B]`` blocks and (int32) tokens of each
            row now.
        max_blocks, max_len : int
            The most blocks and tokens of a row.
        filled : np.ndarray
            ``[2, F]`` int64: the rows whose last block just filled, and that block.
        filled_tokens : np.ndarray
            ``[F, block_size]`` int32 those blocks' token ids (garbage when unknown).
            Both are scratch, valid until the next call.
        """
        if block_ids.size:  # rows open blocks: a row at the last column needs one more
            self._columns_for_decode(rows)
        size = rows.size
        slots = np.empty(size, dtype=np.int64)
        num_blocks = np.empty(size, dtype=np.int64)
        seq_lens = np.empty(size, dtype=np.int32)  # the batch's dtype: shipped as is
        if self._filled.shape[1] < size:  # scratch reused across steps: no allocation
            self._filled = np.empty((2, size), dtype=np.int64)
            self._filled_tokens = np.empty((size, self.block_size), dtype=np.int32)
        num_filled, max_blocks, max_len = self._decode.commit(
            rows, _NO_TOKENS if token_ids is None else token_ids, block_ids,
            self._num_tokens, self._num_blocks, self._block_ids, self._token_ids,
            self.block_size, slots, num_blocks, seq_lens, self._filled, self._filled_tokens)
        return (slots, num_blocks, seq_lens, max_blocks, max_len,
                self._filled[:, :num_filled], self._filled_tokens[:num_filled])

    def _columns_for_decode(self, rows: np.ndarray) -> None:
        """Grow the columns for a decode step of `rows` when a row opening a block (its
        last one full) holds as many blocks as there are columns: one test a step, the
        exact count only then (the compiled loop writes past no bound)."""
        num_blocks = self._num_blocks[rows]
        if num_blocks.max() < self._block_ids.shape[1]:
            return
        opening = self._num_tokens[rows] % self.block_size == 0
        self._grow_columns(int(num_blocks[opening].max(initial=0)) + 1)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """``[B, width]`` int32, a new copy of the first `width` block ids of `rows` (a
        decode step's block tables; zero past each row's blocks)."""
        return self._decode.gather(self._block_ids, rows, width)

    def batch_tables(self, rows: np.ndarray, num_blocks: np.ndarray, width: int) -> np.ndarray:
        """A step's ``[B, width]`` int32 block tables of `rows` (``num_blocks`` their block
        counts now, `width` the largest): `gather`, or with `reuse_step_tables` on, the last
        step's table updated in place (valid until the next step)."""
        if self._step_table is None:
            return self.gather(rows, width)
        return self._step_table.table(self._block_ids, rows, num_blocks, width, self._decode)

    def reuse_step_tables(self, enabled: bool) -> None:
        """Keep each step's block tables and update them by the next step's changes
        (`paged_kv.core.step_table`), or (False) give every batch a table of its own."""
        self._step_table = StepTable() if enabled else None

    def _forget_step(self) -> None:
        if self._step_table is not None:
            self._step_table.forget()

    def extend_row(self, row: int, old_len: int, new_len: int, block_ids: np.ndarray,
                   token_ids: np.ndarray | None) -> None:
        """Grow one row from `old_len` to `new_len` tokens: append `block_ids`, record the
        new tokens' ids when known (a single-sequence step)."""
        have = int(self._num_blocks[row])
        if have + block_ids.size > self._block_ids.shape[1]:
            self._grow_columns(have + block_ids.size)
        self._block_ids[row, have: have + block_ids.size] = block_ids
        self._num_blocks[row] = have + block_ids.size
        self._num_tokens[row] = new_len
        if token_ids is not None:
            self._token_ids[row, old_len:new_len] = token_ids

    def replace_blocks(self, rows: np.ndarray, columns: np.ndarray, block_ids: np.ndarray) -> None:
        """Point entry ``columns[i]`` of row ``rows[i]`` at ``block_ids[i]`` (copy-on-write)."""
        self._block_ids[rows, columns] = block_ids
        if self._step_table is not None:
            self._step_table.replace(rows, columns, block_ids)

    def set_num_tokens(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """Set the token count of each of `rows` (columns grow to fit)."""
        if num_tokens.size and num_tokens.max() > self._token_ids.shape[1]:
            self._grow_columns(-(-int(num_tokens.max()) // self.block_size))
        self._num_tokens[rows] = num_tokens

    def set_token_ids(self, token_rows: np.ndarray, positions: np.ndarray,
                      token_ids: np.ndarray) -> None:
        """Record known token ids at ``(token_rows[i], positions[i])``."""
        self._token_ids[token_rows, positions] = token_ids

    def set_chain(self, row: int, chain: bytes | None) -> None:
        """Set the prefix key of `row`'s last full block (None: never index it again)."""
        self._chain[row] = chain

    def truncate(self, seq_id: SeqId, num_tokens: int, chain: bytes | None) -> np.ndarray:
        """Keep the first `num_tokens` tokens of a row; returns the block ids dropped."""
        row = self._row_of[seq_id]
        keep = -(-num_tokens // self.block_size)
        dropped = self._block_ids[row, keep: self._num_blocks[row]].astype(np.int64)
        self._block_ids[row, keep: self._num_blocks[row]] = 0
        self._forget_step()
        self._num_blocks[row], self._num_tokens[row] = keep, num_tokens
        self._chain[row] = chain
        return dropped

    def set_swapped(self, seq_id: SeqId, block_ids: np.ndarray, swapped: bool) -> None:
        """Re-point a row at `block_ids` in the host (swapped) or device pool."""
        row = self._row_of[seq_id]
        self._block_ids[row, : block_ids.size] = block_ids
        self._swapped[row] = swapped
        self._resident[row] = not swapped
        self._version += 1
        self._forget_step()

    def fork(self, parent: SeqId, child: SeqId) -> int:
        """Give `child` a copy of `parent`'s row; returns the child's row."""
        src = self._row_of[parent]
        row = self.add(child, self._chain[src], self._root[src])
        self._block_ids[row] = self._block_ids[src]
        self._num_blocks[row] = self._num_blocks[src]
        self._num_tokens[row] = self._num_tokens[src]
        self._token_ids[row] = self._token_ids[src]
        return row

    def snapshot(self) -> tuple:
        """Comparable copy of the whole state (for tests of rejected calls). The keys rows
        were admitted with are left out: they only spare hashing (a block is indexed under
        the same key either way), and a row that fills its blocks in its admission keeps
        none."""
        return (tuple(self._row_of.items()), tuple(self._free_rows), self._block_ids.tobytes(),
                self._num_blocks.tobytes(), self._num_tokens.tobytes(),
                self._token_ids.tobytes(), tuple(self._chain), tuple(self._root),
                self._swapped.tobytes())

    # -- growth ---------------------------------------------------------------------------
    def _grow_rows(self) -> None:
        old = self._block_ids.shape[0]
        self._block_ids = _pad_rows(self._block_ids, old)
        self._num_blocks = _pad_rows(self._num_blocks, old)
        self._num_tokens = _pad_rows(self._num_tokens, old)
        self._token_ids = _pad_rows(self._token_ids, old)
        self._swapped = _pad_rows(self._swapped, old)
        self._resident = _pad_rows(self._resident, old)
        self._seen = _pad_rows(self._seen, old)
        self._seq_of_row += [None] * old
        self._version += 1
        self._forget_step()
        self._chain += [None] * old
        self._root += [None] * old
        self._ahead += [None] * old
        self._free_rows = list(range(2 * old - 1, old - 1, -1)) + self._free_rows
        self._refresh_views()

    def _grow_columns(self, min_blocks: int) -> None:
        width = self._block_ids.shape[1]
        while width < min_blocks:
            width *= 2
        extra = width - self._block_ids.shape[1]
        self._block_ids = np.pad(self._block_ids, ((0, 0), (0, extra)))
        self._token_ids = np.pad(self._token_ids, ((0, 0), (0, extra * self.block_size)))
        self._refresh_views()


def _pad_rows(array: np.ndarray, extra: int) -> np.ndarray:
    return np.concatenate([array, np.zeros((extra, *array.shape[1:]), dtype=array.dtype)])

