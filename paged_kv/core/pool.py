"""`KVPool`: the one preallocated K/V buffer, and an optional host pool for swapped-out blocks."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..config import CacheConfig
from ..kernels import copy_blocks, swap_blocks
from ..kernels.quant import raw

logger = logging.getLogger(__name__)


# kinds of pool operation in the log `KVPool.record_ops` keeps
OP_COPY, OP_SWAP_OUT, OP_SWAP_IN = 1, 2, 3


class KVPool:
    """Owns the tensors; never allocates or frees blocks (the allocator decides which ids).

    ``kv`` is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``: K at index
    0, V at 1, token-major ("NHD") inside a block. It is zero-filled once, so the null block
    reads as zeros. ``host`` has the same block shape with ``num_host_blocks + 1`` blocks on the
    CPU (pinned when the pool is on CUDA); its block 0 is unused, like the null block.

    With 8-bit pages (``config.is_quantized``) ``kv`` holds int8 / float8 codes and
    ``scales`` ``[num_layers, 2, num_blocks, block_size, num_kv_heads]`` bfloat16 holds one
    scale per (token, head) beside them (``host_scales`` likewise); every block operation
    moves a block's scales with its codes. With 4-bit pages (``config.is_packed``) ``kv``
    holds two codes a byte (``[..., head_dim // 2]`` uint8) and ``scales`` one scale per 16
    values (``[..., num_kv_heads, head_dim // 16]`` of ``config.scale_dtype``).

    Examples
    --------
    >>> pool = KVPool(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2,
    ...                           num_blocks=3, dtype=torch.float32))
    >>> tuple(pool.kv.shape), pool.nbytes  # 2*2*3*2*1*4 elements * 4 bytes
    ((2, 2, 3, 2, 1, 4), 384)
    """

    def __init__(self, config: CacheConfig) -> None:
        self._ops: list | None = None  # see record_ops
        block_shape = (config.block_size, config.num_kv_heads, config.page_dim)
        planes = (config.num_layers, 2)
        self.kv = torch.zeros((*planes, config.num_blocks, *block_shape),
                              dtype=config.cache_dtype, device=config.device)
        scale_shape = (config.block_size, config.num_kv_heads, *config.scale_shape)
        self.scales = (torch.zeros((*planes, config.num_blocks, *scale_shape),
                                   dtype=config.scale_dtype, device=config.device)
                       if config.is_quantized else None)
        self.host: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if config.num_host_blocks:
            pin = self.kv.is_cuda
            host_blocks = config.num_host_blocks + 1
            self.host = torch.zeros((*planes, host_blocks, *block_shape),
                                    dtype=config.cache_dtype, pin_memory=pin)
            if config.is_quantized:
                self.host_scales = torch.zeros((*planes, host_blocks, *scale_shape),
                                               dtype=config.scale_dtype, pin_memory=pin)
        logger.info("paged_kv: pool of %d blocks x %d tokens = %d tokens, %.3f GiB on %s",
                    config.num_blocks, config.block_size, config.num_blocks * config.block_size,
                    self.nbytes / 2**30, config.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the device pool, scales included."""
        return self.kv.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``([num_blocks, block_size, H, D], same)`` of one layer's K and V pages."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views ``([num_blocks, block_size, H], same)`` of one layer's K and V scales
        (``[..., H, head_dim // 16]`` for 4-bit pages), or ``(None, None)`` for float
        pages."""
        if self.scales is None:
            return None, None
        return self.scales[layer, 0], self.scales[layer, 1]

    def _planes(self, host: bool = False) -> list[torch.Tensor]:
        """The tensors a block spans, as ``[layers, 2, blocks, ...]`` with a trailing head
        dim (an 8-bit page's scales get a one-element one), fp8 as bytes: what copy and swap
        move."""
        kv, scales = (self.host, self.host_scales) if host else (self.kv, self.scales)
        if scales is not None and scales.dim() == kv.dim() - 1:
            scales = scales[..., None]
        return [raw(kv)] + ([] if scales is None else [raw(scales)])

    def _ids(self, block_ids: np.ndarray, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64)).to(device)

    def record_ops(self) -> None:
        """From now on keep a log of `copy` / `swap_out` / `swap_in` (``(kind, src, dst)``,
        kind `OP_COPY` / `OP_SWAP_OUT` / `OP_SWAP_IN`) for `take_ops`: tensor-parallel rank 0
        replays them on every rank."""
        self._ops = []

    def take_ops(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Return and clear the log `record_ops` keeps (empty when not recording)."""
        ops, self._ops = self._ops, ([] if self._ops is not None else None)
        return ops or []

    def replay_ops(self, ops: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Apply another pool's `take_ops` log, in order, to this pool (the same block ids:
        a tensor-parallel rank replaying rank 0's step)."""
        for kind, src, dst in ops:
            if kind == OP_COPY:
                self.copy(src, dst)
            else:
                self._transfer(src, dst, to_host=kind == OP_SWAP_OUT)

    def _log(self, kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        if self._ops is not None:
            self._ops.append((kind, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)))

    def copy(self, src_block_ids: np.ndarray, dst_block_ids: np.ndarray) -> None:
        """Copy whole blocks (all layers, K and V) inside the device pool."""
        self._log(OP_COPY, src_block_ids, dst_block_ids)
        src, dst = self._ids(src_block_ids, self.kv.device), self._ids(dst_block_ids,
                                                                       self.kv.device)
        for plane in self._planes():
            copy_blocks(plane, src, dst)

    def swap_out(self, block_ids: np.ndarray, host_block_ids: np.ndarray) -> None:
        """Copy device blocks to host blocks."""
        self._transfer(block_ids, host_block_ids, to_host=True)

    def swap_in(self, host_block_ids: np.ndarray, block_ids: np.ndarray) -> None:
        """Copy host blocks back into device blocks."""
        self._transfer(host_block_ids, block_ids, to_host=False)

    def _transfer(self, src_block_ids: np.ndarray, dst_block_ids: np.ndarray,
                  to_host: bool) -> None:
        """The one copy between the two pools, either way, logged for tensor-parallel ranks."""
        assert self.host is not None, "a swap without a host pool"
        self._log(OP_SWAP_OUT if to_host else OP_SWAP_IN, src_block_ids, dst_block_ids)
        planes = (self._planes(), self._planes(host=True))
        src_planes, dst_planes = planes if to_host else planes[::-1]
        src = self._ids(src_block_ids, src_planes[0].device)
        dst = self._ids(dst_block_ids, dst_planes[0].device)
        for src_plane, dst_plane in zip(src_planes, dst_planes, strict=True):
            swap_blocks(src_plane, dst_plane, src, dst)

    # -- whole blocks as bytes (the tiers' unit) ----------------------------------------
    @property
    def block_nbytes(self) -> int:
        """Bytes of one block as `read_blocks` returns it (every layer, K and V, scales)."""
        return sum(plane[:, :, 0].nbytes for plane in self._planes())

    def read_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        """Copy device blocks out: ``[n, block_nbytes]`` uint8 on the CPU, each row one
        block (its planes' bytes in layer, K/V, token order), independent of the pool."""
        ids = self._ids(block_ids, self.kv.device)
        rows = [plane.index_select(2, ids).movedim(2, 0).contiguous().view(torch.uint8)
                .reshape(ids.numel(), -1) for plane in self._planes()]
        return torch.cat(rows, dim=1).cpu()

    def write_blocks(self, block_ids: np.ndarray, data: torch.Tensor) -> None:
        """Fill device blocks from `read_blocks` rows (``[n, block_nbytes]`` uint8)."""
        if data.dtype != torch.uint8 or data.shape != (len(block_ids), self.block_nbytes):
            raise ValueError(f"write_blocks(): expected uint8 [{len(block_ids)}, "
                             f"{self.block_nbytes}], got {data.dtype} {tuple(data.shape)}")
        ids = self._ids(block_ids, self.kv.device)
        start = 0
        for plane in self._planes():
            block_shape = plane[:, :, 0].shape
            width = plane[:, :, 0].nbytes
            rows = data[:, start:start + width].to(self.kv.device).contiguous()
            blocks = rows.view(plane.dtype).reshape(len(block_ids), *block_shape)
            plane.index_copy_(2, ids, blocks.movedim(0, 2))
            start += width
