"""copy_blocks (copy-on-write inside one pool) and swap_blocks (between device and host pools)."""

from __future__ import annotations

import numpy as np
import torch

from ._triton import tl, triton
from .backend import use_triton
from .rows import INTEGERS, index_copy_rows, wide
from .rows_compiled import copy_blocks_compiled

_CHUNK_BYTES = 2 << 20


def copy_blocks_reference(
    kv_cache: torch.Tensor,       # [num_layers, 2, num_blocks, block_size, H, D]
    src_block_ids: torch.Tensor,  # [num_copies] int64
    dst_block_ids: torch.Tensor,  # [num_copies] int64, disjoint from src
) -> None:
    """Torch implementation of `copy_blocks` (the CPU path): one compiled loop where numba is
    installed (`rows_compiled.copy_blocks_compiled`), else torch or numpy copies by runs of
    consecutive ids, or rows."""
    if src_block_ids.numel() == 0 or copy_blocks_compiled(kv_cache, src_block_ids,
                                                          dst_block_ids):
        return
    runs = _runs(src_block_ids, dst_block_ids)
    _check_runs(kv_cache.shape[2], runs)
    if len(runs) <= _MAX_SHORT_RUNS or 2 * len(runs) <= len(src_block_ids):
        _copy_runs(kv_cache, runs)
    elif _by_slices(kv_cache, runs):
        _copy_slices(kv_cache, runs)
    else:
        _copy_rows(kv_cache, src_block_ids, dst_block_ids)


def _copy_rows(kv_cache: torch.Tensor, src_block_ids: torch.Tensor,
               dst_block_ids: torch.Tensor) -> None:
    """Copy one row per (layer, K/V, block), whole blocks as contiguous rows, in two passes
    through a small reused buffer (a pool-sized temporary costs more in page faults than the
    copy itself)."""
    num_planes, num_blocks = kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2]
    rows = kv_cache.view(num_planes * num_blocks, -1)
    planes = torch.arange(num_planes, device=kv_cache.device)[:, None] * num_blocks
    src_rows = (planes + src_block_ids[None, :]).flatten()
    dst_rows = (planes + dst_block_ids[None, :]).flatten()
    chunk = max(1, _CHUNK_BYTES // (rows.shape[1] * rows.element_size()))
    buffer = rows.new_empty(min(chunk, src_rows.numel()), rows.shape[1])
    for start in range(0, src_rows.numel(), chunk):
        part = buffer[: min(chunk, src_rows.numel() - start)]
        torch.index_select(rows, 0, src_rows[start:start + chunk], out=part)
        index_copy_rows(rows, dst_rows[start:start + chunk], part)


# runs of consecutive blocks are copied one slice each (every layer, K and V in one copy_)
# when there are at most this many, or on average two blocks or more a run: a slice copy
# costs a few µs of dispatch, where the row path moves every block twice (select, then
# scatter out of a buffer)
_MAX_SHORT_RUNS = 16
# many short runs on the CPU go one numpy copy of bytes per (plane, run) instead, ~0.7 µs a
# call against the row path's two passes, when the calls move this many bytes each on
# average: a scattered 32 KiB block moved once there beats the row path (~1.4x), where a few
# hundred bytes a call would cost more in calls than the row path's per-row walk. Few runs
# stay torch's: one call a run covers every plane (a 32-layer pool: 64 numpy calls a run)
_SLICE_BYTES = 16 << 10


def _runs(src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor,
          ) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` of each run in which both ids step by one (block
    ids are often consecutive: fresh blocks come off the free list in order)."""
    # in numpy: a few µs, where the same in torch ops costs more than a short copy itself
    src, dst = src_block_ids.cpu().numpy(), dst_block_ids.cpu().numpy()
    breaks = (np.flatnonzero((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)) + 1
              ).tolist()
    starts, ends = [0, *breaks], [*breaks, len(src)]
    return list(zip(src[starts].tolist(), dst[starts].tolist(),
                    [end - start for start, end in zip(starts, ends, strict=True)],
                    strict=True))


def _by_slices(kv_cache: torch.Tensor, runs: list[tuple[int, int, int]]) -> bool:
    """Whether `_copy_slices` takes these runs: a contiguous CPU pool (numpy reads its
    memory) and enough bytes a call."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return False
    block_bytes = kv_cache.stride(2) * kv_cache.element_size()
    num_blocks = sum(length for _, _, length in runs)
    return num_blocks * block_bytes >= _SLICE_BYTES * len(runs)


def _check_runs(num_blocks: int, runs: list[tuple[int, int, int]]) -> None:
    """Raise IndexError for a run past the pool (slices would clamp or wrap and copy part of
    the rest) before anything is copied."""
    for src, dst, length in runs:
        if min(src, dst) < 0 or max(src, dst) + length > num_blocks:
            raise IndexError(f"copy_blocks: block ids must lie in [0, {num_blocks}), got a "
                             f"run of {length} from {src} to {dst}")


def _copy_slices(kv_cache: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """Copy each run of blocks as one slice of bytes of each (layer, K/V) plane, in numpy:
    a one-dimensional copy is one memmove there (bit for bit), with no overlap check (src
    and dst blocks are disjoint) and a small fraction of a torch call's dispatch."""
    num_planes, num_blocks = kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2]
    _check_runs(num_blocks, runs)
    data = kv_cache.view(torch.uint8).view(-1).numpy()
    block_bytes = data.size // (num_planes * num_blocks)
    spans = [(src * block_bytes, dst * block_bytes, length * block_bytes)
             for src, dst, length in runs]
    for plane in range(0, data.size, num_blocks * block_bytes):
        for src, dst, length in spans:
            data[plane + dst:plane + dst + length] = data[plane + src:plane + src + length]


def _copy_runs(kv_cache: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """Copy each run of blocks as one slice of every (layer, K/V) plane, bit for bit (the
    planes viewed as integers, never computed on)."""
    num_planes, num_blocks = kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2]
    planes = wide(kv_cache.view(num_planes * num_blocks, -1), INTEGERS)
    planes = planes.view(num_planes, num_blocks, -1)
    for src, dst, length in runs:
        planes[:, dst:dst + length].copy_(planes[:, src:src + length])


if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(
        kv_cache_ptr,        # [num_layers, 2, num_blocks, block_size, H, D], blocks contiguous
        src_block_ids_ptr,   # [num_copies] int64
        dst_block_ids_ptr,   # [num_copies] int64
        cache_stride_layer,  # kv_cache strides, in elements
        cache_stride_kv,
        cache_stride_block,
        block_numel,         # block_size * H * D
        BLOCK: tl.constexpr,  # elements per program
    ):
        pair = tl.program_id(0)
        layer_kv = tl.program_id(1)  # layer * 2 + (0 for K, 1 for V)
        offsets = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < block_numel
        base = ((layer_kv // 2).to(tl.int64) * cache_stride_layer
                + (layer_kv % 2).to(tl.int64) * cache_stride_kv)
        src = tl.load(src_block_ids_ptr + pair).to(tl.int64) * cache_stride_block
        dst = tl.load(dst_block_ids_ptr + pair).to(tl.int64) * cache_stride_block
        data = tl.load(kv_cache_ptr + base + src + offsets, mask=mask)
        tl.store(kv_cache_ptr + base + dst + offsets, data, mask=mask)


def copy_blocks_triton(
    kv_cache: torch.Tensor,       # [num_layers, 2, num_blocks, block_size, H, D]
    src_block_ids: torch.Tensor,  # [num_copies] int64
    dst_block_ids: torch.Tensor,  # [num_copies] int64, disjoint from src
) -> None:
    """Triton implementation of `copy_blocks` (the CUDA path); same contract as the reference."""
    num_layers, _, _, block_size, num_heads, head_dim = kv_cache.shape
    if kv_cache.stride()[3:] != (num_heads * head_dim, head_dim, 1):
        raise ValueError("kv_cache: expected each block contiguous (strides "
                         f"{(num_heads * head_dim, head_dim, 1)} in the last three dims), "
                         f"got {kv_cache.stride()[3:]}; pass the pool itself, not a view")
    num_copies = src_block_ids.shape[0]
    block_numel = block_size * num_heads * head_dim
    if num_copies == 0:
        return
    # a block is one contiguous run; 4K-element chunks keep many programs in flight per block
    chunk = min(4096, triton.next_power_of_2(block_numel))
    _copy_blocks_kernel[(num_copies, num_layers * 2, triton.cdiv(block_numel, chunk))](
        kv_cache_ptr=kv_cache, src_block_ids_ptr=src_block_ids, dst_block_ids_ptr=dst_block_ids,
        cache_stride_layer=kv_cache.stride(0), cache_stride_kv=kv_cache.stride(1),
        cache_stride_block=kv_cache.stride(2), block_numel=block_numel, BLOCK=chunk,
    )


def copy_blocks(kv_cache: torch.Tensor, src_block_ids: torch.Tensor,
                dst_block_ids: torch.Tensor) -> None:
    """Copy whole blocks, every layer, K and V: ``block dst[i] <- block src[i]``.

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_layers, 2, num_blocks, block_size, H, D]``, the pool.
    src_block_ids, dst_block_ids : torch.Tensor
        ``[num_copies]`` int64 on the pool's device; no dst appears twice or among the srcs.

    Mutates
    -------
    kv_cache at the dst blocks only.

    Examples
    --------
    >>> pool = torch.arange(8.0).view(1, 2, 4, 1, 1, 1)
    >>> copy_blocks(pool, torch.tensor([1]), torch.tensor([3]))
    >>> pool[0, 0].flatten().tolist()
    [0.0, 1.0, 2.0, 1.0]
    """
    if src_block_ids.numel() == 0:
        return
    if use_triton(kv_cache):
        copy_blocks_triton(kv_cache, src_block_ids, dst_block_ids)
    else:
        copy_blocks_reference(kv_cache, src_block_ids, dst_block_ids)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
    """Copy blocks between two pools of the same block shape (device <-> host), batched.

    Parameters
    ----------
    src_cache, dst_cache : torch.Tensor
        ``[num_layers, 2, num_blocks_*, block_size, H, D]``; may live on different devices.
    src_block_ids, dst_block_ids : torch.Tensor
        ``[num_blocks]`` int64 block ids in each pool.

    Mutates
    -------
    dst_cache at `dst_block_ids` only.
    """
    if src_block_ids.numel() == 0:
        return
    moved = src_cache.index_select(2, src_block_ids.to(src_cache.device))
    # device -> host must block: the CPU index_copy_ below would read a copy still in flight
    to_host = dst_cache.device.type == "cpu"
    dst_cache.index_copy_(2, dst_block_ids.to(dst_cache.device),
                          moved.to(dst_cache.device, non_blocking=not to_host))
