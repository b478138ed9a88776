"""gather_kv_packed: rebuild K/V of a batch in the packed varlen form (FlashAttention's
``cu_seqlens``), over the Triton kernel and helpers of `gather` (the padded form).

Its own module beside the padded gather: the same kernel, another op (its torch path, its
Triton launch and its dispatch); gather.py had reached 293 of its 300 code lines."""

from __future__ import annotations

import torch

from . import quant
from .backend import use_triton
from .gather import gather_slots, launch_gather, new_gather_out
from .rows import gather_packed_by_blocks
from .rows_compiled import gather_rows


def gather_kv_packed_reference(
    key_cache: torch.Tensor,     # [num_blocks, block_size, H, D]
    value_cache: torch.Tensor,   # [num_blocks, block_size, H, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,      # [B] int32
    cu_seqlens: torch.Tensor,    # [B + 1] int32
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of `gather_kv_packed` (the CPU path)."""
    if key_scales is not None:
        return quant.gather_dequantized(
            lambda k, v, o, _: gather_kv_packed_reference(k, v, block_tables, seq_lens,
                                                          cu_seqlens, o),
            key_cache, value_cache, key_scales, value_scales, out, out_dtype)
    total = int(cu_seqlens[-1]) if out is None else out[0].shape[0]
    if out is None:
        shape = (total, *key_cache.shape[2:])
        out = (key_cache.new_empty(shape), value_cache.new_empty(shape))
    if gather_rows(key_cache, value_cache, block_tables, seq_lens, cu_seqlens[:-1], out) \
            or gather_packed_by_blocks(key_cache, value_cache, block_tables, seq_lens,
                                       cu_seqlens, out):
        return out
    device = key_cache.device
    seq_index = torch.repeat_interleave(
        torch.arange(seq_lens.shape[0], device=device), seq_lens.long(), output_size=total)
    positions = torch.arange(total, device=device) - cu_seqlens.long()[seq_index]
    slots = gather_slots(block_tables, seq_index, positions, key_cache.shape[1])
    for cache, dst in zip((key_cache, value_cache), out, strict=True):
        torch.index_select(cache.view(-1, *cache.shape[2:]), 0, slots, out=dst)
    return out


def gather_kv_packed_triton(
    key_cache: torch.Tensor,     # [num_blocks, block_size, H, D]
    value_cache: torch.Tensor,   # [num_blocks, block_size, H, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,      # [B] int32
    cu_seqlens: torch.Tensor,    # [B + 1] int32
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `gather_kv_packed` (the CUDA path); same contract."""
    longest = int(seq_lens.max()) if seq_lens.shape[0] else 0
    if out is None:
        out = new_gather_out((int(cu_seqlens[-1]), *key_cache.shape[2:]), key_cache, key_scales,
                             out_dtype)
    launch_gather(key_cache, value_cache, block_tables, seq_lens, cu_seqlens, longest, out,
                  (key_scales, value_scales))
    return out


def gather_kv_packed(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild K/V of a batch in the packed varlen form (FlashAttention's ``cu_seqlens``).

    Parameters
    ----------
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, H, D]``, contiguous.
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32.
    seq_lens : torch.Tensor
        ``[B]`` int32.
    cu_seqlens : torch.Tensor
        ``[B + 1]`` int32, ``cu_seqlens[b + 1] - cu_seqlens[b] == seq_lens[b]``.
    out : (torch.Tensor, torch.Tensor), optional
        Preallocated ``[total_tokens, H, D]`` outputs.
    key_scales, value_scales, out_dtype
        As for `gather_kv` (8-bit pages).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        K and V ``[total_tokens, H, D]``; sequence b is rows ``cu_seqlens[b]:cu_seqlens[b+1]``.
    """
    quant.check_scales("gather_kv_packed", key_cache, key_scales, value_scales)
    scales = quant.scale_kwargs(key_scales, value_scales, out_dtype=out_dtype)
    if use_triton(key_cache):
        return gather_kv_packed_triton(key_cache, value_cache, block_tables, seq_lens,
                                       cu_seqlens, out, **scales)
    return gather_kv_packed_reference(key_cache, value_cache, block_tables, seq_lens,
                                      cu_seqlens, out, **scales)
