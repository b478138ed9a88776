"""Prefix-cache keys: finding a prompt's cached blocks, and indexing blocks as they fill.

Functions over the two owners involved (the allocator's index, the page tables' rows); the
cache calls them from `add_sequence` and `prepare`.
"""

from __future__ import annotations

import numpy as np

from .allocator import TOKEN_BYTES, BlockAllocator, encode_tokens, hash_block
from .page_table import PageTables


def lookup_prefix(allocator: BlockAllocator, chain: bytes, tokens: np.ndarray,
                  block_size: int) -> tuple[bytes, list[int]]:
    """Cached blocks of the longest prefix of `tokens` (full blocks, never the last token).

    Returns the key of the last block found (or `chain`) and the blocks' ids.
    """
    hits: list[int] = []
    for start in range(0, (len(tokens) - 1) // block_size * block_size, block_size):
        block_tokens = encode_tokens(tokens[start:start + block_size])
        key = hash_block(chain, block_tokens)
        block_id = allocator.lookup(key, block_tokens)
        if block_id is None:
            break
        hits.append(block_id)
        chain = key
    return chain, hits


def index_filled_blocks(allocator: BlockAllocator, tables: PageTables, rows: np.ndarray,
                        block_size: int) -> None:
    """Index the block each of `rows` just filled with its last token (a decode step)."""
    if rows.size == 0:
        return
    row_list = rows.tolist()
    parents = tables.chains(row_list)
    if None in parents:  # rows whose ids are unknown somewhere are never indexed
        keep = [i for i, parent in enumerate(parents) if parent is not None]
        rows, row_list = rows[keep], [row_list[i] for i in keep]
        parents = [parents[i] for i in keep]
    columns = tables.num_blocks[rows] - 1
    # [rows, blocks, block_size] view: one gather yields each filled block's token ids
    block_tokens = tables.token_ids.reshape(tables.token_ids.shape[0], -1, block_size)
    token_ids = encode_tokens(block_tokens[rows, columns])
    keys = allocator.register_blocks(tables.block_ids[rows, columns].tolist(), parents,
                                     token_ids)
    tables.set_chains(row_list, keys)


def index_full_blocks(allocator: BlockAllocator, tables: PageTables, rows: np.ndarray,
                      old_lens: np.ndarray, new_lens: np.ndarray, block_size: int) -> None:
    """Enter every block a step filled with known ids (rows grew old_lens -> new_lens)."""
    first_full, end_full = old_lens // block_size, new_lens // block_size
    num_filled = end_full - first_full
    if not num_filled.any():
        return
    # every (row, block column) filled this step, gathered at once; hashing stays serial
    # because each key chains the previous block's key
    owner = np.repeat(rows, num_filled)
    rank = np.arange(owner.size) - np.repeat(np.cumsum(num_filled) - num_filled, num_filled)
    columns = np.repeat(first_full, num_filled) + rank
    block_ids = tables.block_ids[owner, columns].tolist()
    slots = columns[:, None] * block_size + np.arange(block_size)
    data = encode_tokens(tables.token_ids[owner[:, None], slots])
    width, register = TOKEN_BYTES * block_size, allocator.register
    row, chain = -1, None
    for i, (block_row, block_id) in enumerate(zip(owner.tolist(), block_ids, strict=True)):
        if block_row != row:
            if row >= 0 and chain is not None:
                tables.set_chain(row, chain)
            row, chain = block_row, tables.chain(block_row)
        if chain is not None:
            block_tokens = data[i * width:(i + 1) * width]
            chain = hash_block(chain, block_tokens)
            register(block_id, chain, block_tokens)
    if chain is not None:
        tables.set_chain(row, chain)
