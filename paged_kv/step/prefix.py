"""Prefix-cache keys: finding a prompt's cached blocks, and indexing blocks as they fill.

Functions over the two owners involved (the allocator's index, the page tables' rows); the
cache calls them at admission, the step commit as blocks fill, and a scheduler
(`match_prefix`) to size a request before admitting it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..allocator import BlockAllocator
from ..keys import encode_tokens, hash_chain, root_hash
from ..page_table import PageTables
from .parse import tokens_to_array


def lookup_prefix(allocator: BlockAllocator, chain: bytes, tokens: np.ndarray,
                  block_size: int) -> tuple[bytes, list[int]]:
    """Cached blocks of the longest prefix of `tokens` (full blocks, never the last token).

    Returns the key of the last block found (or `chain`) and the blocks' ids.
    """
    num_full = (len(tokens) - 1) // block_size
    if num_full <= 0:
        return chain, []
    hits, keys = allocator.match(chain, encode_tokens(tokens[: num_full * block_size]),
                                 num_full)
    return (keys[len(hits) - 1] if hits else chain), hits


def match_prefix(allocator: BlockAllocator, token_ids: Sequence[int] | np.ndarray,
                 block_size: int, *, salt: str | None = None) -> int:
    """Tokens of a prompt that adding it now would find cached; changes nothing (no
    counters either), so a scheduler can size a request before admitting it.

    Examples
    --------
    >>> match_prefix(BlockAllocator(8), [1, 2, 3, 4, 5], block_size=4)
    0
    """
    chain = root_hash(salt)  # also the salt's check
    tokens = tokens_to_array("match_prefix(): token_ids", token_ids)
    if not allocator.enable_prefix_caching or not len(tokens):
        return 0
    return len(lookup_prefix(allocator, chain, tokens, block_size)[1]) * block_size


def index_filled_blocks(allocator: BlockAllocator, tables: PageTables, filled: np.ndarray,
                        filled_tokens: np.ndarray) -> None:
    """Index the blocks a decode step filled with its last tokens: ``filled[:, i]`` is a row
    and the block it filled, ``filled_tokens[i]`` that block's token ids (as
    `PageTables.commit_decode` returns them, so nothing is gathered again)."""
    rows, blocks = filled.tolist()
    if not rows:
        return
    parents = tables.chains(rows)
    if None in parents:  # rows whose ids are unknown somewhere are never indexed
        keep = [i for i, parent in enumerate(parents) if parent is not None]
        rows, blocks = [rows[i] for i in keep], [blocks[i] for i in keep]
        parents, filled_tokens = [parents[i] for i in keep], filled_tokens[keep]
    keys = allocator.register_blocks(blocks, parents, encode_tokens(filled_tokens))
    tables.set_chains(rows, keys)


def index_full_blocks(allocator: BlockAllocator, tables: PageTables, rows: np.ndarray,
                      old_lens: np.ndarray, new_lens: np.ndarray, block_size: int) -> None:
    """Enter every block a step filled with known ids (rows grew old_lens -> new_lens)."""
    first_full, end_full = old_lens // block_size, new_lens // block_size
    filling = np.flatnonzero(end_full > first_full)
    for i in filling.tolist():
        index_row_blocks(allocator, tables, int(rows[i]), int(first_full[i]),
                         int(end_full[i]), block_size)


def index_row_blocks(allocator: BlockAllocator, tables: PageTables, row: int, first: int,
                     end: int, block_size: int) -> None:
    """Enter the full blocks ``first .. end - 1`` of one row, chained from its last key."""
    chain = tables.chain(row)
    if chain is None or end <= first:  # ids unknown somewhere: never indexed
        return
    data = encode_tokens(tables.token_ids[row, first * block_size: end * block_size])
    keys = allocator.register_chain(tables.block_ids[row, first:end].tolist(), chain, data)
    tables.set_chain(row, keys[-1])


def forget_unwritten(allocator: BlockAllocator, tables: PageTables, seq_id: object,
                     num_written: int, block_size: int) -> int:
    """Take out of the index every block of `seq_id` past its first `num_written` tokens
    (a failed step indexed them when it planned them, but their K/V was never written).
    Call before truncating the sequence back to `num_written`; returns how many left."""
    return allocator.unregister(tables.blocks(seq_id)[num_written // block_size:])


def missing_blocks(allocator: BlockAllocator, token_ids: np.ndarray, block_size: int,
                   salt: str | None = None) -> tuple[int, bytes, list[bytes], np.ndarray]:
    """The full blocks of a prompt the device index lacks, as a lower tier would know them.

    Returns
    -------
    num_hit : int
        Blocks found on the device (the prefix `match_prefix` counts).
    parent_key : bytes
        The key the first missing block chains from: the last hit's, or the root's.
    keys : list of bytes
        The chained keys of the prompt's remaining full blocks, in order (never the block
        holding the last token, which is always computed).
    token_ids : np.ndarray
        ``[len(keys) * block_size]`` those blocks' token ids.
    """
    chain = root_hash(salt)
    tokens = tokens_to_array("missing_blocks(): token_ids", token_ids)
    chain, hits = lookup_prefix(allocator, chain, tokens, block_size)
    start, end = len(hits) * block_size, (len(tokens) - 1) // block_size * block_size
    rest = tokens[start:end] if end > start else tokens[:0]
    keys, _ = hash_chain(chain, encode_tokens(rest), len(rest) // block_size)
    return len(hits), chain, keys, rest
