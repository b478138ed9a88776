"""Prefix-cache keys: finding a prompt's cached blocks, and indexing blocks as they fill.

Functions over the two owners involved (the allocator's index, the page tables' rows). A
prompt's keys are computed once, on the request (`keys.block_keys`) or at its admission,
and carried from there: the admission looks its prefix up with them (`find_prefix`), a
lower tier is asked for the blocks after the hits under them, and the commit indexes the
blocks that fill under them (`index_row_blocks`, through the row's ``ahead`` keys), so no
block of a prompt is hashed twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...keys import TOKEN_BYTES, chain_pieces, encode_tokens, root_hash, split_blocks
from ..allocator import BlockAllocator
from ..page_table import PageTables
from .parse import tokens_to_array


def find_prefix(allocator: BlockAllocator, tokens: np.ndarray, block_size: int, root: bytes,
                keys: Sequence[bytes] = (), *, complete: bool = True,
                ) -> tuple[list[bytes], bytes, list[bytes], list[int]]:
    """The keys of a prompt's full blocks and their token bytes, and the cached blocks of
    its longest prefix (full blocks, never the block of the last token, which is always
    computed). Only the keys `keys` lacks are hashed (`keys`: the first blocks' keys, as
    the request carries them; the rest chain from the last of them, or from `root`).

    With ``complete=False`` the keys after the first miss are left for the commit to hash
    as it indexes those blocks (a caller that carries no keys on to a tier needs none of
    them first), so a block is still hashed once.

    Returns
    -------
    keys : list of bytes
        One per full block of `tokens` (with ``complete=False``: to the first miss).
    data : bytes
        Those blocks' tokens (`encode_tokens`).
    pieces : list of bytes
        The blocks after the hits, one slice of `data` each (with ``complete=False``: none,
        the commit cuts what it indexes).
    hits : list of int
        The block ids of the cached prefix, in order.
    """
    num_full, width = len(tokens) // block_size, block_size * TOKEN_BYTES
    data = encode_tokens(tokens[: num_full * block_size])
    lookable = (len(tokens) - 1) // block_size
    hits, known = allocator.match(data[: lookable * width], lookable, keys[:num_full], root)
    if not complete:
        return known, data, [], hits
    pieces = split_blocks(data[len(hits) * width:], num_full - len(hits))
    if len(known) < num_full:  # the blocks after the first miss (and the last token's)
        known += chain_pieces(known[-1] if known else root, pieces[len(known) - len(hits):])
    return known, data, pieces, hits


def match_prefix(allocator: BlockAllocator, token_ids: Sequence[int] | np.ndarray,
                 block_size: int, *, salt: str | None = None) -> int:
    """Tokens of a prompt that adding it now would find cached; changes nothing (no
    counters either).

    Examples
    --------
    >>> match_prefix(BlockAllocator(8), [1, 2, 3, 4, 5], block_size=4)
    0
    """
    root = root_hash(salt)  # also the salt's check
    tokens = tokens_to_array("match_prefix(): token_ids", token_ids)
    if not allocator.enable_prefix_caching or not len(tokens):
        return 0
    return len(find_prefix(allocator, tokens, block_size, root)[3]) * block_size


def index_filled_blocks(allocator: BlockAllocator, tables: PageTables, filled: np.ndarray,
                        filled_tokens: np.ndarray, out: list | None = None) -> None:
    """Index the blocks a decode step filled with its last tokens: ``filled[:, i]`` is a row
    and the block it filled, ``filled_tokens[i]`` that block's token ids (as
    `PageTables.commit_decode` returns them, so nothing is gathered again).

    With `out` (a list), each block this indexes (or finds indexed under its key already)
    is appended to it as ``(row, column, key, parent key, token bytes)``: what the other
    layer groups index their blocks under (`paged_kv.core.groups.groups.filled_blocks`
    finds the same, a block at a time).
    """
    rows, blocks = filled.tolist()
    if not rows:
        return
    parents = tables.chains(rows)
    if None in parents:  # rows whose ids are unknown somewhere are never indexed
        keep = [i for i, parent in enumerate(parents) if parent is not None]
        rows, blocks = [rows[i] for i in keep], [blocks[i] for i in keep]
        parents, filled_tokens = [parents[i] for i in keep], filled_tokens[keep]
    data = encode_tokens(filled_tokens)
    pieces = split_blocks(data, len(rows))  # cut once: the index and `out` keep them
    keys = allocator.register_blocks(blocks, parents, data, pieces)
    tables.set_chains(rows, keys)
    if out is not None and rows:  # each block filled the row's last column: its length's
        # `take` of the list: typed as intp at once (indexing by it discovers each type)
        columns = (tables.num_tokens.take(rows) // tables.block_size - 1).tolist()
        out.extend(zip(rows, columns, keys, parents, pieces, strict=True))


def index_full_blocks(allocator: BlockAllocator, tables: PageTables, rows: np.ndarray,
                      old_lens: np.ndarray, new_lens: np.ndarray, block_size: int) -> None:
    """Enter every block a step filled with known ids (rows grew old_lens -> new_lens).

    The rows that filled one block (a mixed step's decoding rows: ~64 a step at 1,024
    rows) are indexed in one batch, in row order, as a decode step's are
    (`index_filled_blocks`: one hash each, one index update), not one row at a time (~10 us
    a row); every other row after them, through its own chain (`index_row_blocks`, which
    reads the keys a row was admitted with instead of hashing them). A prompt row filling
    one block is hashed again (~1 us): so the batch holds every one-block row, and a step
    whose first rows commit as a decode step (`StepPlan.head`) indexes in the same order."""
    first_full, end_full = old_lens // block_size, new_lens // block_size
    filling = np.flatnonzero(end_full > first_full)
    if not filling.size:
        return
    single = end_full[filling] - first_full[filling] == 1
    if single.any():
        batch = filling[single]
        batch_rows, columns = rows[batch], first_full[batch]
        filled = np.stack([batch_rows, tables.block_ids[batch_rows, columns]]).astype(np.int64)
        spans = columns[:, None] * block_size + np.arange(block_size)
        index_filled_blocks(allocator, tables, filled, tables.token_ids[batch_rows[:, None],
                                                                         spans])
    if not single.all():
        for i in filling[~single].tolist():
            index_row_blocks(allocator, tables, int(rows[i]), int(first_full[i]),
                             int(end_full[i]), block_size)


def index_row_blocks(allocator: BlockAllocator, tables: PageTables, row: int, first: int,
                     end: int, block_size: int) -> None:
    """Enter the full blocks ``first .. end - 1`` of one row, chained from its last key;
    under the keys the row was admitted with where they are these blocks' (see
    `PageTables.ahead`), hashing only the others."""
    chain = tables.chain(row)
    if chain is None or end <= first:  # ids unknown somewhere: never indexed
        return
    data = encode_tokens(tables.token_ids[row, first * block_size: end * block_size])
    known = _admitted_keys(tables, row, chain, first, end, data)
    keys = allocator.register_chain(tables.block_ids[row, first:end].tolist(), chain, data,
                                    known)
    tables.set_chain(row, keys[-1])


def _admitted_keys(tables: PageTables, row: int, chain: bytes, first: int, end: int,
                   data: bytes) -> list[bytes]:
    """The keys `row` was admitted with for its blocks ``first ..`` (at most to `end`),
    when they hold for these tokens: the chain they continue is the row's, and the bytes
    they were hashed from are `data`'s; else none."""
    ahead = tables.ahead(row)
    if ahead is None:
        return []
    keys, ahead_data = ahead
    stop = min(end, len(keys))
    if stop <= first or chain != (keys[first - 1] if first else tables.root(row)):
        return []
    width = len(data) // (end - first)
    if memoryview(ahead_data)[first * width: stop * width] != data[: (stop - first) * width]:
        return []
    return keys[first:stop]


def forget_unwritten(allocator: BlockAllocator, tables: PageTables, seq_id: object,
                     num_written: int, block_size: int) -> int:
    """Take out of the index every block of `seq_id` past its first `num_written` tokens
    (a failed step indexed them when it planned them, but their K/V was never written).
    Call before truncating the sequence back to `num_written`; returns how many left."""
    return allocator.unregister(tables.blocks(seq_id)[num_written // block_size:])
