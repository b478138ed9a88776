"""Decode attention on the CPU row by row: each sequence's query against its own blocks.

The batched path pads every row of a batch to the longest, gathers the whole batch's K/V
(writing it out to memory and reading it back), and hands SDPA a mask. One row at a time
copies only the blocks the row sees into a small reused buffer (block rows: memcpy speed),
reads them back while they are still in cache, needs no mask (a row sees exactly the keys it
gathered, a window or chunk sliced off in front), and serves grouped-query attention with
two matmuls batched over the KV heads, reading each KV head once for its query heads
(``[Hkv, G, D] @ [Hkv, D, n]``, K/V as strided views, never repeated). On the kernels
workload (16 rows of 512-1,024 tokens) it takes about half the batched path's time. A call
per row costs tens of µs, so rows with few keys stay batched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# a decode row attends on its own when the keys it reads take at least this many bytes (K
# alone): below it, the row's calls (~40 µs here) cost more than batching it saves
OWN_ROW_BYTES = 64 << 10


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
    buffers = _buffers(key_cache, value_cache, int(num_columns[own].max()), workspace)
    scale = head_dim ** -0.5 if scale is None else scale
    tables = block_tables.long()
    for row, start, end, skip, column, width in zip(
            *(t[own].tolist() for t in (rows, query_start_loc[rows], lens, first - first_column
                                        * block_size, first_column, num_columns)),
            strict=True):
        ids = tables[row, column:column + width]
        key, value = (torch.index_select(cache, 0, ids, out=buffer[:width])
                      .view(-1, num_kv_heads, head_dim)[skip:end - column * block_size]
                      for cache, buffer in zip((key_cache, value_cache), buffers, strict=True))
        out[start] = attend_one(query[start], key, value, scale)
    return rows[~own]


def attend_one(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               ) -> torch.Tensor:
    """One query over its keys, in float32: ``query [Hq, D]``, ``key / value [n, Hkv, D]``
    -> ``[Hq, D]``; query head ``h`` reads KV head ``h // (Hq / Hkv)``, as in repeat_kv."""
    num_kv_heads, head_dim = key.shape[1:]
    grouped = query.float().reshape(num_kv_heads, -1, head_dim) * scale  # [Hkv, G, D]
    scores = torch.bmm(grouped, key.float().permute(1, 2, 0))            # [Hkv, G, n]
    weights = torch.softmax(scores, dim=-1)
    return torch.bmm(weights, value.float().transpose(0, 1)).view(-1, head_dim)


def _buffers(key_cache: torch.Tensor, value_cache: torch.Tensor, num_blocks: int,
             workspace: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[num_blocks, block_size, Hkv, D]`` buffers of the pages' dtype, in `workspace`
    when it fits (a fresh multi-MiB buffer costs page faults on every call)."""
    shape = (num_blocks, *key_cache.shape[1:])
    size = torch.Size(shape).numel()
    if workspace is not None and workspace.dtype == key_cache.dtype \
            and workspace.numel() >= 2 * size:
        return workspace[:size].view(shape), workspace[size:2 * size].view(shape)
    return key_cache.new_empty(shape), value_cache.new_empty(shape)
