"""The worker side of `PagedKVCache`: write, gather and attention over the pool's tensors.

A mixin so the facade keeps one public surface while the tensor methods live in their own
module; it reads the cache's config, pool and tables and changes only pool contents.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import kernels
from ._checks import check_tensor, require_resident
from .config import CacheConfig
from .kernels.quant import scale_kwargs
from .page_table import PageTables
from .pool import KVPool
from .step.batch import SeqId, StepBatch

BatchOrSeqIds = StepBatch | Sequence[SeqId]


class TensorOps:
    """`write`, `gather`, `gather_packed` and `attention` of `PagedKVCache`."""

    # set by PagedKVCache.__init__
    config: CacheConfig
    _pool: KVPool
    _tables: PageTables
    _workspace: torch.Tensor

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              batch: StepBatch) -> None:
        """Scatter the step's new K/V of one layer into their slots.

        Parameters
        ----------
        layer : int
        key, value : torch.Tensor
            ``[batch.num_tokens, num_kv_heads, head_dim]``, the cache's dtype and device
            (quantized on the way in when ``kv_cache_dtype`` is 8-bit).
        batch : StepBatch
            From this step's `prepare`.

        Mutates
        -------
        The pool's slots named by ``batch.slot_mapping``.
        """
        self._require_layer("write()", layer)
        self._require_batch("write()", batch)
        shape = (batch.num_tokens, self.config.num_kv_heads, self.config.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            check_tensor(f"write(): {name}", tensor, shape, dtype=self.config.dtype,
                         device=self.config.device)
        kernels.write_kv(key, value, *self._pool.layer(layer), batch.slot_mapping,
                         *self._pool.layer_scales(layer))

    def gather(self, layer: int, batch_or_seq_ids: BatchOrSeqIds, pad_to: int | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K/V of some sequences as they are now, zero-padded.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            K and V ``[B, T, num_kv_heads, head_dim]``, ``T = pad_to or`` the longest length,
            zeros past each sequence's length; the cache's `dtype` (dequantized from 8-bit
            pages).
        """
        self._require_layer("gather()", layer)
        block_tables, seq_lens, longest = self._tables_of("gather()", batch_or_seq_ids)
        if pad_to is not None and (not isinstance(pad_to, int) or pad_to < longest):
            raise ValueError(f"gather(): pad_to must be an int >= the longest sequence "
                             f"({longest}), got {pad_to!r}")
        length = longest if pad_to is None else pad_to
        if out is not None:
            shape = (seq_lens.shape[0], length, self.config.num_kv_heads, self.config.head_dim)
            for name, tensor in zip(("out[0]", "out[1]"), out, strict=True):
                check_tensor(f"gather(): {name}", tensor, shape, dtype=self.config.dtype,
                             device=self.config.device)
        return kernels.gather_kv(*self._pool.layer(layer), block_tables, seq_lens, length, out,
                                 **self._scales_of(layer, out_dtype=self.config.dtype))

    def gather_packed(self, layer: int, batch_or_seq_ids: BatchOrSeqIds,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V of some sequences packed end to end (varlen form).

        Returns
        -------
        (torch.Tensor, torch.Tensor, torch.Tensor)
            K and V ``[total_tokens, num_kv_heads, head_dim]`` and ``cu_seqlens [B + 1]``
            int32.
        """
        self._require_layer("gather_packed()", layer)
        block_tables, seq_lens, _ = self._tables_of("gather_packed()", batch_or_seq_ids)
        cu_seqlens = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_seqlens[1:])
        if out is not None:
            shape = (int(cu_seqlens[-1]), self.config.num_kv_heads, self.config.head_dim)
            for name, tensor in zip(("out[0]", "out[1]"), out, strict=True):
                check_tensor(f"gather_packed(): {name}", tensor, shape,
                             dtype=self.config.dtype, device=self.config.device)
        k, v = kernels.gather_kv_packed(*self._pool.layer(layer), block_tables, seq_lens,
                                        cu_seqlens, out,
                                        **self._scales_of(layer, out_dtype=self.config.dtype))
        return k, v, cu_seqlens

    def attention(self, layer: int, query: torch.Tensor, batch: StepBatch,
                  scale: float | None = None) -> torch.Tensor:
        """Causal attention of the step's queries over each sequence's cached K/V.

        Parameters
        ----------
        query : torch.Tensor
            ``[batch.num_tokens, num_q_heads, head_dim]``; ``num_q_heads`` a multiple of
            ``num_kv_heads``.
        scale : float, optional
            Default ``head_dim ** -0.5``.

        Returns
        -------
        torch.Tensor
            ``[batch.num_tokens, num_q_heads, head_dim]``.
        """
        self._require_layer("attention()", layer)
        self._require_batch("attention()", batch)
        check_tensor("attention(): query", query, (batch.num_tokens, None, self.config.head_dim),
                     dtype=self.config.dtype, device=self.config.device)
        if query.shape[1] % self.config.num_kv_heads:
            raise ValueError(f"attention(): query heads ({query.shape[1]}) must be a multiple "
                             f"of num_kv_heads ({self.config.num_kv_heads})")
        return kernels.paged_attention(query, *self._pool.layer(layer), batch.block_tables,
                                       batch.seq_lens, batch.query_start_loc, scale,
                                       workspace=None if kernels.use_triton(query)
                                       else self._workspace_for(batch),
                                       **self._scales_of(layer))

    def _scales_of(self, layer: int, **extra: object) -> dict:
        """Keyword arguments that make a kernel read this layer's 8-bit pages (none for float
        pages, so their calls stay as they were)."""
        return scale_kwargs(*self._pool.layer_scales(layer), **extra)

    def _workspace_for(self, batch: StepBatch) -> torch.Tensor:
        """Scratch for the torch attention path's gathers, grown on demand, reused by every
        layer and step."""
        block_size, config = self.config.block_size, self.config
        length = -(-batch.max_seq_len // block_size) * block_size
        need = 2 * batch.batch_size * length * config.num_kv_heads * config.head_dim
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need + need // 2, dtype=config.dtype,
                                          device=config.device)
        return self._workspace

    def _require_layer(self, what: str, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise TypeError(f"{what}: layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"{what}: layer {layer} out of range [0, {self.config.num_layers})")

    def _require_batch(self, what: str, batch: object) -> None:
        if not isinstance(batch, StepBatch):
            raise TypeError(f"{what}: batch must be the StepBatch prepare() returned, "
                            f"got {type(batch).__name__}")

    def _tables_of(self, what: str, batch_or_seq_ids: BatchOrSeqIds,
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Block tables ``[B, W]``, lengths ``[B]`` and the longest length, now."""
        if isinstance(batch_or_seq_ids, StepBatch):
            # the batch's tensors describe its sequences as prepare() left them
            batch = batch_or_seq_ids
            return batch.block_tables, batch.seq_lens, batch.max_seq_len
        if isinstance(batch_or_seq_ids, str | bytes) or not isinstance(batch_or_seq_ids,
                                                                         Sequence):
            raise TypeError(f"{what}: expected a StepBatch or a list of sequence ids, "
                            f"got {type(batch_or_seq_ids).__name__}")
        seq_ids = batch_or_seq_ids
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"{what}: duplicate sequence ids in {list(seq_ids)!r}")
        for seq_id in seq_ids:
            require_resident(self._tables, what, seq_id)
        rows = np.array([self._tables.row_of[s] for s in seq_ids], dtype=np.int64)
        lengths = self._tables.num_tokens[rows]
        width = max(int(self._tables.num_blocks[rows].max()) if rows.size else 0, 1)
        device = self.config.device
        block_tables = torch.from_numpy(self._tables.block_ids[rows, :width].copy()).to(device)
        seq_lens = torch.from_numpy(lengths.astype(np.int32)).to(device)
        return block_tables, seq_lens, int(lengths.max()) if rows.size else 0
