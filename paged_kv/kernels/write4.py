"""write_kv's Triton kernel for 4-bit pages (`quant4`): quantise each token's heads in
groups of 16, pack two codes a byte, store codes and scales in their slots."""

from __future__ import annotations

import torch

from . import quant4
from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def _write_kv4_kernel(
        key_ptr,              # [num_tokens, num_kv_heads, head_dim]
        value_ptr,            # [num_tokens, num_kv_heads, head_dim]
        key_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim / 2] uint8
        value_cache_ptr,      # as key_cache, same strides
        key_scales_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim / 16]
        value_scales_ptr,     # as key_scales, same strides, last dim contiguous
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
        BLOCK_D: tl.constexpr,  # next_power_of_2(head_dim), >= 16
        FORMAT: tl.constexpr,   # quant4.INT4 or quant4.NVFP4
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        HALF: tl.constexpr = BLOCK_D // 2
        GROUPS: tl.constexpr = BLOCK_D // 16
        heads = tl.arange(0, BLOCK_H)[:, None]
        pairs = tl.arange(0, HALF)[None, :]  # byte j holds dims 2j (low nibble) and 2j + 1
        mask = (heads < num_kv_heads) & (pairs * 2 < head_dim)
        groups = tl.arange(0, GROUPS)[None, :]
        scale_mask = (heads < num_kv_heads) & (groups * 16 < head_dim)
        block, offset = slot // block_size, slot % block_size
        dst = (block * cache_stride_block + offset * cache_stride_offset
               + heads * cache_stride_head + pairs * cache_stride_dim)
        scale_dst = (block * scale_stride_block + offset * scale_stride_offset
                     + heads * scale_stride_head + groups)
        for plane in tl.static_range(2):  # K, then V
            if plane == 0:
                src = key_ptr + token * key_stride_token + heads * key_stride_head
                stride_dim = key_stride_dim
            else:
                src = value_ptr + token * value_stride_token + heads * value_stride_head
                stride_dim = value_stride_dim
            even = tl.load(src + (2 * pairs) * stride_dim, mask=mask, other=0.0).to(tl.float32)
            odd = tl.load(src + (2 * pairs + 1) * stride_dim, mask=mask,
                          other=0.0).to(tl.float32)
            # padded lanes load as 0, so they never raise a group's max
            amax = tl.max(tl.reshape(tl.maximum(tl.abs(even), tl.abs(odd)),
                                     [BLOCK_H, GROUPS, 8]), axis=2)
            scale = quant4.group_scale(amax, FORMAT)  # [BLOCK_H, GROUPS]
            divisor = tl.where(scale > 0, scale, 1.0)
            divisor = tl.reshape(tl.broadcast_to(divisor[:, :, None], [BLOCK_H, GROUPS, 8]),
                                 [BLOCK_H, HALF])
            packed = (quant4.encode4(even / divisor, FORMAT)
                      | (quant4.encode4(odd / divisor, FORMAT) << 4)).to(tl.uint8)
            stored = quant4.stored_scale(scale, FORMAT)
            if plane == 0:
                tl.store(key_scales_ptr + scale_dst, stored, mask=scale_mask)
                tl.store(key_cache_ptr + dst, packed, mask=mask)
            else:
                tl.store(value_scales_ptr + scale_dst, stored, mask=scale_mask)
                tl.store(value_cache_ptr + dst, packed, mask=mask)


def write_kv4_triton(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim / 2] uint8
    value_cache: torch.Tensor,   # as key_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    key_scales: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim / 16]
    value_scales: torch.Tensor,  # as key_scales
) -> None:
    """The Triton `write_kv` of 4-bit pages; the same bytes as `write_kv_reference`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for name, tensor, like in (("value_cache", value_cache, key_cache),
                               ("value_scales", value_scales, key_scales)):
        if tensor.stride() != like.stride():
            raise ValueError(f"{name}: expected strides {like.stride()}, got {tensor.stride()}")
    if num_tokens == 0:
        return
    code = quant4.format_of(key_cache, key_scales)
    # one program per token: its heads x head_dim is one small tile, quantised in groups
    _write_kv4_kernel[(num_tokens,)](
        key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
        key_scales_ptr=_bits(key_scales), value_scales_ptr=_bits(value_scales),
        slot_mapping_ptr=slot_mapping,
        key_stride_token=key.stride(0), key_stride_head=key.stride(1),
        key_stride_dim=key.stride(2),
        value_stride_token=value.stride(0), value_stride_head=value.stride(1),
        value_stride_dim=value.stride(2),
        cache_stride_block=key_cache.stride(0), cache_stride_offset=key_cache.stride(1),
        cache_stride_head=key_cache.stride(2), cache_stride_dim=key_cache.stride(3),
        scale_stride_block=key_scales.stride(0), scale_stride_offset=key_scales.stride(1),
        scale_stride_head=key_scales.stride(2),
        block_size=key_cache.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), FORMAT=code,
    )


def _bits(scales: torch.Tensor) -> torch.Tensor:
    """nvfp4's float8 scales as their uint8 bits (same storage); int4's as they are."""
    return scales.view(torch.uint8) if scales.itemsize == 1 else scales
