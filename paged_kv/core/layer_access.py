"""`LayerAccess`: the worker side of the cache — a layer's K/V written into its slots,
read back contiguous, or attended to from the pages; a recurrent layer's states read and
written in the state slab.

A mixin of `PagedKVCache`: every method reads the step's `StepBatch` (or resident
sequences) and the pool, and changes no owner; where a layer's pages are (its pool plane,
and the block tables of its layer group) is `_pages`'s answer, which a layout with several
layer groups overrides, and where a recurrent layer's states are is `_state_group`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import kernels
from .._checks import check_tensor, require_layer
from ..config import CacheConfig
from ..kernels.attention import attention_kind
from ..kernels.quant import scale_kwargs
from ..kernels.rotation import rotate
from .batch import BatchOrSeqIds, StepBatch, sequence_tables
from .page_table import PageTables
from .pool import KVPool


class LayerAccess:
    """Write, gather and attention over one layer's pages (see the module docstring)."""

    # provided by the cache
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
            (quantized on the way in when ``kv_cache_dtype`` is 8- or 4-bit; keys rotated
            first with ``kv_rotation``).
        batch : StepBatch
            From this step's `prepare`.

        Mutates
        -------
        The pool's slots named by ``batch.slot_mapping``.
        """
        require_layer(self.config, "write()", layer)
        self._require_batch("write()", batch)
        shape = (batch.num_tokens, self.config.num_kv_heads, self.config.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            check_tensor(f"write(): {name}", tensor, shape, dtype=self.config.dtype,
                         device=self.config.device)
        plane, batch, _ = self._pages(layer, batch)
        if self.config.kv_rotation:  # quantised pages take the rotated keys unrounded
            key = rotate(key, torch.float32 if self.config.is_quantized else None)
        kernels.write_kv(key, value, *self._pool.layer(plane), batch.slot_mapping,
                         *self._pool.layer_scales(plane))

    def gather(self, layer: int, batch_or_seq_ids: BatchOrSeqIds, pad_to: int | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None, *, packed: bool = False,
               ) -> tuple[torch.Tensor, ...]:
        """Contiguous K/V of some sequences as they are now: zero-padded, or packed end to
        end (the varlen form an attention kernel of one's own reads).

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            K and V ``[B, T, num_kv_heads, head_dim]``, ``T = pad_to or`` the longest length,
            zeros past each sequence's length; the cache's `dtype` (dequantized from 8-bit
            pages).
        (torch.Tensor, torch.Tensor, torch.Tensor)
            With ``packed=True``: K and V ``[total_tokens, num_kv_heads, head_dim]`` and
            ``cu_seqlens [B + 1]`` int32 (`pad_to` must be None: nothing is padded).
        """
        what = "gather(packed=True)" if packed else "gather()"
        require_layer(self.config, what, layer)
        plane, batch_or_seq_ids, tables = self._pages(layer, batch_or_seq_ids)
        block_tables, seq_lens, longest = sequence_tables(
            tables, what, batch_or_seq_ids, self.config.device)
        if packed:
            if pad_to is not None:
                raise ValueError(f"{what}: pad_to pads each sequence; packed K/V have none")
            return self._gather_packed(plane, block_tables, seq_lens, out)
        if pad_to is not None and (not isinstance(pad_to, int) or pad_to < longest):
            raise ValueError(f"gather(): pad_to must be an int >= the longest sequence "
                             f"({longest}), got {pad_to!r}")
        length = longest if pad_to is None else pad_to
        if out is not None:
            shape = (seq_lens.shape[0], length, self.config.num_kv_heads, self.config.head_dim)
            for name, tensor in zip(("out[0]", "out[1]"), out, strict=True):
                check_tensor(f"gather(): {name}", tensor, shape, dtype=self.config.dtype,
                             device=self.config.device)
        return self._unrotated(kernels.gather_kv(
            *self._pool.layer(plane), block_tables, seq_lens, length, out,
            **self._scales_of(plane, out_dtype=self.config.dtype)))

    def _gather_packed(self, plane: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       out: tuple[torch.Tensor, torch.Tensor] | None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cu_seqlens = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_seqlens[1:])
        if out is not None:
            shape = (int(cu_seqlens[-1]), self.config.num_kv_heads, self.config.head_dim)
            for name, tensor in zip(("out[0]", "out[1]"), out, strict=True):
                check_tensor(f"gather(packed=True): {name}", tensor, shape,
                             dtype=self.config.dtype, device=self.config.device)
        k, v = self._unrotated(kernels.gather_kv_packed(
            *self._pool.layer(plane), block_tables, seq_lens, cu_seqlens, out,
            **self._scales_of(plane, out_dtype=self.config.dtype)))
        return k, v, cu_seqlens

    def _unrotated(self, kv: tuple[torch.Tensor, torch.Tensor],
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered K/V with the keys rotated back when `kv_rotation` stored them rotated
        (in place: a caller's `out` buffers hold the result)."""
        if self.config.kv_rotation:
            kv[0].copy_(rotate(kv[0]))
        return kv

    def attention(self, layer: int, query: torch.Tensor, batch: StepBatch,
                  scale: float | None = None, *, sinks: torch.Tensor | None = None,
                  softcap: float = 0.0) -> torch.Tensor:
        """Causal attention of the step's queries over each sequence's cached K/V, as the
        layer's `LayerKind` reads it (the whole past, a sliding window, or its chunk).

        Parameters
        ----------
        query : torch.Tensor
            ``[batch.num_tokens, num_q_heads, head_dim]``; ``num_q_heads`` a multiple of
            ``num_kv_heads``.
        scale : float, optional
            Default ``head_dim ** -0.5``.
        sinks : torch.Tensor, optional
            ``[num_q_heads]`` learned sink logits (gpt-oss): each adds ``exp(sink)`` to its
            head's softmax denominator, attending to nothing.
        softcap : float
            Logit soft-capping (Gemma 2): scores become ``softcap * tanh(scores / softcap)``
            before the mask and softmax; 0 for none.

        Returns
        -------
        torch.Tensor
            ``[batch.num_tokens, num_q_heads, head_dim]``.
        """
        require_layer(self.config, "attention()", layer)
        self._require_batch("attention()", batch)
        check_tensor("attention(): query", query, (batch.num_tokens, None, self.config.head_dim),
                     dtype=self.config.dtype, device=self.config.device)
        if query.shape[1] % self.config.num_kv_heads:
            raise ValueError(f"attention(): query heads ({query.shape[1]}) must be a multiple "
                             f"of num_kv_heads ({self.config.num_kv_heads})")
        plane, batch, _ = self._pages(layer, batch)
        if self.config.kv_rotation:  # q R . k R = q . k: scores as without the rotation
            query = rotate(query)
        return kernels.paged_attention(query, *self._pool.layer(plane), batch.block_tables,
                                       batch.seq_lens, batch.query_start_loc, scale,
                                       workspace=None if kernels.use_triton(query)
                                       else self._workspace_for(batch),
                                       **self._scales_of(plane),
                                       **attention_kind(self.config, layer, sinks, softcap))

    # -- recurrent states ------------------------------------------------------------------
    def states(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The state slab's tensors of recurrent layer `layer`: ``[num_state_slots,
        *spec.shape]`` each, in the order of its `LayerKind.states`, indexed by the slots a
        step's `paged_kv.core.groups.state.StateBatch` names (a kernel reads and writes
        them in place; see `read_states` and `write_states`)."""
        require_layer(self.config, "states()", layer)
        return self._state_group(layer, "states()").slab.tensors(layer)

    def read_states(self, layer: int, batch: StepBatch) -> tuple[torch.Tensor, ...]:
        """The step's initial states of recurrent layer `layer`: a copy of each row's live
        state, ``[B, *spec.shape]`` per spec (the rows in the step's order).

        Examples
        --------
        >>> from paged_kv import CacheConfig, LayerKind, PagedKVCache
        >>> from paged_kv.config import StateSpec
        >>> ssm = LayerKind.recurrent((StateSpec("ssm", (2, 3), torch.float32),))
        >>> cache = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4,
        ...                                  block_size=4, num_blocks=8, num_state_slots=4,
        ...                                  layer_kinds=(LayerKind(), ssm)))
        >>> _, batch = cache.admit("a", [1, 2, 3, 4, 5])
        >>> (state,) = cache.read_states(1, batch)  # a new sequence starts from zeros
        >>> state.shape, bool(state.any())
        (torch.Size([1, 2, 3]), False)
        >>> state_batch = batch.groups[1]  # the state after token 3 is saved (block 0)
        >>> state_batch.emit_tokens.tolist(), state_batch.num_emitted
        ([3], 1)
        >>> cache.write_states(1, batch, (torch.ones(1, 2, 3),), (torch.ones(1, 2, 3),))
        """
        require_layer(self.config, "read_states()", layer)
        self._require_batch("read_states()", batch)
        group = self._state_group(layer, "read_states()")
        return group.slab.read(layer, group.batch_of(batch, "read_states()").slots)

    def write_states(self, layer: int, batch: StepBatch, final: Sequence[torch.Tensor],
                     emitted: Sequence[torch.Tensor] | None = None) -> None:
        """Write the step's states of recurrent layer `layer`: each row's final states into
        its live slot, and the states after the batch's ``emit_tokens`` into their
        checkpoint slots. Every tensor is checked before any is written.

        Parameters
        ----------
        final : sequence of torch.Tensor
            One per spec of the layer, ``[B, *spec.shape]`` of ``spec.dtype`` on the cache's
            device, in the step's row order.
        emitted : sequence of torch.Tensor, optional
            One per spec, ``[E, *spec.shape]``, ``E`` the batch's ``num_emitted``; None only
            when it is 0.

        Mutates
        -------
        The slab's live slots of the step's rows, and its checkpoint slots named by the
        batch (``emit_slots``); the write of the group's last recurrent layer makes those
        checkpoints servable and evictable (the layers are written in order: every one
        wrote them).
        """
        what = "write_states()"
        require_layer(self.config, what, layer)
        self._require_batch(what, batch)
        group = self._state_group(layer, what)
        states, slab = group.batch_of(batch, what), group.slab
        slab.check_states(f"{what}: final", layer, final, states.batch_size)
        if emitted is None and states.num_emitted:
            raise ValueError(f"{what}: emitted: the batch saves {states.num_emitted} state "
                             f"checkpoints (its emit_tokens): expected their states, got None")
        if emitted is not None:
            slab.check_states(f"{what}: emitted", layer, emitted, states.num_emitted)
        slab.write(layer, states.slots, final)
        if states.num_emitted:
            slab.write(layer, states.emit_slots, emitted)
            if layer == group.layers[-1]:  # every recurrent layer wrote its checkpoints
                group.slots.written(states.emit_slots.tolist())

    def _state_group(self, layer: int, what: str) -> Any:
        """The layer group holding recurrent layer `layer`'s states (the cache's answer;
        a `paged_kv.core.groups.state_group.StateGroup`)."""
        raise NotImplementedError

    def _pages(self, layer: int, batch_or_seq_ids: BatchOrSeqIds,
               ) -> tuple[int, BatchOrSeqIds, PageTables]:
        """The pool plane `layer` lives in, and the batch and tables its block ids come
        from: the layer itself, as given, and the cache's tables here (a hybrid layout
        picks its layer group's)."""
        return layer, batch_or_seq_ids, self._tables

    def _scales_of(self, plane: int, **extra: object) -> dict:
        """Keyword arguments that make a kernel read this plane's 8-bit pages (none for
        float pages, so their calls stay as they were)."""
        return scale_kwargs(*self._pool.layer_scales(plane), **extra)

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

    def _require_batch(self, what: str, batch: object) -> None:
        if not isinstance(batch, StepBatch):
            raise TypeError(f"{what}: batch must be the StepBatch prepare() returned, "
                            f"got {type(batch).__name__}")

