"""latent_attention: multi-head latent attention (DeepSeek V2/V3 MLA) over latent pages.

A layer's pages hold, per token, one latent row shared by every head: the ``R =
kv_lora_rank`` values of ``kv_a_layernorm(kv_a_proj_with_mqa(x)[:R])`` followed by the ``P =
qk_rope_head_dim`` rotated rope key. The row is one tensor ``[num_blocks, block_size, R + P]``,
or split over two (``(first [.., S1], second [.., S2])``, ``S1 + S2 = R + P``): the engine
keeps a latent layer as a pool layer of one kv head whose K plane holds the row's first half
and V plane its second (`paged_kv.engine.hf_latent`), 8-bit pages with a scale per half.
Attention runs in the absorbed form: with ``kv_b_proj`` split per head into ``W_UK_h
[qk_nope, R]`` and ``W_UV_h [R, v]`` (see `absorbed_weights`),

    q_nope_h . (W_UK_h c) = (q_nope_h W_UK_h) . c = q_latent_h . c
    sum_j p_j (W_UV_h^T c_j) = W_UV_h^T (sum_j p_j c_j)

so the scores are ``(q_latent . c + q_rope . k_rope) * scale`` and the heads' K/V are never
expanded: each key is read once as ``R + P`` values for all heads, and the weighted sum of
latents (`latent_attention`'s output) goes through ``W_UV_h`` afterwards.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .backend import use_triton
from .quant import decode, dequantize_reference, format_of, raw

__all__ = ["LatentPages", "absorbed_weights", "latent_attention", "latent_attention_reference",
           "latent_attention_triton"]

# float32 scores the reference holds at once: a long prefill runs in query tiles under this
_SCORES_PER_TILE = 1 << 24
# one tensor of whole rows, or a row's two halves (a pool layer's K and V planes)
LatentPages = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


if triton is not None:

    @triton.jit
    def _row_part(first_ptr, second_ptr, first_scale_ptr, second_scale_ptr, rows, scale_rows,
                  dims, width, split, is_key, page_stride_dim, FORMAT: tl.constexpr):
        """Dims `dims` (< `width`) of the key rows, float32: those below `split` from the
        first plane, the rest from the second (dim - split), 8-bit codes times their scale."""
        in_first = dims < split
        first = tl.load(first_ptr + rows[:, None] + dims[None, :] * page_stride_dim,
                        mask=is_key[:, None] & in_first[None, :], other=0)
        second = tl.load(second_ptr + rows[:, None] + (dims - split)[None, :] * page_stride_dim,
                         mask=is_key[:, None] & (~in_first & (dims < width))[None, :], other=0)
        if FORMAT == 0:
            first = first.to(tl.float32)
            second = second.to(tl.float32)
        else:
            s1 = tl.load(first_scale_ptr + scale_rows, mask=is_key, other=0.0).to(tl.float32)
            s2 = tl.load(second_scale_ptr + scale_rows, mask=is_key, other=0.0).to(tl.float32)
            first = decode(first, FORMAT) * s1[:, None]
            second = decode(second, FORMAT) * s2[:, None]
        return tl.where(in_first[None, :], first, second)

    @triton.jit
    def _latent_attention_kernel(
        q_latent_ptr,         # [num_tokens, num_heads, R]
        q_rope_ptr,           # [num_tokens, num_heads, P]
        first_ptr,            # [num_blocks, block_size, split]: dims 0 .. split of each row
        second_ptr,           # [num_blocks, block_size, R + P - split]: the rest
        first_scale_ptr,      # [num_blocks, block_size] 8-bit scales (any pointer otherwise)
        second_scale_ptr,
        block_tables_ptr,     # [B, max_blocks] int32
        seq_lens_ptr,         # [B] int32, including this step's tokens
        query_start_loc_ptr,  # [B + 1] int32
        out_ptr,              # [num_tokens, num_heads, R]
        q_latent_stride_token,  # strides, in elements
        q_latent_stride_head,
        q_latent_stride_dim,
        q_rope_stride_token,
        q_rope_stride_head,
        q_rope_stride_dim,
        out_stride_token,
        out_stride_head,
        out_stride_dim,
        page_stride_block,    # both planes' (they are views of one pool, or of one tensor)
        page_stride_offset,
        page_stride_dim,
        scale_stride_block,
        scale_stride_offset,
        block_tables_stride,
        num_seqs,             # B
        num_heads,
        block_size,
        latent_dim,           # R
        rope_dim,             # P
        split,                # S1
        scale,                # softmax scale
        BLOCK_B: tl.constexpr,  # next_power_of_2(B), to find the token's sequence in one load
        BLOCK_H: tl.constexpr,  # heads per program, >= 16 for tl.dot
        BLOCK_N: tl.constexpr,  # keys per step
        BLOCK_R: tl.constexpr,  # next_power_of_2(R), >= 16
        BLOCK_P: tl.constexpr,  # next_power_of_2(P), >= 16
        FORMAT: tl.constexpr,   # 0 float pages, else the 8-bit format (kernels.quant)
        UPCAST_DOT: tl.constexpr,  # feed tl.dot float32 (the interpreter's bf16 dot is wrong)
    ):
        token = tl.program_id(0)
        head_block = tl.program_id(1)
        seqs = tl.arange(0, BLOCK_B)
        ends = tl.load(query_start_loc_ptr + 1 + seqs, mask=seqs < num_seqs, other=0)
        seq = tl.sum(((ends <= token) & (seqs < num_seqs)).to(tl.int32), axis=0)
        # bottom-right causal: the token's position is seq_len - (query_end - token)
        query_end = tl.load(query_start_loc_ptr + seq + 1)
        num_keys = tl.load(seq_lens_ptr + seq) - query_end + token + 1

        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        is_head = heads < num_heads
        lat = tl.arange(0, BLOCK_R)
        rope = tl.arange(0, BLOCK_P)
        is_lat = lat < latent_dim
        is_rope = rope < rope_dim
        ql_offsets = (token.to(tl.int64) * q_latent_stride_token
                      + heads[:, None] * q_latent_stride_head + lat[None, :] * q_latent_stride_dim)
        qr_offsets = (token.to(tl.int64) * q_rope_stride_token
                      + heads[:, None] * q_rope_stride_head + rope[None, :] * q_rope_stride_dim)
        q_lat = tl.load(q_latent_ptr + ql_offsets, mask=is_head[:, None] & is_lat[None, :],
                        other=0.0)  # [BLOCK_H, BLOCK_R]
        q_rot = tl.load(q_rope_ptr + qr_offsets, mask=is_head[:, None] & is_rope[None, :],
                        other=0.0)  # [BLOCK_H, BLOCK_P]
        if UPCAST_DOT:
            q_lat = q_lat.to(tl.float32)
            q_rot = q_rot.to(tl.float32)
        # tl.dot wants one dtype: the queries' (the model's, as float pages are)
        dot_type = q_lat.dtype

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max
        l_i = tl.zeros([BLOCK_H], tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
        for start in range(0, num_keys, BLOCK_N):
            positions = start + keys
            is_key = positions < num_keys
            blocks = tl.load(table_row + positions // block_size, mask=is_key, other=0)
            offsets = positions % block_size
            rows = blocks.to(tl.int64) * page_stride_block + offsets * page_stride_offset
            scale_rows = blocks.to(tl.int64) * scale_stride_block + offsets * scale_stride_offset
            # one row serves as every head's key (latent and rope part) and value (latent)
            c = _row_part(first_ptr, second_ptr, first_scale_ptr, second_scale_ptr, rows,
                          scale_rows, lat, latent_dim, split, is_key, page_stride_dim,
                          FORMAT).to(dot_type)  # [BLOCK_N, BLOCK_R]
            k_rot = _row_part(first_ptr, second_ptr, first_scale_ptr, second_scale_ptr, rows,
                              scale_rows, latent_dim + rope, latent_dim + rope_dim, split,
                              is_key, page_stride_dim, FORMAT).to(dot_type)  # [BLOCK_N, P]
            scores = (tl.dot(q_lat, tl.trans(c), input_precision="ieee")
                      + tl.dot(q_rot, tl.trans(k_rot), input_precision="ieee")) * scale
            scores = tl.where(is_key[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # p rounds to the queries' dtype, as flash attention does, so the dot runs on
            # tensor cores
            p = p.to(q_latent_ptr.dtype.element_ty).to(dot_type)
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
            m_i = m_new

        out = acc / l_i[:, None]
        out_offsets = (token.to(tl.int64) * out_stride_token
                       + heads[:, None] * out_stride_head + lat[None, :] * out_stride_dim)
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
                 mask=is_head[:, None] & is_lat[None, :])


def _planes(pages: LatentPages, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pages` as two planes of one row each: a whole-row tensor split at R (views)."""
    if isinstance(pages, torch.Tensor):
        return pages[..., :latent_dim], pages[..., latent_dim:]
    return tuple(pages)


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, pages: LatentPages,
           scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Raise ValueError unless the queries', pages' and scales' sizes agree."""
    parts = (pages,) if isinstance(pages, torch.Tensor) else tuple(pages)
    if q_latent.dim() != 3 or q_rope.dim() != 3 or len(parts) not in (1, 2) \
            or any(part.dim() != 3 for part in parts):
        raise ValueError(f"expected q_latent [T, H, R], q_rope [T, H, P], pages "
                         f"[num_blocks, block_size, R + P] or two tensors of its halves, got "
                         f"{tuple(q_latent.shape)}, {tuple(q_rope.shape)}, "
                         f"{[tuple(part.shape) for part in parts]}")
    if q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_rope: expected [T, H] = {tuple(q_latent.shape[:2])}, "
                         f"got {tuple(q_rope.shape[:2])}")
    width = q_latent.shape[2] + q_rope.shape[2]
    if sum(part.shape[2] for part in parts) != width \
            or any(part.shape[:2] != parts[0].shape[:2] for part in parts):
        raise ValueError(f"pages: expected R + P = {width} values per token, got "
                         f"{[tuple(part.shape) for part in parts]}")
    is_8bit = format_of(parts[0])[0] != 0
    if is_8bit != (scales is not None) or (is_8bit and len(parts) != 2):
        raise ValueError(f"scales: expected one [num_blocks, block_size] tensor per half with "
                         f"8-bit pages (two halves) and none with float pages, got "
                         f"{parts[0].dtype} pages and {'no' if scales is None else 'some'} "
                         f"scales")


def latent_attention_reference(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    pages: LatentPages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain-torch `latent_attention` (float32 math); same contract."""
    _check(q_latent, q_rope, pages, scales)
    num_heads, latent_dim = q_latent.shape[1:]
    planes = _planes(pages, latent_dim)
    block_size = planes[0].shape[1]
    out = q_latent.new_empty(q_latent.shape)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        first_query, end = starts[seq], starts[seq + 1]
        if end == first_query:
            continue
        positions = torch.arange(seq_len, device=q_latent.device)
        slots = (block_tables[seq, positions // block_size].long() * block_size
                 + positions % block_size)
        rows = _rows(planes, scales, slots)  # [L, R + P] float32
        latents, rope_keys = rows[:, :latent_dim], rows[:, latent_dim:]
        # query tiles bound the [tile, H, L] scores of a long prefill
        tile = max(1, _SCORES_PER_TILE // max(1, num_heads * seq_len))
        for lo in range(first_query, end, tile):
            hi = min(lo + tile, end)
            scores = (q_latent[lo:hi].float() @ latents.T
                      + q_rope[lo:hi].float() @ rope_keys.T) * scale  # [n, H, L]
            # query i sits at position seq_len - (end - i) and sees keys up to it
            query_pos = seq_len - end + torch.arange(lo, hi, device=q_latent.device)
            hidden = positions[None, :] > query_pos[:, None]  # [n, L]
            scores.masked_fill_(hidden[:, None, :], float("-inf"))
            out[lo:hi] = (scores.softmax(dim=-1) @ latents).to(out.dtype)
    return out


def _rows(planes: tuple[torch.Tensor, torch.Tensor],
          scales: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor) -> torch.Tensor:
    """The latent rows of `slots` (``[L]`` flat slot ids), float32 ``[L, R + P]``: each
    plane's part, dequantized by its own scale with 8-bit pages."""
    parts = []
    for index, plane in enumerate(planes):
        values = plane.flatten(0, 1)[slots]
        if scales is None:
            parts.append(values.float())
        else:
            parts.append(dequantize_reference(values, scales[index].flatten(0, 1)[slots],
                                              torch.empty(values.shape, device=values.device)))
    return torch.cat(parts, dim=-1)


def latent_attention_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    pages: LatentPages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton implementation of `latent_attention` (the CUDA path); same contract."""
    _check(q_latent, q_rope, pages, scales)
    num_tokens, num_heads, latent_dim = q_latent.shape
    rope_dim = q_rope.shape[2]
    first, second = _planes(pages, latent_dim)
    first_scale, second_scale = _same_strides(first, second, scales)
    out = q_latent.new_empty(q_latent.shape)
    if num_tokens == 0:
        return out
    # 16 heads share each page tile (tl.dot's minimum); more would hold a [heads, R] float32
    # accumulator too large for registers at R = 512 (DeepSeek V2/V3's kv_lora_rank)
    block_h = 16
    block_r = max(16, triton.next_power_of_2(latent_dim))
    _latent_attention_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q_latent_ptr=q_latent, q_rope_ptr=q_rope, first_ptr=raw(first), second_ptr=raw(second),
        first_scale_ptr=first_scale, second_scale_ptr=second_scale,
        block_tables_ptr=block_tables, seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc, out_ptr=out,
        **_strides("q_latent", ("token", "head", "dim"), q_latent),
        **_strides("q_rope", ("token", "head", "dim"), q_rope),
        **_strides("out", ("token", "head", "dim"), out),
        **_strides("page", ("block", "offset", "dim"), first),
        **_strides("scale", ("block", "offset"), first_scale),
        block_tables_stride=block_tables.stride(0), num_seqs=seq_lens.shape[0],
        num_heads=num_heads, block_size=first.shape[1], latent_dim=latent_dim,
        rope_dim=rope_dim, split=first.shape[2], scale=float(scale),
        BLOCK_B=triton.next_power_of_2(seq_lens.shape[0]), BLOCK_H=block_h,
        # a [BLOCK_N, R] latent tile is 32 KiB bf16 at R = 512 with 32 keys
        BLOCK_N=32 if block_r >= 512 else 64, BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope_dim)), FORMAT=format_of(first)[0],
        UPCAST_DOT=not q_latent.is_cuda,
    )
    return out


def _same_strides(first: torch.Tensor, second: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor] | None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales the kernel reads (for float pages any pointer of the scales' strides: never
    read), after checking both halves share their strides (the kernel takes one set)."""
    first_scale, second_scale = scales if scales is not None else (first[..., 0], second[..., 0])
    if first.stride() != second.stride() or first_scale.stride() != second_scale.stride():
        raise ValueError(f"pages: the two halves and their scales must share their strides "
                         f"(views of one pool or one tensor), got {first.stride()} and "
                         f"{second.stride()}")
    return first_scale, second_scale


def _strides(name: str, axes: tuple[str, ...], tensor: torch.Tensor) -> dict[str, int]:
    """``{name}_stride_{axis}`` of each of `tensor`'s dims."""
    return {f"{name}_stride_{axis}": stride
            for axis, stride in zip(axes, tensor.stride(), strict=True)}


def latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    pages: LatentPages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of a step's absorbed queries over each sequence's latent pages.

    Query ``j`` of a sequence with ``n`` new tokens sits at position ``seq_len - n + j`` and
    sees keys ``0 .. seq_len - n + j`` (bottom-right causal), so chunked prefill and decode
    are one case. Every head attends over the same latent rows (MLA is one kv head).

    Parameters
    ----------
    q_latent : torch.Tensor
        ``[T, H, R]``: ``q_nope_h @ W_UK_h`` per head (`absorbed_weights`), rows grouped by
        sequence as `query_start_loc` says.
    q_rope : torch.Tensor
        ``[T, H, P]``: the rotated rope part of each head's query, in the same dim order as
        the rope keys in `pages`.
    pages : torch.Tensor or (torch.Tensor, torch.Tensor)
        ``[num_blocks, block_size, R + P]``: one layer's pages, already written; per token the
        normed latent then the rotated rope key. Or that row in two halves, ``([num_blocks,
        block_size, S1], [num_blocks, block_size, S2])`` with ``S1 + S2 = R + P`` and the same
        strides (a pool layer's K and V planes, their one head squeezed: see
        `paged_kv.engine.hf_latent.latent_pages`).
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32.
    seq_lens : torch.Tensor
        ``[B]`` int32, cached tokens per sequence including this step's.
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 offsets of each sequence's queries.
    scale : float
        Softmax scale: the module's ``scaling`` (``qk_head_dim ** -0.5`` times the yarn
        mscale factor, not ``R ** -0.5``).
    scales : (torch.Tensor, torch.Tensor), optional
        With 8-bit halves (int8 / fp8 codes): each half's ``[num_blocks, block_size]`` scales
        (`paged_kv.kernels.quant`); None with float pages.

    Returns
    -------
    torch.Tensor
        ``[T, H, R]`` in `q_latent`'s dtype (accumulated in float32): each head's
        softmax-weighted sum of latents, to be multiplied by ``W_UV_h``.
    """
    if use_triton(q_latent):
        return latent_attention_triton(q_latent, q_rope, pages, block_tables, seq_lens,
                                       query_start_loc, scale, scales=scales)
    return latent_attention_reference(q_latent, q_rope, pages, block_tables, seq_lens,
                                      query_start_loc, scale, scales=scales)


def absorbed_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head up-projections of a DeepSeek V2/V3 attention module's ``kv_b_proj``.

    transformers views ``kv_b_proj(c)`` (``[..., H * (qk_nope + v)]``) as ``[..., H, qk_nope +
    v]`` and splits the last dim into ``k_nope`` then ``value``; so the weight ``[H * (qk_nope
    + v), R]`` reads as ``[H, qk_nope + v, R]``, rows ``:qk_nope`` of each head giving its key.
    Both results are contiguous copies in the weight's dtype (a float weight: an FP8 checkpoint's
    block-quantized ``kv_b_proj`` must be dequantized first).

    Parameters
    ----------
    module : torch.nn.Module
        A ``DeepseekV3Attention`` / ``DeepseekV2Attention`` (has ``kv_b_proj``, ``num_heads``,
        ``qk_nope_head_dim``, ``v_head_dim``, ``kv_lora_rank``).

    Returns
    -------
    w_uk : torch.Tensor
        ``[H, qk_nope_head_dim, R]``: ``q_latent_h = q_nope_h @ w_uk[h]``.
    w_uv : torch.Tensor
        ``[H, R, v_head_dim]``: head ``h``'s output is ``out_latent_h @ w_uv[h]``.
    """
    nope, v_dim = module.qk_nope_head_dim, module.v_head_dim
    weight = module.kv_b_proj.weight.detach().view(module.num_heads, nope + v_dim,
                                                   module.kv_lora_rank)
    return weight[:, :nope].contiguous(), weight[:, nope:].transpose(1, 2).contiguous()
