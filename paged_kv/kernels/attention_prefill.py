"""Prefill attention over pages with K/V tiles shared across a tile of queries (FlashAttention-2
style): a program per (query tile, KV head), its launcher, and the tile list it runs over.

`attention._paged_attention_kernel` runs a program per (query token, KV head), so every one of
a prompt's ``n`` new tokens reads its sequence's K/V again: ``n`` times the bytes a prefill
needs. Here a program holds ``BLOCK_M`` consecutive queries of one sequence, each with the
KV head's ``group_size`` query heads, as the rows of one tile, and walks the keys once::

    rows of a tile (BLOCK_G = next_power_of_2(group_size) heads per query):

      row r:  query first_query + r // BLOCK_G,  head kv_head * group_size + r % BLOCK_G
            +-------------------- BLOCK_D --------------------+
      r = 0 | query q0, head 0                                 |
      r = 1 | query q0, head 1       (GQA: one K/V tile feeds  |
        ... | ...                     all heads of the group)  |
            | query q0 + BLOCK_M - 1, head BLOCK_G - 1         |
            +--------------------------------------------------+
      keys:   first .. end - 1 in steps of BLOCK_N, each key's block looked up in the table

A query ``j`` of a sequence of ``n`` new tokens and ``seq_len`` cached ones sits at position
``seq_len - n + j`` (bottom-right causal, as `paged_attention`); a row masks the keys after
its position and, for a window or chunk, those before its first visible one. The loop runs
from the first key any row of the tile sees (that of its first query: first visible keys grow
with the position) to the last one its last query sees, so the blocks wholly before a window
or chunk are never read, as in the per-token kernel. The softmax is online, in float32, with
the sinks as a value-less first column and the soft-cap before the mask, as there.

The tile list is built with torch ops from ``query_start_loc`` and sized by a bound that needs
no read of the device (``cdiv(num_tokens, BLOCK_M) + B`` tiles at most: each sequence wastes
less than one tile), so a launch neither waits for the device nor changes its grid with the
batch's split into sequences; the programs past the last tile return at once.

The same kernel does flash-decoding: a decode batch of a few long sequences has too few
(sequence, KV head) programs to fill a GPU, so `decode_splits` gives the grid a third axis of
key runs, a tile holds one query, each run writes its unnormalized float32 ``acc`` with its
running max and denominator, and `_combine_splits_kernel` merges the runs::

    out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,   M = max_s m_s
"""

from __future__ import annotations

import functools

import torch

from . import attention_tile
from ._triton import tl, triton

__all__ = ["decode_splits", "launch_tiled", "query_tiles", "tile_shape"]

# rows (queries x heads of the group) per program: a [64, 128] float32 accumulator and a
# [64, 64] score tile fit a 4-warp program's registers (vLLM's unified attention uses 64 query
# rows for prefill too); the gpu_check benchmark times it against SDPA and FlashAttention
ROWS_PER_TILE = 64
KEYS_PER_TILE = 64  # a [64, D] K and V tile in flight per step, as the per-token kernel
NUM_WARPS = 4  # Triton's default; 64 x 128 float32 accumulators are 64 registers a thread
# flash-decoding: split a decode batch's keys until about this many programs run per
# multiprocessor (2: one waiting on memory while the other computes), in runs of at least
# MIN_KEYS_PER_SPLIT keys (4 steps of 64, so a split's fixed cost, a partial written and read
# back, stays small beside its loads), into at most MAX_SPLITS
PROGRAMS_PER_MULTIPROCESSOR = 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16
# kernel arguments of the per-token kernel that the tiled one has no use for: it reads its
# sequence from the tile list, and pads the group to a power of two only (the rows are >= 16)
_PER_TOKEN_ONLY = ("num_seqs", "BLOCK_B", "BLOCK_G", "BLOCK_N")


if triton is not None:

    @triton.jit
    def _prefill_attention_kernel(
        query_ptr,            # [num_tokens, num_q_heads, D]
        key_cache_ptr,        # [num_blocks, block_size, num_kv_heads, D]
        value_cache_ptr,      # [num_blocks, block_size, num_kv_heads, D], same strides
        key_scales_ptr,       # [num_blocks, block_size, num_kv_heads], read when FORMAT
        value_scales_ptr,     # as key_scales, same strides
        sinks_ptr,            # [num_q_heads] float32, read when HAS_SINKS
        block_tables_ptr,     # [B, max_blocks] int32
        seq_lens_ptr,         # [B] int32, including this step's tokens
        query_start_loc_ptr,  # [B + 1] int32
        tile_seqs_ptr,        # [max_tiles] int32: the tile's sequence, -1 past the last tile
        tile_queries_ptr,     # [max_tiles] int32: its first query, counted in its sequence
        out_ptr,              # [num_tokens, num_q_heads, D]
        partial_out_ptr,      # [NUM_SPLITS, num_tokens, num_q_heads, D] float32, when split
        partial_max_ptr,      # [NUM_SPLITS, num_tokens, num_q_heads] float32, when split
        partial_sum_ptr,      # [NUM_SPLITS, num_tokens, num_q_heads] float32, when split
        query_stride_token,   # strides, in elements
        query_stride_head,
        query_stride_dim,
        out_stride_token,
        out_stride_head,
        out_stride_dim,
        cache_stride_block,
        cache_stride_offset,
        cache_stride_head,
        cache_stride_dim,
        scale_stride_block,   # key_scales / value_scales strides
        scale_stride_offset,
        scale_stride_head,
        block_tables_stride,
        num_tokens,           # rows of the query (and of each split's partials)
        block_size,
        group_size,           # num_q_heads // num_kv_heads
        head_dim,
        scale,                # softmax scale
        window,               # sliding window W, read when LOCAL (2**30 when off)
        chunk,                # chunk size C, read when LOCAL (2**30 when off)
        softcap,              # scores -> softcap * tanh(scores / softcap), read when SOFTCAP
        BLOCK_M: tl.constexpr,  # queries per tile
        BLOCK_G: tl.constexpr,  # next_power_of_2(group_size): rows per query
        BLOCK_N: tl.constexpr,  # keys per step
        BLOCK_D: tl.constexpr,  # next_power_of_2(D), >= 16 for tl.dot
        UPCAST_DOT: tl.constexpr,  # feed tl.dot float32 (the interpreter's bf16 dot is wrong)
        FORMAT: tl.constexpr,   # 0 = float pages; else quant.FORMATS' (or quant4's) code
        LOCAL: tl.constexpr,    # a window or chunk: rows mask the keys before their first
        HAS_SINKS: tl.constexpr,  # a per-head sink logit in the softmax denominator
        SOFTCAP: tl.constexpr,  # soft-cap the scaled scores
        NUM_SPLITS: tl.constexpr,  # > 1: this program takes one of as many runs of the keys
    ):
        # the last tiles of a sequence see the most keys: launching them first (and the spare
        # tiles past the end, which return at once) leaves the short ones to fill the tail
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(tile_seqs_ptr + tile)
        if seq < 0:  # past the last tile of the batch (the grid is an upper bound)
            return
        first_query = tl.load(tile_queries_ptr + tile)
        query_start = tl.load(query_start_loc_ptr + seq)
        num_queries = tl.load(query_start_loc_ptr + seq + 1) - query_start
        context = tl.load(seq_lens_ptr + seq) - num_queries  # position of query 0
        # keys first .. end - 1: from what the tile's first query sees to its last query
        end = context + tl.minimum(first_query + BLOCK_M, num_queries)
        ROWS: tl.constexpr = BLOCK_M * BLOCK_G
        rows = tl.arange(0, ROWS)
        row_query = first_query + rows // BLOCK_G
        row_head = rows % BLOCK_G
        is_head = row_head < group_size
        is_row = (row_query < num_queries) & is_head
        row_pos = context + row_query  # [ROWS] positions of the rows' queries
        first = 0
        if LOCAL:
            row_first = tl.maximum(row_pos - window + 1, 0)
            row_first = tl.maximum(row_first, row_pos // chunk * chunk)
            first_pos = context + first_query
            first = tl.maximum(first_pos - window + 1, 0)
            first = tl.maximum(first, first_pos // chunk * chunk)
        if NUM_SPLITS > 1:
            # flash-decoding: split `split` takes one run of whole steps of the keys, and
            # writes its unnormalized sums for `_combine_splits_kernel` (runs past the end
            # are empty and write max -inf, sum 0)
            span = tl.cdiv(tl.cdiv(end - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
            first = first + split * span
            end = tl.minimum(end, first + span)

        dims = tl.arange(0, BLOCK_D)
        is_dim = dims < head_dim
        heads = kv_head * group_size + row_head
        q_offsets = ((query_start + row_query).to(tl.int64)[:, None] * query_stride_token
                     + heads[:, None] * query_stride_head + dims[None, :] * query_stride_dim)
        q_mask = is_row[:, None] & is_dim[None, :]
        q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)  # [ROWS, BLOCK_D]
        # tl.dot wants one dtype: the pages', or the query's when the pages are codes
        if FORMAT == 0:
            q = q.to(key_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            q = q.to(tl.float32)

        if HAS_SINKS:
            # the sink is a key column of logit `sink` and no value: the running max starts
            # at it with exp(sink - sink) = 1 in the denominator (padding heads read 0)
            m_i = tl.load(sinks_ptr + heads, mask=is_head, other=0.0).to(tl.float32)
            l_i = tl.full([ROWS], 1.0, tl.float32)
            if NUM_SPLITS > 1:  # counted once, by the first split
                m_i = tl.where(split == 0, m_i, float("-inf"))
                l_i = tl.where(split == 0, l_i, 0.0)
        else:
            m_i = tl.full([ROWS], float("-inf"), tl.float32)  # running max
            l_i = tl.zeros([ROWS], tl.float32)  # running softmax denominator
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
        for start in range(first, end, BLOCK_N):
            positions = start + keys
            is_key = positions < end
            blocks = tl.load(table_row + positions // block_size, mask=is_key, other=0)
            k, v = attention_tile.load_kv_tile(
                key_cache_ptr, value_cache_ptr, key_scales_ptr, value_scales_ptr, query_ptr,
                blocks, positions, is_key, dims, is_dim, kv_head, block_size,
                cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
                scale_stride_block, scale_stride_offset, scale_stride_head, FORMAT, UPCAST_DOT)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [ROWS, BLOCK_N]
            if SOFTCAP:
                scores = attention_tile.soft_cap(scores, softcap)
            # per row: causal (bottom-right), and the window / chunk's first visible key
            visible = is_key[None, :] & (positions[None, :] <= row_pos[:, None])
            if LOCAL:
                visible = visible & (positions[None, :] >= row_first[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_i, l_i, acc = attention_tile.online_step(m_i, l_i, acc, scores, v,
                                                       value_cache_ptr, query_ptr, FORMAT,
                                                       UPCAST_DOT)

        if NUM_SPLITS > 1:
            # [split, token, head] of contiguous partials: the combine reads them back
            num_q_heads = tl.num_programs(1) * group_size
            partial_rows = ((split.to(tl.int64) * num_tokens + query_start + row_query)
                            * num_q_heads + heads)
            tl.store(partial_max_ptr + partial_rows, m_i, mask=is_row)
            tl.store(partial_sum_ptr + partial_rows, l_i, mask=is_row)
            tl.store(partial_out_ptr + partial_rows[:, None] * head_dim + dims[None, :], acc,
                     mask=q_mask)
        else:
            # every real row sees its own key, so l_i > 0 there; padding rows past the
            # sequence's queries may see none, and divide by 1 rather than make a NaN
            # nobody stores
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_offsets = ((query_start + row_query).to(tl.int64)[:, None] * out_stride_token
                           + heads[:, None] * out_stride_head + dims[None, :] * out_stride_dim)
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _combine_splits_kernel(
        partial_out_ptr,   # [NUM_SPLITS, num_tokens, num_q_heads, D] float32, unnormalized
        partial_max_ptr,   # [NUM_SPLITS, num_tokens, num_q_heads] float32 running maxima
        partial_sum_ptr,   # [NUM_SPLITS, num_tokens, num_q_heads] float32 softmax sums
        out_ptr,           # [num_tokens, num_q_heads, D]
        out_stride_token,  # strides, in elements
        out_stride_head,
        out_stride_dim,
        num_rows,          # num_tokens * num_q_heads: one split's partials
        head_dim,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,  # next_power_of_2(NUM_SPLITS)
        BLOCK_D: tl.constexpr,  # next_power_of_2(D)
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        row = token.to(tl.int64) * tl.num_programs(1) + head
        splits = tl.arange(0, BLOCK_S)
        is_split = splits < NUM_SPLITS
        dims = tl.arange(0, BLOCK_D)
        is_dim = dims < head_dim
        m = tl.load(partial_max_ptr + splits * num_rows + row, mask=is_split,
                    other=float("-inf"))
        l_s = tl.load(partial_sum_ptr + splits * num_rows + row, mask=is_split, other=0.0)
        # the first split holds the row's first visible keys (or its sink), so the max is
        # finite; empty splits (-inf) weigh exp(-inf) = 0
        weights = tl.exp(m - tl.max(m, axis=0))  # [BLOCK_S]
        acc = tl.load(partial_out_ptr + (splits[:, None] * num_rows + row) * head_dim
                      + dims[None, :], mask=is_split[:, None] & is_dim[None, :], other=0.0)
        out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(l_s * weights, axis=0)
        tl.store(out_ptr + token.to(tl.int64) * out_stride_token + head * out_stride_head
                 + dims * out_stride_dim, out.to(out_ptr.dtype.element_ty), mask=is_dim)



def tile_shape(group_size: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_G)``: queries per tile and rows per query for a KV head's group.

    The group is padded to a power of two (``BLOCK_G``) and the tile holds `ROWS_PER_TILE`
    rows, so ``BLOCK_M = ROWS_PER_TILE // BLOCK_G`` queries (at least one: a group wider than
    the tile takes one query a tile).

    Examples
    --------
    >>> tile_shape(1), tile_shape(3), tile_shape(128)  # 64 rows = 64 x 1 = 16 x 4; 1 x 128
    ((64, 1), (16, 4), (1, 128))
    """
    block_g = 1 << max(0, group_size - 1).bit_length()
    return max(1, ROWS_PER_TILE // block_g), block_g


def query_tiles(query_start_loc: torch.Tensor, num_tokens: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of `block_m` consecutive queries of one sequence covering a batch.

    Parameters
    ----------
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 offsets of each sequence's queries.
    num_tokens : int
        ``query_start_loc[-1]``, known on the host (the query's length), so nothing is read
        back from the device.
    block_m : int
        Queries per tile.

    Returns
    -------
    tuple of torch.Tensor
        ``(tile_seqs, tile_queries)``, both ``[cdiv(num_tokens, block_m) + B]`` int32 on the
        offsets' device: each tile's sequence (``-1`` past the last tile) and first query,
        counted within its sequence. A sequence of ``n`` queries has ``cdiv(n, block_m)``
        tiles, in order; one with none has none.

    Examples
    --------
    >>> seqs, firsts = query_tiles(torch.tensor([0, 5, 5, 6], dtype=torch.int32), 6, 4)
    >>> seqs.tolist(), firsts.tolist()  # 5 queries: tiles at 0 and 4; then 1 query; spare
    ([0, 0, 2, -1, -1], [0, 4, 0, 0, 0])
    """
    num_seqs = query_start_loc.shape[0] - 1
    # sum of cdiv(n_i, M) <= sum (n_i / M + 1) = num_tokens / M + B, so this bound needs no
    # read of the lengths
    max_tiles = -(-num_tokens // block_m) + num_seqs
    num_queries = (query_start_loc[1:] - query_start_loc[:-1]).long()
    tiles_per_seq = torch.div(num_queries + block_m - 1, block_m, rounding_mode="floor")
    tile_ends = torch.cumsum(tiles_per_seq, 0)  # [B]
    tiles = torch.arange(max_tiles, device=query_start_loc.device)
    seqs = torch.searchsorted(tile_ends, tiles, right=True)  # [max_tiles], B past the end
    is_tile = seqs < num_seqs
    # a spare tile reads the last sequence's start, then is masked: no out-of-range index
    first_tile = (tile_ends - tiles_per_seq)[seqs.clamp(max=num_seqs - 1)]
    firsts = (tiles - first_tile) * block_m
    return (torch.where(is_tile, seqs, -1).to(torch.int32),
            torch.where(is_tile, firsts, 0).to(torch.int32))


def decode_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_keys: int,
                  device: torch.device) -> int:
    """How many runs of keys each decode query's attention is split into (flash-decoding).

    A decode batch has a program per (sequence, KV head); a few long sequences then leave
    most of a GPU idle, each program walking thousands of keys. Splitting the keys into runs
    that programs take in parallel, then combining their partial softmaxes, fills the GPU:
    enough splits for about `PROGRAMS_PER_MULTIPROCESSOR` programs per multiprocessor, no run
    shorter than `MIN_KEYS_PER_SPLIT` of the longest possible sequence (`max_keys`, the block
    table's width in tokens: known on the host, where the lengths are not), at most
    `MAX_SPLITS`. 1 (no split) for prefill batches, which have tiles enough, and off CUDA.

    Examples
    --------
    >>> decode_splits(4, 4, 8, 8192, torch.device("cpu"))  # the interpreter runs one by one
    1
    """
    if num_tokens > num_seqs or device.type != "cuda":
        return 1
    target = PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors(device.index)
    splits = min(MAX_SPLITS, target // max(1, num_tokens * num_kv_heads),
                 max_keys // MIN_KEYS_PER_SPLIT)
    return max(1, splits)


@functools.cache
def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_tiled(kernel_args: dict, query_start_loc: torch.Tensor, num_tokens: int,
                 num_kv_heads: int, num_splits: int = 1) -> None:
    """Run `_prefill_attention_kernel` over the batch with the per-token kernel's arguments.

    Parameters
    ----------
    kernel_args : dict
        The keyword arguments `attention.paged_attention_triton` gives
        `attention._paged_attention_kernel` (pointers, strides, sizes, layer kind); the ones
        only that kernel uses are dropped and the tile list and shapes added.
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 offsets of each sequence's queries.
    num_tokens : int
        Rows of the query, ``query_start_loc[-1]``.
    num_kv_heads : int
        The grid's second dimension.
    num_splits : int, optional
        Runs of keys each tile's attention is split into (`decode_splits`); above 1 the tiles
        hold one query each (decode), the splits write float32 partials
        (``num_splits * num_tokens * num_q_heads * (D + 2)`` elements) and
        `_combine_splits_kernel` merges them into the output.

    Mutates
    -------
    ``kernel_args["out_ptr"]``, every row of which is written.
    """
    group_size, out = kernel_args["group_size"], kernel_args["out_ptr"]
    if num_splits > 1:  # a query a tile, its group's heads padded to the 16 rows tl.dot needs
        block_m, block_g = 1, max(16, tile_shape(group_size)[1])
    else:
        block_m, block_g = tile_shape(group_size)
    partials = _partials(out, num_splits)
    tile_seqs, tile_queries = query_tiles(query_start_loc, num_tokens, block_m)
    args = {name: value for name, value in kernel_args.items() if name not in _PER_TOKEN_ONLY}
    # a program per (tile of block_m queries, kv head[, split]): each K/V tile it loads serves
    # all block_m x group_size rows, where the per-token kernel loads it once per query
    _prefill_attention_kernel[(tile_seqs.shape[0], num_kv_heads, num_splits)](
        **args, tile_seqs_ptr=tile_seqs, tile_queries_ptr=tile_queries, num_tokens=num_tokens,
        **partials, BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_N=KEYS_PER_TILE,
        NUM_SPLITS=num_splits, num_warps=NUM_WARPS)
    if num_splits > 1:
        # a program per (token, query head): D + 2 floats of each split, a few KiB at most
        _combine_splits_kernel[(num_tokens, out.shape[1])](
            **partials, out_ptr=out, out_stride_token=out.stride(0),
            out_stride_head=out.stride(1), out_stride_dim=out.stride(2),
            num_rows=num_tokens * out.shape[1], head_dim=out.shape[2], NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=kernel_args["BLOCK_D"])


def _partials(out: torch.Tensor, num_splits: int) -> dict[str, torch.Tensor]:
    """The split kernels' float32 partials of an ``out [num_tokens, num_q_heads, D]``, three
    views of one allocation: ``[num_splits, num_tokens, num_q_heads, D]`` outputs, then
    ``[num_splits, num_tokens, num_q_heads]`` maxima and sums, flat (one element each,
    unread, without splits)."""
    num_rows = num_splits * out.shape[0] * out.shape[1] if num_splits > 1 else 1
    head_dim = out.shape[2]
    flat = out.new_empty(num_rows * (head_dim + 2), dtype=torch.float32)
    return dict(partial_out_ptr=flat[: num_rows * head_dim],
                partial_max_ptr=flat[num_rows * head_dim: num_rows * (head_dim + 1)],
                partial_sum_ptr=flat[num_rows * (head_dim + 1):])
