"""paged_attention: causal attention of a step's queries over each sequence's cached K/V."""

from __future__ import annotations

import torch

from . import attention_prefill, attention_tile, quant, quant4
from ._triton import tl, triton
from .attention_reference import AttentionKind, check_kind, paged_attention_reference
from .backend import use_triton

__all__ = ["attention_kind", "paged_attention", "paged_attention_reference",
           "paged_attention_triton"]


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        query_ptr,            # [num_tokens, num_q_heads, D]
        key_cache_ptr,        # [num_blocks, block_size, num_kv_heads, D]
        value_cache_ptr,      # [num_blocks, block_size, num_kv_heads, D], same strides
        key_scales_ptr,       # [num_blocks, block_size, num_kv_heads], read when FORMAT
        value_scales_ptr,     # as key_scales, same strides
        sinks_ptr,            # [num_q_heads] float32, read when HAS_SINKS
        block_tables_ptr,     # [B, max_blocks] int32
        seq_lens_ptr,         # [B] int32, including this step's tokens
        query_start_loc_ptr,  # [B + 1] int32
        out_ptr,              # [num_tokens, num_q_heads, D]
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
        num_seqs,             # B
        block_size,
        group_size,           # num_q_heads // num_kv_heads
        head_dim,
        scale,                # softmax scale
        window,               # sliding window W, read when LOCAL (2**30 when off)
        chunk,                # chunk size C, read when LOCAL (2**30 when off)
        softcap,              # scores -> softcap * tanh(scores / softcap), read when SOFTCAP
        BLOCK_B: tl.constexpr,  # next_power_of_2(B), to find the token's sequence in one load
        BLOCK_G: tl.constexpr,  # query heads of one kv head, padded to >= 16 for tl.dot
        BLOCK_N: tl.constexpr,  # keys per step
        BLOCK_D: tl.constexpr,  # next_power_of_2(D), >= 16 for tl.dot
        UPCAST_DOT: tl.constexpr,  # feed tl.dot float32 (the interpreter's bf16 dot is wrong)
        FORMAT: tl.constexpr,   # 0 = float pages; else quant.FORMATS' (or quant4's) code
        LOCAL: tl.constexpr,    # a window or chunk: keys start at the first visible one
        HAS_SINKS: tl.constexpr,  # a per-head sink logit in the softmax denominator
        SOFTCAP: tl.constexpr,  # soft-cap the scaled scores
    ):
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        seqs = tl.arange(0, BLOCK_B)
        ends = tl.load(query_start_loc_ptr + 1 + seqs, mask=seqs < num_seqs, other=0)
        seq = tl.sum(((ends <= token) & (seqs < num_seqs)).to(tl.int32), axis=0)
        # bottom-right causal: position seq_len - n + j = seq_len - (query_end - token)
        query_end = tl.load(query_start_loc_ptr + seq + 1)
        num_keys = tl.load(seq_lens_ptr + seq) - query_end + token + 1
        # what a query sees is one run first .. num_keys - 1: the loop starts there, so blocks
        # wholly before it (the null block, once given back) are never read
        first = 0
        if LOCAL:
            query_pos = num_keys - 1
            first = tl.maximum(query_pos - window + 1, 0)
            first = tl.maximum(first, query_pos // chunk * chunk)

        heads = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        is_dim = dims < head_dim
        q_mask = (heads < group_size)[:, None] & is_dim[None, :]
        q_offsets = (token.to(tl.int64) * query_stride_token
                     + (kv_head * group_size + heads)[:, None] * query_stride_head
                     + dims[None, :] * query_stride_dim)
        q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
        # tl.dot wants one dtype: the pages', or the query's when the pages are codes
        if FORMAT == 0:
            q = q.to(key_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            q = q.to(tl.float32)

        if HAS_SINKS:
            # the sink is a key column of logit `sink` and no value: start the running max at
            # it with exp(sink - sink) = 1 in the denominator (padding heads read 0, unstored)
            m_i = tl.load(sinks_ptr + kv_head * group_size + heads, mask=heads < group_size,
                          other=0.0).to(tl.float32)
            l_i = tl.full([BLOCK_G], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max
            l_i = tl.zeros([BLOCK_G], tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
        for start in range(first, num_keys, BLOCK_N):
            positions = start + keys
            is_key = positions < num_keys
            blocks = tl.load(table_row + positions // block_size, mask=is_key, other=0)
            k, v = attention_tile.load_kv_tile(
                key_cache_ptr, value_cache_ptr, key_scales_ptr, value_scales_ptr, query_ptr,
                blocks, positions, is_key, dims, is_dim, kv_head, block_size,
                cache_stride_block, cache_stride_offset, cache_stride_head, cache_stride_dim,
                scale_stride_block, scale_stride_offset, scale_stride_head, FORMAT, UPCAST_DOT)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
            if SOFTCAP:
                scores = attention_tile.soft_cap(scores, softcap)
            # every step holds a key every row sees: the online step's guard never fires
            scores = tl.where(is_key[None, :], scores, float("-inf"))
            m_i, l_i, acc = attention_tile.online_step(m_i, l_i, acc, scores, v,
                                                       value_cache_ptr, query_ptr, FORMAT,
                                                       UPCAST_DOT)

        out = acc / l_i[:, None]
        out_offsets = (token.to(tl.int64) * out_stride_token
                       + (kv_head * group_size + heads)[:, None] * out_stride_head
                       + dims[None, :] * out_stride_dim)
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _token_strides(name: str, tensor: torch.Tensor) -> dict[str, int]:
    """``{name}_stride_token / _head / _dim`` of a ``[tokens, heads, D]`` tensor."""
    return dict(zip((f"{name}_stride_token", f"{name}_stride_head", f"{name}_stride_dim"),
                    tensor.stride(), strict=True))


def _check_launch(num_q_heads: int, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query: expected num_q_heads divisible by num_kv_heads "
                         f"({num_kv_heads}), got {num_q_heads}")
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"value_cache: expected key_cache's strides {key_cache.stride()}, "
                         f"got {value_cache.stride()}")


def paged_attention_triton(
    query: torch.Tensor,            # [num_tokens, num_q_heads, D]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, D]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, D]
    block_tables: torch.Tensor,     # [B, max_blocks] int32
    seq_lens: torch.Tensor,         # [B] int32, after this step's tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    key_scales: torch.Tensor | None = None,    # [num_blocks, block_size, num_kv_heads]
    value_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads]
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,         # [num_q_heads]
    softcap: float = 0.0,
) -> torch.Tensor:
    """Triton implementation of `paged_attention` (the CUDA path); same contract."""
    num_tokens, head_dim = query.shape[0], query.shape[2]
    _check_launch(query.shape[1], key_cache, value_cache)
    kind = check_kind(query, window, chunk, sinks, softcap)
    out = query.new_empty(query.shape) if out is None else out
    if num_tokens == 0:
        return out
    args = dict(
        query_ptr=query, **_page_args(key_cache, value_cache, key_scales, value_scales),
        block_tables_ptr=block_tables, seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc, out_ptr=out,
        **_token_strides("query", query), **_token_strides("out", out),
        block_tables_stride=block_tables.stride(0),
        scale=head_dim ** -0.5 if scale is None else scale,
        **_shape_args(query, key_cache, key_scales, seq_lens),
        **_kind_args(kind, query),
    )
    _launch(args, query, key_cache, block_tables, seq_lens, query_start_loc)
    return out


def _launch(args: dict, query: torch.Tensor, key_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor) -> None:
    """Run the kernel that suits the batch with the per-token kernel's arguments `args`."""
    num_tokens, num_seqs, num_kv_heads = query.shape[0], seq_lens.shape[0], key_cache.shape[2]
    # a prefill chunk's queries share K/V tiles; a few long decode rows split their keys
    num_splits = attention_prefill.decode_splits(
        num_tokens, num_seqs, num_kv_heads, block_tables.shape[1] * key_cache.shape[1],
        query.device)
    if num_tokens > num_seqs or num_splits > 1:
        attention_prefill.launch_tiled(args, query_start_loc, num_tokens, num_kv_heads,
                                       num_splits)
    else:
        # a query a sequence (decode; or fewer, when rows are empty): a program per (token,
        # kv head), so the kv head's query heads share each K/V tile
        _paged_attention_kernel[(num_tokens, num_kv_heads)](**args)


def _page_args(key_cache: torch.Tensor, value_cache: torch.Tensor,
               key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> dict:
    """The kernels' page and scale pointers (fp8 as bytes) and their strides."""
    scales, strides = quant.page_strides(key_cache, key_scales)
    return dict(key_cache_ptr=quant.raw(key_cache), value_cache_ptr=quant.raw(value_cache),
                key_scales_ptr=quant.raw(scales),
                value_scales_ptr=quant.raw(scales if value_scales is None else value_scales),
                **strides)


def _shape_args(query: torch.Tensor, key_cache: torch.Tensor, key_scales: torch.Tensor | None,
                seq_lens: torch.Tensor) -> dict:
    """The kernel's sizes and tile shapes for these tensors (FORMAT: quant4's code for 4-bit
    pages, else quant's)."""
    num_q_heads, head_dim = query.shape[1:]
    group_size = num_q_heads // key_cache.shape[2]
    # 64 keys per step spans blocks of any size and keeps a [64, D] tile (16 KiB bf16 at
    # D=128) in flight
    return dict(num_seqs=seq_lens.shape[0], block_size=key_cache.shape[1],
                group_size=group_size, head_dim=head_dim,
                BLOCK_B=triton.next_power_of_2(seq_lens.shape[0]),
                BLOCK_G=max(16, triton.next_power_of_2(group_size)), BLOCK_N=64,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), UPCAST_DOT=not query.is_cuda,
                FORMAT=quant4.format_of(key_cache, key_scales) or quant.format_of(key_cache)[0])


# stands for "off" in the kernel's window / chunk: no position reaches it, so the first
# visible key it gives is 0
_UNBOUNDED = 1 << 30


def _kind_args(kind: AttentionKind | None, query: torch.Tensor) -> dict:
    """The kernel's layer-kind arguments; all flags off (today's kernel) for full attention."""
    kind = kind or AttentionKind()
    return dict(sinks_ptr=query if kind.sinks is None else kind.sinks,
                window=kind.window or _UNBOUNDED, chunk=kind.chunk or _UNBOUNDED,
                softcap=kind.softcap or 1.0, LOCAL=kind.is_local,
                HAS_SINKS=kind.sinks is not None, SOFTCAP=bool(kind.softcap))


def attention_kind(config, layer: int, sinks: torch.Tensor | None = None,
                   softcap: float = 0.0) -> dict:
    """Keyword arguments of `paged_attention` for `layer` of a `CacheConfig` and the
    model's sinks / soft-cap: none for a plain full-attention layer, so its call is as
    before."""
    kind = config.kind_of(layer)
    extra = {}
    if kind.window:
        extra["window"] = kind.window
    if kind.chunk:
        extra["chunk"] = kind.chunk
    if sinks is not None:
        extra["sinks"] = sinks
    if softcap:
        extra["softcap"] = float(softcap)
    return extra


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    *,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of each new token over its sequence's cached K/V, read through the page table.

    Query j of a sequence with ``n`` new tokens sits at position ``seq_len - n + j`` and sees
    keys ``0 .. seq_len - n + j`` (bottom-right causal), so chunked prefill and single-token
    decode are one case. Grouped-query: ``num_q_heads % num_kv_heads == 0``. A sliding
    `window` or a `chunk` narrows what each query sees; `sinks` and `softcap` change the
    softmax (gpt-oss, Gemma 2). With none of the four the call is plain causal attention.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_q_heads, D]``, rows grouped by sequence as `query_start_loc` says.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, D]`` (one layer's pages, already written).
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32.
    seq_lens : torch.Tensor
        ``[B]`` int32, cached tokens per sequence including this step's.
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 offsets of each sequence's queries.
    scale : float, optional
        Softmax scale, default ``D ** -0.5``.
    out : torch.Tensor, optional
        ``[num_tokens, num_q_heads, D]`` output buffer.

    workspace : torch.Tensor, optional
        1-D scratch of the query's dtype the torch path gathers K/V into when it holds
        ``2 * B * T * num_kv_heads * D`` elements (``T`` rounded up to whole blocks);
        ignored by the Triton kernel, which reads the pages in place.
    key_scales, value_scales : torch.Tensor, optional
        ``[num_blocks, block_size, num_kv_heads]`` bfloat16 scales of 8-bit pages, which are
        then dequantized as they are read (in the kernel's inner loop); with 4-bit pages
        (uint8 ``[..., D / 2]``) ``[..., num_kv_heads, D / 16]`` bfloat16 (int4) or
        float8_e4m3fn (nvfp4), as `write_kv` takes them.
    window : int, optional
        Sliding window ``W`` (0, the default: off). The query at position ``i`` sees keys
        ``i - W < j <= i`` (``W`` keys, itself included; transformers' ``sliding_window``).
        Only the blocks from the one holding ``seq_len - n + 1 - W`` on are read, so block
        table entries wholly before a row's window may be anything, e.g. the null block 0.
    chunk : int, optional
        Chunked local attention of ``C`` tokens (0: off): the query at ``i`` sees keys
        ``j <= i`` with ``j // C == i // C`` (Llama 4). Blocks before the chunk of the row's
        first query are not read. With `window` too a key must pass both.
    sinks : torch.Tensor, optional
        ``[num_q_heads]`` floating: a learned logit per query head that joins its softmax
        denominator (adds ``exp(sink)``) and contributes no value, so a head may attend to
        nothing (gpt-oss).
    softcap : float, optional
        Logit soft-cap (0: off): the scaled scores ``s`` become ``softcap * tanh(s / softcap)``
        before the mask (Gemma 2). The sinks are not capped.

    Returns
    -------
    torch.Tensor
        ``[num_tokens, num_q_heads, D]`` in the query's dtype (accumulated in float32).
    """
    quant.check_scales("paged_attention", key_cache, key_scales, value_scales)
    scales = quant.scale_kwargs(key_scales, value_scales)
    # only the set ones are passed on, so a full-attention call is exactly today's
    kind = {name: value for name, value in (("window", window), ("chunk", chunk),
                                            ("softcap", softcap)) if value}
    if sinks is not None:
        kind["sinks"] = sinks
    if use_triton(query):
        return paged_attention_triton(query, key_cache, value_cache, block_tables, seq_lens,
                                      query_start_loc, scale, out, **scales, **kind)
    return paged_attention_reference(query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, scale, out, workspace, **scales, **kind)
