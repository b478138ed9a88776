"""write_kv: scatter a step's new K/V into their slots of one layer's pages."""

from __future__ import annotations

import torch

from . import quant, quant4
from ._triton import tl, triton
from .backend import use_triton
from .rows import index_copy_rows
from .rows_compiled import scatter_rows
from .write4 import write_kv4_triton


def write_kv_reference(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    key_scales: torch.Tensor | None = None,    # [num_blocks, block_size, num_kv_heads]
    value_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads]
) -> None:
    """Torch implementation of `write_kv` (the CPU path); float pages go through one
    compiled loop a cache where numba is installed (`rows_compiled.scatter_rows`)."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if key_scales is None and all(
            scatter_rows(quant.raw(cache).view(num_slots, *cache.shape[2:]), slot_mapping,
                         quant.raw(new), skip_negative=True,
                         op_bytes=key.nbytes + value.nbytes)
            for new, cache in ((key, key_cache), (value, value_cache))):
        return  # (a V the loop declines after K ran: the torch path writes both)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    packed = quant4.format_of(key_cache, key_scales)  # 4-bit pages: codes and group scales
    for new, cache, scales in ((key, key_cache, key_scales), (value, value_cache, value_scales)):
        if scales is not None:
            new, scale = (quant4.quantize_reference(new, packed) if packed
                          else quant.quantize_reference(new, cache.dtype))
            quant.raw(scales).view(num_slots, *scales.shape[2:]).index_copy_(
                0, slot_mapping, quant.raw(scale))
        flat = quant.raw(cache).view(num_slots, *cache.shape[2:])
        index_copy_rows(flat, slot_mapping, quant.raw(new))


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        key_ptr,              # [num_tokens, num_kv_heads, head_dim]
        value_ptr,            # [num_tokens, num_kv_heads, head_dim]
        key_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache_ptr,      # [num_blocks, block_size, num_kv_heads, head_dim], same strides
        key_scales_ptr,       # [num_blocks, block_size, num_kv_heads], read when FORMAT
        value_scales_ptr,     # as key_scales, same strides
        slot_mapping_ptr,     # [num_tokens] int64, -1 = padding
        key_stride_token,     # key strides, in elements
        key_stride_head,
        key_stride_dim,
        value_stride_token,   # value strides
        value_stride_head,
        value_stride_dim,
        cache_stride_block,   # key_cache / value_cache strides
        cache_stride_offset,
        cache_stride_head,
        cache_stride_dim,
        scale_stride_block,   # key_scales / value_scales strides
        scale_stride_offset,
        scale_stride_head,
        block_size,           # tokens per block
        num_kv_heads,
        head_dim,
        BLOCK_H: tl.constexpr,  # next_power_of_2(num_kv_heads)
        BLOCK_D: tl.constexpr,  # next_power_of_2(head_dim)
        FORMAT: tl.constexpr,   # 0 = pages in the K/V dtype; else quant.FORMATS' code
        QMAX: tl.constexpr,     # largest code magnitude of FORMAT
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        # 64-bit: block * cache_stride_block passes 2**31 in large pools
        dst = ((slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_offset
               + heads * cache_stride_head + dims * cache_stride_dim)
        key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head
                      + dims * key_stride_dim, mask=mask)
        value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head
                        + dims * value_stride_dim, mask=mask)
        if FORMAT != 0:
            # padded lanes load as 0, so they never raise a head's max
            scale_dst = ((slot // block_size) * scale_stride_block
                         + (slot % block_size) * scale_stride_offset + heads * scale_stride_head)
            is_head = heads < num_kv_heads
            key_scale = quant.head_scale(key.to(tl.float32), QMAX)[:, None]
            value_scale = quant.head_scale(value.to(tl.float32), QMAX)[:, None]
            tl.store(key_scales_ptr + scale_dst, key_scale, mask=is_head)
            tl.store(value_scales_ptr + scale_dst, value_scale, mask=is_head)
            key_divisor = key_scale.to(tl.float32)
            value_divisor = value_scale.to(tl.float32)
            key_divisor = tl.where(key_divisor > 0, key_divisor, 1.0)
            value_divisor = tl.where(value_divisor > 0, value_divisor, 1.0)
            key = quant.encode(key.to(tl.float32) / key_divisor, FORMAT, QMAX)
            value = quant.encode(value.to(tl.float32) / value_divisor, FORMAT, QMAX)
        tl.store(key_cache_ptr + dst, key, mask=mask)
        tl.store(value_cache_ptr + dst, value, mask=mask)


def write_kv_triton(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    key_scales: torch.Tensor | None = None,    # [num_blocks, block_size, num_kv_heads]
    value_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads]
) -> None:
    """Triton implementation of `write_kv` (the CUDA path); same contract as the reference."""
    if quant4.format_of(key_cache, key_scales):
        return write_kv4_triton(key, value, key_cache, value_cache, slot_mapping, key_scales,
                                value_scales)
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"value_cache: expected key_cache's strides {key_cache.stride()}, "
                         f"got {value_cache.stride()}")
    if num_tokens == 0:
        return
    code, qmax = quant.format_of(key_cache)
    if key_scales is None:  # unread by the kernel; any pointer of the pages' strides will do
        key_scales = value_scales = key_cache[..., 0]
    if key_scales.stride() != value_scales.stride():
        raise ValueError(f"value_scales: expected key_scales' strides {key_scales.stride()}, "
                         f"got {value_scales.stride()}")
    # one program per token: slots scatter, and a token's heads x head_dim is one small tile
    _write_kv_kernel[(num_tokens,)](
        key_ptr=key, value_ptr=value, key_cache_ptr=quant.raw(key_cache),
        value_cache_ptr=quant.raw(value_cache), key_scales_ptr=key_scales,
        value_scales_ptr=value_scales, slot_mapping_ptr=slot_mapping,
        key_stride_token=key.stride(0), key_stride_head=key.stride(1),
        key_stride_dim=key.stride(2),
        value_stride_token=value.stride(0), value_stride_head=value.stride(1),
        value_stride_dim=value.stride(2),
        cache_stride_block=key_cache.stride(0), cache_stride_offset=key_cache.stride(1),
        cache_stride_head=key_cache.stride(2), cache_stride_dim=key_cache.stride(3),
        scale_stride_block=key_scales.stride(0), scale_stride_offset=key_scales.stride(1),
        scale_stride_head=key_scales.stride(2),
        block_size=key_cache.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FORMAT=code, QMAX=qmax,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V into the pool slots named by `slot_mapping`.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, the pool's dtype (or any float dtype when
        the pages are 8-bit).
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous (one layer's pages):
        float, or int8 / float8 codes when scales are given.
    slot_mapping : torch.Tensor
        ``[num_tokens]`` int64, ``slot = block_id * block_size + offset``; -1 skips the token.
    key_scales, value_scales : torch.Tensor, optional
        ``[num_blocks, block_size, num_kv_heads]`` bfloat16, for 8-bit pages: each written
        (token, head) gets ``max|x| / QMAX`` (see `quant`) and its codes ``x / scale``.
        With 4-bit pages (uint8 ``[..., head_dim / 2]``, two codes a byte) they are
        ``[num_blocks, block_size, num_kv_heads, head_dim / 16]``, one per group of 16 values:
        bfloat16 for int4, float8_e4m3fn for nvfp4 (see `quant4`).

    Mutates
    -------
    key_cache, value_cache (and the scales) at the named slots only.

    Examples
    --------
    >>> kc, vc = torch.zeros(4, 2, 1, 1), torch.zeros(4, 2, 1, 1)
    >>> k = torch.tensor([1.0, 2.0]).view(2, 1, 1)
    >>> write_kv(k, -k, kc, vc, torch.tensor([3, -1]))  # token 0 -> block 1 offset 1
    >>> kc.flatten().tolist()
    [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    """
    quant.check_scales("write_kv", key_cache, key_scales, value_scales)
    scales = quant.scale_kwargs(key_scales, value_scales)
    if use_triton(key):
        write_kv_triton(key, value, key_cache, value_cache, slot_mapping, **scales)
    else:
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping, **scales)
