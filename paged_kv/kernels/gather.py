"""gather_kv: rebuild contiguous K/V from the pages, padded ``[B, T, H, D]``; the kernel and
helpers the packed varlen form (`gather_packed`) shares."""

from __future__ import annotations

import torch

from . import quant, quant4
from ._triton import tl, triton
from .backend import use_triton
from .rows import gather_padded_by_blocks
from .rows_compiled import gather_rows


def gather_slots(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
           block_size: int) -> torch.Tensor:
    """Slot of each (sequence row, token position) pair; positions past the table read block 0."""
    columns = torch.div(positions, block_size, rounding_mode="floor")
    inside = columns < block_tables.shape[1]
    blocks = block_tables[seq_index, columns.clamp(max=block_tables.shape[1] - 1)].long()
    return torch.where(inside, blocks, 0) * block_size + positions % block_size


def gather_kv_reference(
    key_cache: torch.Tensor,     # [num_blocks, block_size, H, D]
    value_cache: torch.Tensor,   # [num_blocks, block_size, H, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,      # [B] int32
    pad_to: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    zero_padding: bool = True,
    key_scales: torch.Tensor | None = None,    # [num_blocks, block_size, H], 8-bit pages
    value_scales: torch.Tensor | None = None,  # [num_blocks, block_size, H]
    out_dtype: torch.dtype | None = None,      # of new outputs from 8-bit pages
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of `gather_kv` (the CPU path).

    When ``T`` is a multiple of the block size whole blocks are copied as rows of
    ``block_size * H * D`` elements, which runs at memcpy speed; otherwise it copies
    token rows of ``H * D`` (about 0.6x as fast here). Pass `pad_to` rounded up to the block
    size for the fast path. With zero padding, sequences long enough (or much padding) are
    copied one by one as block rows and only their padding zeroed, whatever ``T``
    (`rows.gather_padded_by_blocks`), or in one compiled loop where numba is installed
    (`rows_compiled.gather_rows`). ``zero_padding=False`` leaves positions past each
    length as whatever the pages hold there (attention masks them anyway).
    8-bit pages are gathered as codes and scales, then dequantized into `out` (padding gets
    zero scales, hence zeros).
    """
    if key_scales is not None:
        return quant.gather_dequantized(
            lambda k, v, o, zero: gather_kv_reference(k, v, block_tables, seq_lens, pad_to, o,
                                                      zero_padding=zero),
            key_cache, value_cache, key_scales, value_scales, out, out_dtype)
    batch_size = seq_lens.shape[0]
    longest = int(seq_lens.max()) if batch_size else 0
    length = longest if pad_to is None else pad_to
    if length < longest:
        raise ValueError(f"pad_to: expected >= the longest sequence ({longest}), got {pad_to}")
    if out is None:
        shape = (batch_size, length, *key_cache.shape[2:])
        out = (key_cache.new_empty(shape), value_cache.new_empty(shape))
    if zero_padding and (
            gather_rows(key_cache, value_cache, block_tables, seq_lens, None, out, length)
            or gather_padded_by_blocks(key_cache, value_cache, block_tables, seq_lens, length,
                                       out)):
        return out
    rows, row_shape = _source_rows(block_tables, batch_size, length, key_cache.shape)
    for cache, dst in zip((key_cache, value_cache), out, strict=True):
        torch.index_select(cache.view(row_shape), 0, rows, out=dst.view(row_shape))
        if zero_padding:
            # each row's padding is one contiguous tail: a memset per sequence, not per token
            for row, start in enumerate(seq_lens.tolist()):
                if start < length:
                    dst[row, start:].zero_()
    return out


def _source_rows(block_tables: torch.Tensor, batch_size: int, length: int,
                 page_shape: torch.Size) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The rows of the pages to copy into a ``[B, length]`` output, and the row shape:
    whole blocks when `length` is a multiple of the block size, else single tokens."""
    device, block_size = block_tables.device, page_shape[1]
    seq_index = torch.arange(batch_size, device=device)[:, None]
    if length % block_size == 0:
        columns = torch.arange(length // block_size, device=device)
        rows = gather_slots(block_tables, seq_index, columns[None, :] * block_size, block_size)
        return rows.flatten() // block_size, (-1, block_size, *page_shape[2:])
    positions = torch.arange(length, device=device)
    rows = gather_slots(block_tables, seq_index, positions[None, :], block_size).flatten()
    return rows, (-1, *page_shape[2:])


if triton is not None:

    @triton.jit
    def _gather_kv_kernel(
        key_cache_ptr,        # [num_blocks, block_size, H, D]
        value_cache_ptr,      # [num_blocks, block_size, H, D], same strides
        key_out_ptr,          # padded [B, T, H, D], or packed [total_tokens, H, D]
        value_out_ptr,        # as key_out, same strides
        key_scales_ptr,       # [num_blocks, block_size, H], read when FORMAT
        value_scales_ptr,     # as key_scales, same strides
        block_tables_ptr,     # [B, max_blocks] int32
        seq_lens_ptr,         # [B] int32
        cu_seqlens_ptr,       # [B + 1] int32, read only when PACKED
        block_tables_stride,  # block_tables.stride(0)
        cache_stride_block,   # key_cache / value_cache strides, in elements
        cache_stride_offset,
        cache_stride_head,
        cache_stride_dim,
        scale_stride_block,   # key_scales / value_scales strides
        scale_stride_offset,
        scale_stride_head,
        out_stride_seq,       # padded only, 0 when PACKED
        out_stride_token,
        out_stride_head,
        out_stride_dim,
        out_len,              # padded T: rows seq_len .. T - 1 get zeros; unused when PACKED
        block_size,
        max_blocks,
        num_heads,
        head_dim,
        PACKED: tl.constexpr,   # rows cu_seqlens[b] + t of packed, else [b, t] of padded
        BLOCK_T: tl.constexpr,  # token positions per program
        BLOCK_H: tl.constexpr,  # next_power_of_2(num_heads)
        BLOCK_D: tl.constexpr,  # next_power_of_2(head_dim)
        FORMAT: tl.constexpr,   # 0 = float pages; else quant.FORMATS' code of the codes
    ):
        positions = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        seq = tl.program_id(1).to(tl.int64)
        is_token = positions < tl.load(seq_lens_ptr + seq)
        columns = positions // block_size
        # past the table reads block 0, as the reference does; such positions are padding
        blocks = tl.load(block_tables_ptr + seq * block_tables_stride + columns,
                         mask=is_token & (columns < max_blocks), other=0).to(tl.int64)
        src_rows = blocks * cache_stride_block + (positions % block_size) * cache_stride_offset
        if PACKED:
            rows = tl.load(cu_seqlens_ptr + seq).to(tl.int64) + positions
            is_row = is_token
        else:
            rows = positions.to(tl.int64)
            is_row = positions < out_len
        dst_rows = seq * out_stride_seq + rows * out_stride_token
        heads = tl.arange(0, BLOCK_H)[None, :, None]
        dims = tl.arange(0, BLOCK_D)[None, None, :]
        inner = (heads < num_heads) & (dims < head_dim)
        src = src_rows[:, None, None] + heads * cache_stride_head + dims * cache_stride_dim
        dst = dst_rows[:, None, None] + heads * out_stride_head + dims * out_stride_dim
        load_mask = is_token[:, None, None] & inner  # zeros past seq_len
        store_mask = is_row[:, None, None] & inner
        scale_src = ((blocks * scale_stride_block
                      + (positions % block_size) * scale_stride_offset)[:, None, None]
                     + heads * scale_stride_head)
        if FORMAT >= 4:  # 4-bit: two codes a byte, a scale per 16 dims (masked: zeros)
            page_rows = src_rows[:, None, None] + heads * cache_stride_head
            key = quant4.load_dequantized(key_cache_ptr, key_scales_ptr, page_rows, scale_src,
                                          dims, cache_stride_dim, load_mask, FORMAT)
            value = quant4.load_dequantized(value_cache_ptr, value_scales_ptr, page_rows,
                                            scale_src, dims, cache_stride_dim, load_mask, FORMAT)
            key = key.to(key_out_ptr.dtype.element_ty)
            value = value.to(value_out_ptr.dtype.element_ty)
        else:
            key = tl.load(key_cache_ptr + src, mask=load_mask, other=0.0)  # [T, H, D] tile
            value = tl.load(value_cache_ptr + src, mask=load_mask, other=0.0)
            if FORMAT != 0:
                scale_mask = is_token[:, None, None] & (heads < num_heads)
                key_scale = tl.load(key_scales_ptr + scale_src, mask=scale_mask, other=0.0)
                value_scale = tl.load(value_scales_ptr + scale_src, mask=scale_mask, other=0.0)
                key = quant.decode(key, FORMAT) * key_scale.to(tl.float32)
                value = quant.decode(value, FORMAT) * value_scale.to(tl.float32)
                key = key.to(key_out_ptr.dtype.element_ty)
                value = value.to(value_out_ptr.dtype.element_ty)
        tl.store(key_out_ptr + dst, key, mask=store_mask)
        tl.store(value_out_ptr + dst, value, mask=store_mask)


def launch_gather(key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   cu_seqlens: torch.Tensor | None, longest: int,
                   out: tuple[torch.Tensor, torch.Tensor],
                   scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                   ) -> None:
    """Launch `_gather_kv_kernel` into `out`: packed when `cu_seqlens` is given, else padded."""
    code = quant4.format_of(key_cache, scales[0]) or quant.format_of(key_cache)[0]
    key_scales, strides = quant.page_strides(key_cache, scales[0])
    value_scales = key_scales if scales[1] is None else scales[1]
    for name, tensor, like in (("value_cache", value_cache, key_cache),
                               ("value out", out[1], out[0]),
                               ("value_scales", value_scales, key_scales)):
        if tensor.stride() != like.stride():
            raise ValueError(f"{name}: expected strides {like.stride()}, got {tensor.stride()}")
    # the output's heads: 4-bit pages hold head_dim / 2 bytes of them
    batch_size, num_heads, head_dim = seq_lens.shape[0], *out[0].shape[-2:]
    is_packed = cu_seqlens is not None
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    padded_len = 0 if is_packed else out[0].shape[1]
    tile_len = max(longest, padded_len)
    if batch_size == 0 or tile_len == 0:
        return
    # ~4K elements (8 KiB of bf16) per tile per tensor: enough bytes in flight, small register use;
    # tiles on grid axis 0, whose limit is 2**31 - 1 (axis 1 allows only 65535)
    block_t = min(max(1, 4096 // (block_h * block_d)), triton.next_power_of_2(tile_len))
    _gather_kv_kernel[(triton.cdiv(tile_len, block_t), batch_size)](
        key_cache_ptr=quant.raw(key_cache), value_cache_ptr=quant.raw(value_cache),
        key_out_ptr=out[0], value_out_ptr=out[1],
        key_scales_ptr=quant.raw(key_scales), value_scales_ptr=quant.raw(value_scales),
        block_tables_ptr=block_tables, seq_lens_ptr=seq_lens,
        cu_seqlens_ptr=cu_seqlens if is_packed else seq_lens,
        block_tables_stride=block_tables.stride(0), **strides,
        out_stride_seq=0 if is_packed else out[0].stride(0),
        out_stride_token=out[0].stride(-3), out_stride_head=out[0].stride(-2),
        out_stride_dim=out[0].stride(-1),
        out_len=padded_len, block_size=key_cache.shape[1], max_blocks=block_tables.shape[1],
        num_heads=num_heads, head_dim=head_dim,
        PACKED=is_packed, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, FORMAT=code,
    )


def gather_kv_triton(
    key_cache: torch.Tensor,     # [num_blocks, block_size, H, D]
    value_cache: torch.Tensor,   # [num_blocks, block_size, H, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,      # [B] int32
    pad_to: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `gather_kv` (the CUDA path); same contract as the reference."""
    batch_size = seq_lens.shape[0]
    longest = int(seq_lens.max()) if batch_size else 0
    length = longest if pad_to is None else pad_to
    if length < longest:
        raise ValueError(f"pad_to: expected >= the longest sequence ({longest}), got {pad_to}")
    if out is None:
        out = new_gather_out((batch_size, length, *key_cache.shape[2:]), key_cache, key_scales,
                       out_dtype)
    launch_gather(key_cache, value_cache, block_tables, seq_lens, None, longest, out,
                   (key_scales, value_scales))
    return out


def new_gather_out(shape: tuple[int, ...], key_cache: torch.Tensor, key_scales: torch.Tensor | None,
             out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh K and V outputs: the pages' dtype, or `out_dtype` (default float32) for 8-bit
    (and 4-bit pages, whose heads are twice their bytes)."""
    if quant4.format_of(key_cache, key_scales):
        shape = (*shape[:-1], 2 * shape[-1])
    dtype = key_cache.dtype if key_scales is None else out_dtype or torch.float32
    return key_cache.new_empty(shape, dtype=dtype), key_cache.new_empty(shape, dtype=dtype)


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    pad_to: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild each sequence's contiguous K/V, zero-padded to a common length.

    Parameters
    ----------
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, H, D]``, contiguous (one layer's pages).
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32 block ids per sequence (padding entries 0).
    seq_lens : torch.Tensor
        ``[B]`` int32 tokens per sequence.
    pad_to : int, optional
        Output length ``T`` (default the longest sequence); below it is a ValueError.
    out : (torch.Tensor, torch.Tensor), optional
        Preallocated ``[B, T, H, D]`` contiguous outputs for K and V.
    key_scales, value_scales : torch.Tensor, optional
        ``[num_blocks, block_size, H]`` bfloat16 scales of 8-bit pages: the output is then
        ``codes * scale`` (dequantized).
    out_dtype : torch.dtype, optional
        dtype of fresh outputs from 8-bit pages (default float32).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        K and V ``[B, T, H, D]``, zeros at positions ``>= seq_lens[b]``.

    Examples
    --------
    >>> kc = torch.arange(8.0).view(4, 2, 1, 1); vc = -kc
    >>> k, v = gather_kv(kc, vc, torch.tensor([[3, 1]], dtype=torch.int32),
    ...                  torch.tensor([3], dtype=torch.int32), pad_to=4)
    >>> k.flatten().tolist()  # block 3 (6, 7), then block 1 offset 0 (2), then padding
    [6.0, 7.0, 2.0, 0.0]
    """
    quant.check_scales("gather_kv", key_cache, key_scales, value_scales)
    scales = quant.scale_kwargs(key_scales, value_scales, out_dtype=out_dtype)
    if use_triton(key_cache):
        return gather_kv_triton(key_cache, value_cache, block_tables, seq_lens, pad_to, out,
                                **scales)
    return gather_kv_reference(key_cache, value_cache, block_tables, seq_lens, pad_to, out,
                               **scales)
