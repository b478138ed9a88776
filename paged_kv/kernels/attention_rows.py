"""Decode attention on the CPU row by row: each sequence's query against its own blocks.

The batched path pads every row of a batch to the longest, gathers the whole batch's K/V
(writing it out to memory and reading it back), and hands SDPA a mask. One row at a time
copies only the blocks the row sees into a small reused buffer (block rows: memcpy speed),
reads them back while they are still in cache, needs no mask (a row sees exactly the keys it
gathered, a window or chunk sliced off in front), and serves grouped-query attention with
two matmuls batched over the KV heads, reading each KV head once for its query heads
(``[Hkv, G, D] @ [Hkv, D, n]``, K/V as strided views, never repeated). On the kernels
workload (16 rows of 512-1,024 tokens) it takes about half the batched path's time.

A row costs a few torch calls of a few µs each, so what a row does is kept to them: the
queries of all rows are scaled and grouped in one op, every row's block ids (K's and V's
next to each other) are listed in one tensor, and a row then makes one gather (both planes
at once where V's pages follow K's in memory, as in the pool), two matmuls and a softmax,
the second matmul writing its result in place; the results reach `out` in one op. Rows
with few keys stay batched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# a decode row attends on its own when the keys it reads take at least this many bytes (K
# alone; 32 tokens of the peers model): below it, the row's calls (~25 µs here) cost more
# than batching it saves. It was 64 KiB while a row took a dozen calls; on the peers
# workload's decode steps a length bucket of the few rows between 16 and 64 KiB cost more
# (~0.2 ms of fixed cost a call) than attending them here
OWN_ROW_BYTES = 16 << 10


def attend_rows(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, rows: torch.Tensor, scale: float | None,
                out: torch.Tensor, workspace: torch.Tensor | None,
                first_visible: Callable[[torch.Tensor], torch.Tensor] | None = None,
                ) -> torch.Tensor:
    """Attend the decode `rows` that read enough keys one by one into `out`; returns the
    rows left to the batched path.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, Hq, D]``; a decode row's one query at ``query_start_loc[row]``.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, Hkv, D]`` float pages.
    block_tables, seq_lens, query_start_loc : torch.Tensor
        ``[B, max_blocks]`` int32, ``[B]`` and ``[B + 1]`` int32, as `paged_attention`'s.
    rows : torch.Tensor
        ``[R]`` int64 decode rows (one query each).
    scale : float, optional
        Of the scores; ``D ** -0.5`` when None.
    out : torch.Tensor
        ``[num_tokens, Hq, D]``, written at the attended rows' queries.
    workspace : torch.Tensor, optional
        Reused as the gather buffer when it has the pages' dtype and room for one row's K
        and V.
    first_visible : callable, optional
        A window's or chunk's `AttentionKind.first_visible` (no sinks, no soft-cap): a row
        sees its keys from ``first_visible(len - 1)`` on; None, all of them.

    Returns
    -------
    torch.Tensor
        ``[R']`` the rows not attended here (few keys, or past their table).
    """
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    token_bytes = num_kv_heads * head_dim * key_cache.element_size()
    # no row long enough (short decode batches): one read, not the dozen ops below
    if not rows.numel() or int(seq_lens.max()) * token_bytes < OWN_ROW_BYTES:
        return rows
    lens = seq_lens[rows].long()
    first = torch.zeros_like(lens) if first_visible is None else first_visible(lens - 1)
    first_column = torch.div(first, block_size, rounding_mode="floor")
    num_columns = torch.div(lens - 1, block_size, rounding_mode="floor") - first_column + 1
    own = ((lens - first) * token_bytes >= OWN_ROW_BYTES) \
        & (first_column + num_columns <= block_tables.shape[1])
    if not bool(own.any()):
        return rows
    attended, first_column = rows[own], first_column[own]
    column_start = first_column * block_size
    _attend_each(query, key_cache, value_cache, block_tables[attended].long(),
                 query_start_loc[attended].long(), first_column, num_columns[own],
                 first[own] - column_start, lens[own] - column_start, scale, out, workspace)
    return rows[~own]


def _attend_each(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 tables: torch.Tensor, starts: torch.Tensor, first_column: torch.Tensor,
                 num_columns: torch.Tensor, skips: torch.Tensor, ends: torch.Tensor,
                 scale: float | None, out: torch.Tensor, workspace: torch.Tensor | None,
                 ) -> None:
    """`attend_rows`' loop over the rows it keeps, all ``[R]`` int64: ``tables [R,
    max_blocks]`` their block tables, `starts` their queries; a row reads `num_columns`
    blocks from `first_column` (the block of its first visible key), its keys ``skips ..
    ends`` counted from that block's first."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    pages = _both_planes(key_cache, value_cache)
    ids = _block_ids(tables, first_column, num_columns,
                     0 if pages is None else key_cache.shape[0])
    buffer = _buffer(key_cache, int(num_columns.max()), workspace)
    scale = head_dim ** -0.5 if scale is None else scale
    # [R, Hkv, G, D] float32: query head h reads KV head h // G, as in repeat_kv
    grouped = (query[starts].float() * scale).view(len(starts), num_kv_heads, -1, head_dim)
    results = torch.empty_like(grouped)
    widths = num_columns.tolist()
    # per row, views made by one call each: a slice of the ids, K^T and V read in place
    gathered = {width: buffer[:2 * width] for width in set(widths)}
    token, first = num_kv_heads * head_dim, buffer.storage_offset()
    for grouped_row, result, row_ids, skip, end, width in zip(
            grouped.unbind(0), results.unbind(0), ids.split([2 * w for w in widths]),
            skips.tolist(), ends.tolist(), widths, strict=True):
        both = gathered[width]
        if pages is None:
            torch.index_select(key_cache, 0, row_ids[:width], out=both[:width])
            torch.index_select(value_cache, 0, row_ids[width:], out=both[width:])
        else:
            torch.index_select(pages, 0, row_ids, out=both)
        key = first + skip * token  # both: [2 * width, block_size, Hkv, D], K's then V's
        value = key + width * key_cache.shape[1] * token
        attend_one(grouped_row,
                   buffer.as_strided((num_kv_heads, head_dim, end - skip), (head_dim, 1, token),
                                     key),
                   buffer.as_strided((num_kv_heads, end - skip, head_dim), (head_dim, token, 1),
                                     value), result)
    out[starts] = results.view(len(starts), -1, head_dim).to(out.dtype)


def attend_one(grouped: torch.Tensor, key_t: torch.Tensor, value: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """One query over its keys, in float32, into `out`: ``grouped [Hkv, G, D]`` float32, the
    query already scaled, query head ``h`` at ``[h // G, h % G]``; ``key_t [Hkv, D, n]``
    and ``value [Hkv, n, D]`` of the pages' dtype (strided views of the gathered rows) ->
    ``out [Hkv, G, D]`` float32 (returned)."""
    scores = torch.bmm(grouped, key_t.float())  # [Hkv, G, n]
    return torch.bmm(torch.softmax(scores, dim=-1), value.float(), out=out)


def _block_ids(tables: torch.Tensor, first_column: torch.Tensor, num_columns: torch.Tensor,
               value_offset: int) -> torch.Tensor:
    """Every attended row's block ids, K's then V's (K's plus `value_offset`), row after row:
    ``[2 * num_columns.sum()]`` int64, so a row's gather reads one slice of it."""
    widest = int(num_columns.max())
    steps = torch.arange(widest, device=tables.device)
    columns = (first_column[:, None] + steps).clamp(max=tables.shape[1] - 1)
    ids = tables.gather(1, columns)  # [R, widest]
    kept = (steps < num_columns[:, None])[:, None, :].expand(-1, 2, -1)
    return torch.stack((ids, ids + value_offset), dim=1)[kept]


def _both_planes(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor | None:
    """``[2 * num_blocks, block_size, Hkv, D]``, K's pages then V's, when V's follow K's in
    one storage with the same strides (the pool's layer ``[2, num_blocks, ...]``): one gather
    then copies a row's K and V. None otherwise."""
    num_blocks = key_cache.shape[0]
    if (value_cache.dtype != key_cache.dtype or value_cache.stride() != key_cache.stride()
            or not key_cache.is_contiguous()
            or value_cache.untyped_storage().data_ptr() != key_cache.untyped_storage().data_ptr()
            or value_cache.storage_offset() - key_cache.storage_offset()
            != num_blocks * key_cache.stride(0)):
        return None
    return key_cache.as_strided((2 * num_blocks, *key_cache.shape[1:]), key_cache.stride())


def _buffer(key_cache: torch.Tensor, num_blocks: int,
            workspace: torch.Tensor | None) -> torch.Tensor:
    """``[2 * num_blocks, block_size, Hkv, D]`` of the pages' dtype (a row's K blocks, then
    its V blocks), in `workspace` when it fits (a fresh multi-MiB buffer costs page faults on
    every call)."""
    shape = (2 * num_blocks, *key_cache.shape[1:])
    size = torch.Size(shape).numel()
    if workspace is not None and workspace.dtype == key_cache.dtype \
            and workspace.numel() >= size:
        return workspace[:size].view(shape)
    return key_cache.new_empty(shape)
