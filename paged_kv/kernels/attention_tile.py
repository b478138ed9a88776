"""The parts both paged attention kernels run on each K/V tile (`attention`'s per-token one
and `attention_prefill`'s tiled one): reading the tile from the pages, dequantized, the
soft-cap of its scores, and the online-softmax step. Triton inlines them into each
kernel."""

from __future__ import annotations

from . import quant, quant4
from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def load_kv_tile(key_cache_ptr, value_cache_ptr, key_scales_ptr, value_scales_ptr,
                     query_ptr, blocks, positions, is_key, dims, is_dim, kv_head,
                     block_size, cache_stride_block, cache_stride_offset, cache_stride_head,
                     cache_stride_dim, scale_stride_block, scale_stride_offset,
                     scale_stride_head, FORMAT: tl.constexpr, UPCAST_DOT: tl.constexpr):
        """K and V ``[N, BLOCK_D]`` of `kv_head` at `positions` (their pages' `blocks`),
        zeros where not `is_key`: float pages as they are, 8- and 4-bit pages decoded with
        their scales into the query's dtype; float32 with `UPCAST_DOT`."""
        rows = (blocks.to(tl.int64) * cache_stride_block
                + (positions % block_size) * cache_stride_offset + kv_head * cache_stride_head)
        kv_mask = is_key[:, None] & is_dim[None, :]
        scale_rows = (blocks.to(tl.int64) * scale_stride_block
                      + (positions % block_size) * scale_stride_offset
                      + kv_head * scale_stride_head)
        if FORMAT >= 4:  # 4-bit: two codes a byte, a scale per 16 dims
            k = quant4.load_dequantized(key_cache_ptr, key_scales_ptr, rows[:, None],
                                        scale_rows[:, None], dims[None, :],
                                        cache_stride_dim, kv_mask, FORMAT)
            v = quant4.load_dequantized(value_cache_ptr, value_scales_ptr, rows[:, None],
                                        scale_rows[:, None], dims[None, :],
                                        cache_stride_dim, kv_mask, FORMAT)
            k = k.to(query_ptr.dtype.element_ty)
            v = v.to(query_ptr.dtype.element_ty)
        else:
            kv_offsets = rows[:, None] + dims[None, :] * cache_stride_dim
            k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [N, D]
            v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if FORMAT != 0:
                k_scale = tl.load(key_scales_ptr + scale_rows, mask=is_key, other=0.0)
                v_scale = tl.load(value_scales_ptr + scale_rows, mask=is_key, other=0.0)
                k = quant.decode(k, FORMAT) * k_scale.to(tl.float32)[:, None]
                v = quant.decode(v, FORMAT) * v_scale.to(tl.float32)[:, None]
                k = k.to(query_ptr.dtype.element_ty)
                v = v.to(query_ptr.dtype.element_ty)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        return k, v

    @triton.jit
    def soft_cap(scores, softcap):
        """``softcap * tanh(scores / softcap)``, tanh from exp (no tl.tanh; libdevice's is
        not in the interpreter), odd and saturating: ``(1 - e) / (1 + e)`` with
        ``e = exp(-2|x|)`` never overflows."""
        capped = scores / softcap
        e = tl.exp(-2.0 * tl.abs(capped))
        tanh = (1.0 - e) / (1.0 + e)
        return softcap * tl.where(capped < 0, -tanh, tanh)

    @triton.jit
    def online_step(m_i, l_i, acc, scores, v, value_cache_ptr, query_ptr,
                    FORMAT: tl.constexpr, UPCAST_DOT: tl.constexpr):
        """One K/V tile into the online softmax: the running max ``m_i`` and denominator
        ``l_i`` ``[R]``, and the unnormalised output ``acc`` ``[R, D]``, from the tile's
        masked ``scores`` ``[R, N]`` (-inf where not visible) and ``v`` ``[N, D]``; returns
        the three updated."""
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row may see none of this tile's keys yet (the tiled kernel's later rows of a
        # window start after its first row's keys): subtract 0 there, so exp(-inf) = 0,
        # not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p rounds to the cache dtype, as flash attention does, so the dot runs on tensor cores
        if FORMAT == 0:
            p = p.to(value_cache_ptr.dtype.element_ty)
        else:
            p = p.to(query_ptr.dtype.element_ty)
        if UPCAST_DOT:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        return m_new, l_i, acc
