"""The torch implementation of `paged_attention` (the CPU serving path), and the layer-kind
arithmetic both paths share: the checked window / chunk / sinks / soft-cap, which keys a query
sees, the block-table columns that hold them, and the explicit float32 softmax that sinks and
soft-capping need (SDPA has neither). The Triton kernel and launcher are in `attention`, which
re-exports `paged_attention_reference`.

Visibility, for a query at position ``i`` (transformers' ``sliding_window`` and
``chunked_overlay`` masks on top of the causal one):

- full: keys ``j <= i``;
- sliding window ``W``: ``i - W < j <= i`` (``W`` keys, itself included);
- chunked ``C``: ``j <= i`` and ``j // C == i // C``.

Either way what a query sees is one contiguous run ``first_visible(i) .. i``, and
``first_visible`` grows with ``i``; so a row's first query bounds every block its queries read,
and the blocks before it are never gathered (they may be the null block 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import quant4
from .attention_rows import attend_rows
from .gather import gather_kv_reference

# scores held at once by the explicit softmax: a long prefill runs in query tiles under this
_SCORES_PER_TILE = 1 << 24  # float32 elements, 64 MiB


class AttentionKind(NamedTuple):
    """`paged_attention`'s window, chunk, sinks and soft-cap, checked (see `check_kind`)."""

    window: int = 0
    chunk: int = 0
    sinks: torch.Tensor | None = None  # [num_q_heads]
    softcap: float = 0.0

    @property
    def is_local(self) -> bool:
        """Whether a query sees less than its whole past (a window or a chunk)."""
        return bool(self.window or self.chunk)

    @property
    def needs_explicit_softmax(self) -> bool:
        """Whether the softmax has a sink column or capped scores, which SDPA cannot do."""
        return self.sinks is not None or bool(self.softcap)

    def first_visible(self, query_pos: torch.Tensor) -> torch.Tensor:
        """The first key position each query at `query_pos` sees (any integer shape)."""
        first = torch.zeros_like(query_pos)
        if self.window:
            first = (query_pos - self.window + 1).clamp(min=0)
        if self.chunk:
            first = torch.maximum(first, torch.div(query_pos, self.chunk,
                                                   rounding_mode="floor") * self.chunk)
        return first


def check_kind(query: torch.Tensor, window: int, chunk: int, sinks: torch.Tensor | None,
               softcap: float) -> AttentionKind | None:
    """`AttentionKind` of `paged_attention`'s keyword arguments, or None for plain full
    attention (which then runs exactly as before); ValueError / TypeError naming a bad one."""
    for name, value in (("window", window), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0 (0 = off), got {value!r}")
    if not isinstance(softcap, int | float) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap!r}")
    if sinks is not None:
        num_q_heads = query.shape[1]
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise TypeError(f"sinks: expected a floating tensor, got {sinks!r}")
        if tuple(sinks.shape) != (num_q_heads,):
            raise ValueError(f"sinks: expected shape ({num_q_heads},) (one logit per query "
                             f"head), got {tuple(sinks.shape)}")
        if sinks.device != query.device:
            raise ValueError(f"sinks: expected the query's device {query.device}, "
                             f"got {sinks.device}")
        sinks = sinks.float().contiguous()
    if not (window or chunk or softcap) and sinks is None:
        return None
    return AttentionKind(window, chunk, sinks, float(softcap))


def visible_tables(kind: AttentionKind, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   num_queries: int, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The columns of `block_tables` the last `num_queries` positions of each row can see.

    Returns ``(tables [B, width], seq_lens [B], first_key [B])``: row b's table from the block
    of its first query's first visible key on (columns past the table read block 0), its
    length counted from there, and the position of that table's first key. A row's decode step
    thus reads ``cdiv(W, block_size) + 1`` blocks at most, however long the sequence.
    """
    first_query = (seq_lens - num_queries).long()
    first_column = torch.div(kind.first_visible(first_query), block_size, rounding_mode="floor")
    last_column = torch.div(seq_lens.long() - 1, block_size, rounding_mode="floor")
    width = max(int((last_column - first_column).max()) + 1, 1)
    columns = first_column[:, None] + torch.arange(width, device=seq_lens.device)
    inside = columns < block_tables.shape[1]
    tables = block_tables.gather(1, columns.clamp(max=block_tables.shape[1] - 1))
    tables = torch.where(inside, tables, 0).to(block_tables.dtype)
    first_key = first_column * block_size
    return tables, (seq_lens - first_key).to(seq_lens.dtype), first_key


def visible_mask(kind: AttentionKind | None, seq_lens: torch.Tensor, num_queries: int,
                 key_pos: torch.Tensor) -> torch.Tensor:
    """``(B, n, T)`` bool: query j of the last `num_queries` positions sees key `key_pos`
    (``[T]`` or ``[B, T]`` absolute positions)."""
    # bottom-right aligned: query j of n sits at position seq_len - n + j
    query_pos = (seq_lens[:, None].long() - num_queries) + torch.arange(
        num_queries, device=seq_lens.device)
    key_pos = key_pos.expand(seq_lens.shape[0], -1)[:, None, :]
    allowed = (key_pos <= query_pos[:, :, None]) & (key_pos < seq_lens[:, None, None])
    if kind is not None and kind.is_local:
        allowed &= key_pos >= kind.first_visible(query_pos)[:, :, None]
    return allowed


def explicit_attention(kind: AttentionKind, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, allowed: torch.Tensor, scale: float | None
                       ) -> torch.Tensor:
    """Float32 attention with soft-capped scores and a sink column, as transformers' eager
    Gemma 2 (cap the scaled scores, then mask) and gpt-oss (a per-head logit in the
    denominator that adds no value) compute it.

    ``query (B, Hq, n, D)``, ``key / value (B, T, Hkv, D)``, ``allowed (B, n, T)`` ->
    ``(B, Hq, n, D)`` float32. Long prefills run in query tiles so the scores stay bounded.
    """
    batch, num_q_heads, num_queries, head_dim = query.shape
    num_kv_heads = key.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    key = key.float().transpose(1, 2)[:, :, None]      # (B, Hkv, 1, T, D)
    value = value.float().transpose(1, 2)[:, :, None]  # (B, Hkv, 1, T, D)
    # query head h reads kv head h // G, as in repeat_kv
    query = query.float().reshape(batch, num_kv_heads, -1, num_queries, head_dim)
    sinks = None
    if kind.sinks is not None:
        sinks = kind.sinks.view(1, num_kv_heads, -1, 1, 1)
    tile = max(1, _SCORES_PER_TILE // max(1, batch * num_q_heads * key.shape[3]))
    out = torch.empty_like(query)
    for start in range(0, num_queries, tile):
        rows = slice(start, start + tile)
        out[:, :, :, rows] = _softmax_tile(query[:, :, :, rows], key, value,
                                           allowed[:, None, None, rows], scale, kind.softcap,
                                           sinks)
    return out.view(batch, num_q_heads, num_queries, head_dim)


def _softmax_tile(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  allowed: torch.Tensor, scale: float, softcap: float,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """``query (B, Hkv, G, n, D)`` over ``key / value (B, Hkv, 1, T, D)`` under ``allowed
    (B, 1, 1, n, T)``, with ``sinks (1, Hkv, G, 1, 1)`` -> ``(B, Hkv, G, n, D)``."""
    scores = query @ key.transpose(-1, -2) * scale  # (B, Hkv, G, n, T)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    # every query sees itself, so each row has a finite max and a denominator >= 1
    top = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks)
    weights = torch.exp(scores - top)
    denominator = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks - top)
    return (weights / denominator) @ value


def paged_attention_reference(
    query: torch.Tensor,            # [num_tokens, num_q_heads, D]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, D]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, D]
    block_tables: torch.Tensor,     # [B, max_blocks] int32
    seq_lens: torch.Tensor,         # [B] int32, after this step's tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,  # [>= 2 * B * T * Hkv * D], the query's dtype
    *,
    key_scales: torch.Tensor | None = None,    # [num_blocks, block_size, num_kv_heads]
    value_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads]
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,         # [num_q_heads]
    softcap: float = 0.0,
) -> torch.Tensor:
    """Torch implementation of `paged_attention` (the CPU path): gather, then SDPA in float32.

    Decode rows (one query each) over float pages with enough keys attend one by one on their
    own blocks (`attention_rows`); the others run as batched SDPA; rows with several queries
    (prefill chunks) run one sequence at a time, so a long chunk never pads every decode row
    to its length. 8- and 4-bit pages are dequantized by the gather. A window or chunk
    gathers only the blocks from the row's first visible key on; sinks or a soft-cap take an
    explicit float32 softmax (`explicit_attention`) instead of SDPA.
    """
    kind = check_kind(query, window, chunk, sinks, softcap)
    out = torch.empty_like(query) if out is None else out
    scales = (key_scales, value_scales)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    decode = (query_lens == 1).nonzero().flatten()
    if key_scales is None and (kind is None or not kind.needs_explicit_softmax):
        decode = attend_rows(query, key_cache, value_cache, block_tables, seq_lens,
                             query_start_loc, decode, scale, out, workspace,
                             None if kind is None else kind.first_visible)
    for rows in _length_buckets(decode, seq_lens, key_cache.shape[1]):
        starts = query_start_loc[rows].long()
        out[starts] = _attend(query[starts, :, None], key_cache, value_cache,
                              block_tables[rows], seq_lens[rows], scale,
                              workspace, scales, kind)[:, :, 0]
    for row in (query_lens > 1).nonzero().flatten().tolist():
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        attended = _attend(query[None, start:end].transpose(1, 2), key_cache, value_cache,
                           block_tables[row:row + 1], seq_lens[row:row + 1], scale, workspace,
                           scales, kind)
        out[start:end] = attended[0].transpose(0, 1)
    return out


# decode rows attend in at most this many batches, of at least _MIN_BATCH rows: a batched
# call's fixed cost against the padding a finer split saves
_MAX_BATCHES, _MIN_BATCH = 8, 16


def _length_buckets(rows: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    ) -> list[torch.Tensor]:
    """Decode `rows` sorted by length, in batches each padded only to its own longest:
    one batch padded to the longest sequence spent most of its gather and attention on
    padding when lengths vary (peers workload: decode attention 2.4 s -> 1.3 s)."""
    if not rows.numel():
        return []
    order = rows[torch.argsort(seq_lens[rows], stable=True)]
    return list(torch.split(order, max(_MIN_BATCH, -(-rows.numel() // _MAX_BATCHES))))


def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            scale: float | None, workspace: torch.Tensor | None = None,
            scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
            kind: AttentionKind | None = None,
            ) -> torch.Tensor:
    """``query (B, Hq, n, D)``, the last n positions of each sequence -> ``(B, Hq, n, D)``."""
    num_queries = query.shape[2]
    gathered_lens = seq_lens
    if kind is not None and kind.is_local:
        # only the blocks a query can see: O(window) per decode step, not O(seq_len)
        block_tables, gathered_lens, first_key = visible_tables(
            kind, block_tables, seq_lens, num_queries, key_cache.shape[1])
    k, v = _gather(key_cache, value_cache, block_tables, gathered_lens, workspace, scales,
                   query.dtype)  # (B, T, Hkv, D)
    plain = kind is None or not (kind.is_local or kind.needs_explicit_softmax)
    if plain and seq_lens.shape[0] == 1 and int(seq_lens[0]) == num_queries:
        # a whole prompt at once: plain causal attention, no mask to build or read
        return F.scaled_dot_product_attention(
            query.float(), k[:, :num_queries].float().transpose(1, 2),
            v[:, :num_queries].float().transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=True).to(query.dtype)
    key_pos = torch.arange(k.shape[1], device=query.device)
    if kind is not None and kind.is_local:
        key_pos = first_key[:, None] + key_pos  # (B, T) absolute positions
    allowed = visible_mask(kind, seq_lens, num_queries, key_pos)  # (B, n, T)
    if kind is not None and kind.needs_explicit_softmax:
        attended = explicit_attention(kind, query, k, v, allowed, scale)
    else:
        attended = F.scaled_dot_product_attention(
            query.float(), k.float().transpose(1, 2), v.float().transpose(1, 2),
            attn_mask=allowed[:, None], scale=scale, enable_gqa=True)
    return attended.to(query.dtype)


def _gather(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, workspace: torch.Tensor | None,
            scales: tuple[torch.Tensor | None, torch.Tensor | None], dtype: torch.dtype,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``(B, T, Hkv, D)`` of each row, ``T`` the longest rounded up to whole blocks
    (the gather then copies blocks, not tokens), into `workspace` when it is large enough."""
    block_size = key_cache.shape[1]
    length = -(-int(seq_lens.max()) // block_size) * block_size
    # 4-bit pages hold two values a byte: the gathered heads are twice the pages' last dim
    head_dim = key_cache.shape[3] * (2 if quant4.format_of(key_cache, scales[0]) else 1)
    shape = (seq_lens.shape[0], length, key_cache.shape[2], head_dim)
    size = shape[0] * shape[1] * shape[2] * shape[3]
    out = None
    if workspace is not None and workspace.numel() >= 2 * size:
        # reused buffers: a fresh multi-MiB output costs several times the copy in page faults
        out = (workspace[:size].view(shape), workspace[size:2 * size].view(shape))
    # padding stays unzeroed: the mask gives it zero weight, and pages hold finite values
    return gather_kv_reference(key_cache, value_cache, block_tables, seq_lens,
                               pad_to=length, out=out, zero_padding=False,
                               key_scales=scales[0], value_scales=scales[1], out_dtype=dtype)
