"""Row copies on the CPU at memory speed: the torch paths' moving parts.

torch's CPU ``index_copy_`` walks its source element by element, so it moves a row of
half-precision K/V eight times slower than a row of 16-byte elements; `wide` views rows
as the widest element that divides them (bit for bit the same bytes: nothing is
converted). ``index_select`` copies whole rows, and whole blocks (``block_size`` tokens)
run at ``copy_``'s speed where token rows do not: `gather_packed_blocks` copies each
sequence's blocks as block rows straight into its span of a packed output, its last
partial block whole too where what spills past the sequence is overwritten later, and
token by token only where it is not.
"""

from __future__ import annotations

import torch

from .rows_compiled import scatter_rows

# widest first; the 16-byte one is moved as two doubles, bit for bit (never computed on)
_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16)
# for copy_, which moves 16-byte elements slower than 8-byte ones (about 0.75x here) while
# index_copy_ moves each element alone, so wider is faster there
INTEGERS = _WIDE[1:]


def wide(rows: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _WIDE) -> torch.Tensor:
    """`rows` (``[N, ...]``, each row contiguous) as ``[N, W]`` of the widest element of
    `dtypes` dividing a row's bytes and the view's offset, or as they are when none does."""
    if rows.numel() == 0 or rows.dim() == 0:
        return rows
    flat = rows.reshape(rows.shape[0], -1)
    if flat.stride(-1) != 1 or (flat.shape[0] > 1 and flat.stride(0) != flat.shape[1]):
        return rows
    nbytes, offset = flat.shape[1] * flat.element_size(), flat.storage_offset() * \
        flat.element_size()
    for dtype in dtypes:
        size = dtype.itemsize
        if size > flat.element_size() and nbytes % size == 0 and offset % size == 0:
            return flat.view(torch.uint8).view(dtype)
    return rows


def index_copy_rows(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """``target.index_copy_(0, index, source)`` through `wide` views of both (the same
    bytes land in the same rows), or in a compiled loop (`rows_compiled.scatter_rows`)."""
    if scatter_rows(target, index, source):
        return
    wide_target, wide_source = wide(target), wide(source)
    if wide_target.dtype == wide_source.dtype and wide_target.dtype != target.dtype:
        wide_target.index_copy_(0, index, wide_source)
    else:
        target.index_copy_(0, index, source)


def gather_packed_blocks(caches: tuple[torch.Tensor, ...], block_tables: torch.Tensor,
                         seq_lens: list[int], starts: list[int],
                         outs: tuple[torch.Tensor, ...]) -> None:
    """Copy each sequence's tokens from the pages into its span of a packed output, for
    each (cache, out) pair (K and V share the block ids).

    A sequence's blocks move as block rows, its last partial one whole as well: the rows
    past its length land in the spans of the sequences after it, which are copied later and
    overwrite them (one call a sequence instead of two, and no token rows). Only where that
    spill would pass the output's end (the last sequences), or spans are out of order, is
    the partial block copied token by token.

    Parameters
    ----------
    caches : tuple of torch.Tensor
        ``[num_blocks, block_size, H, D]`` pages.
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32 (every length within its row's blocks).
    seq_lens, starts : list of int
        ``[B]`` each sequence's length and first row in each out; spans in order and
        disjoint for the spill to be taken.
    outs : tuple of torch.Tensor
        ``[total_rows, H, D]`` contiguous, one per cache.
    """
    block_size, num_rows = caches[0].shape[1], outs[0].shape[0]
    ids = block_tables.long()
    ordered = all(a + n <= b for a, n, b in zip(starts, seq_lens, starts[1:], strict=False))
    # views made once: a few µs each, against a sequence's copy of tens of µs
    pairs = [(cache.view(cache.shape[0], -1), out.view(num_rows, -1))
             for cache, out in zip(caches, outs, strict=True)]
    for b, (length, start) in enumerate(zip(seq_lens, starts, strict=True)):
        whole = -(-length // block_size)
        if not ordered or start + whole * block_size > num_rows:
            whole = length // block_size
        if whole:
            table = ids[b, :whole]
            for blocks, rows in pairs:
                torch.index_select(blocks, 0, table,
                                   out=rows[start:start + whole * block_size].view(whole, -1))
        if length > whole * block_size:
            _copy_tail(caches, ids[b, whole], length - whole * block_size, pairs,
                       start + whole * block_size)


def _copy_tail(caches: tuple[torch.Tensor, ...], block: torch.Tensor, tail: int,
               pairs: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
    """``rows[start:start + tail]`` <- the first `tail` tokens of `block`, token by token."""
    block_size = caches[0].shape[1]
    slots = block * block_size + torch.arange(tail, device=block.device)
    for cache, (_, rows) in zip(caches, pairs, strict=True):
        torch.index_select(cache.view(-1, rows.shape[1]), 0, slots,
                           out=rows[start:start + tail])


def gather_packed_by_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor],
                            ) -> bool:
    """`gather_packed_blocks` of K and V into `out` when it pays: sequences of two blocks
    or more on average (the loop over sequences costs less than the token rows it saves),
    contiguous outputs, every length within its table; returns whether it ran."""
    lens, block_size = seq_lens.tolist(), key_cache.shape[1]
    if not lens or sum(lens) < 2 * block_size * len(lens) \
            or not all(o.is_contiguous() for o in out) \
            or max(lens) > block_tables.shape[1] * block_size:
        return False
    gather_packed_blocks((key_cache, value_cache), block_tables, lens,
                         cu_seqlens[:-1].tolist(), out)
    return True


# a sequence's own copy calls cost about as much as moving this many bytes: the padded gather
# goes sequence by sequence when the padding it then skips outweighs them
_SEQ_CALL_BYTES = 64 << 10


def gather_padded_by_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, length: int,
                            out: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Gather K and V into zero-padded ``[B, T = length, H, D]`` `out` sequence by sequence
    when it pays; returns whether it ran.

    Each row's tokens go in as `gather_packed_blocks` copies them (full blocks as block
    rows), then its padding is zeroed: the padding is never copied from the pages only to be
    overwritten. It pays when that padding outweighs the calls per sequence, or when ``T``
    is not a multiple of the block size (the one-call gather then copies token rows) and
    sequences hold two blocks or more on average. Needs contiguous outputs and every length
    within its table.
    """
    lens, block_size = seq_lens.tolist(), key_cache.shape[1]
    batch_size = len(lens)
    if not lens or not length or not all(o.is_contiguous() and o.shape[:2] == (batch_size, length)
                           for o in out) \
            or max(lens) > block_tables.shape[1] * block_size:
        return False
    token_bytes = out[0][0, 0].numel() * out[0].element_size()
    padding = (batch_size * length - sum(lens)) * token_bytes
    by_tokens = length % block_size != 0 and sum(lens) >= 2 * block_size * batch_size
    if not by_tokens and padding < batch_size * _SEQ_CALL_BYTES:
        return False
    starts = [row * length for row in range(batch_size)]
    gather_packed_blocks((key_cache, value_cache), block_tables, lens, starts,
                         tuple(dst.view(-1, *dst.shape[2:]) for dst in out))
    for dst in out:
        for row, end in enumerate(lens):  # each padding is one contiguous tail: one memset
            if end < length:
                dst[row, end:].zero_()
    return True
