"""`PagedCache`: a Hugging Face ``transformers`` (5.x) ``Cache`` backed by one `PagedKVCache`.

Use it wherever ``generate`` takes a cache::

    cache = PagedCache(model.config, num_blocks=1024, block_size=16)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)
    print(cache.num_used_blocks, cache.stats().bytes_saved_by_sharing)

Each batch row is one sequence of the `PagedKVCache`; its one block table serves every layer::

    first layer's update ──► prepare({row: T, ...}) ──► StepBatch (kept for the step)
    every layer's update ──► write(layer, K/V, batch), gather(layer, batch) ──► attention

``cache.layers`` holds a thin `CacheLayerMixin` view per layer, so what ``transformers`` reads
off the layers (mask sizes, lengths, sliding / linear / compile flags) works unchanged; what
changes rows (`reorder_cache`, `crop`, `reset`, `batch_*`) acts once, on the shared rows.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # optional dependency: say which extra brings it
    raise ImportError("paged_kv.integrations.transformers needs transformers>=5,<6: "
                      "pip install 'paged_kv[hf]'") from exc

from .._checks import check_tensor
from ..config import CacheConfig, LayerKind
from ..core.accounting import CacheStats
from ..core.batch import StepBatch
from ..core.cache import PagedKVCache
from ..errors import OutOfBlocksError
from .hf_support import layer_kinds, require_supported

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


class PagedCache(Cache):
    """A ``transformers`` cache whose K/V live in the blocks of one `PagedKVCache`.

    Rows get their blocks on first use, a block at a time; beam search reorders rows by
    sharing blocks (`PagedKVCache.fork`) instead of copying them, and the core copies a
    shared, partly filled last block only when a row writes into it (copy-on-write).

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        The model's config; its (decoder) text config gives ``num_hidden_layers``,
        ``num_key_value_heads`` and ``head_dim`` (default ``hidden_size //
        num_attention_heads``) and each layer's kind (`hf_support.layer_kinds`: full,
        sliding-window or chunked attention; the model masks windows and chunks itself
        over the whole past `update` returns, and the pool keeps what those masks read).
    num_blocks : int
        Blocks in the pool, the reserved null block included.
    block_size : int
        Tokens per block.
    device : str or torch.device
        Where the pool lives; the model's K/V must be there too.
    dtype : torch.dtype, optional
        Pool dtype (float32, float16, bfloat16); default the config's ``dtype``, else
        torch's default dtype. The model's K/V must have it.
    kv_cache_dtype : str
        ``"auto"`` (pages in `dtype`) or ``"int8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``:
        8-bit pages with scales, about twice the tokens in the same memory (see
        `CacheConfig`); `update` still takes and returns `dtype`.

    Raises
    ------
    ValueError
        A layer paged_kv does not serve (linear / Mamba, cross-attention; an
        `UnsupportedModelError` naming the model type and layer type), or a pool setting is
        invalid (from `CacheConfig`).

    Examples
    --------
    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=4, num_key_value_heads=2,
    ...                      intermediate_size=128)
    >>> cache = PagedCache(config, num_blocks=32, block_size=16, dtype=torch.float32)
    >>> key = value = torch.randn(3, 2, 20, 16)        # [B, kv heads, new tokens, head_dim]
    >>> keys, values = cache.update(key, value, 0)       # layer 0 opens the step
    >>> tuple(keys.shape), cache.num_used_blocks          # 3 rows * ceil(20 / 16) blocks
    ((3, 2, 20, 16), 6)
    >>> keys, values = cache.update(key, value, 1)       # layer 1: same slots, no new blocks
    >>> cache.reorder_cache(torch.tensor([0, 0, 2]))     # row 1 becomes a fork of row 0
    >>> cache.num_used_blocks, cache.stats().num_shared_blocks  # row 1's 2 blocks freed
    (4, 2)
    >>> cache.get_seq_length(), cache.reset(), cache.num_used_blocks
    (20, None, 0)
    """

    def __init__(self, config: PreTrainedConfig, num_blocks: int, block_size: int = 16,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        text_config = config.get_text_config(decoder=True)
        require_supported(text_config, "PagedCache (use DynamicCache for this model)")
        num_heads = text_config.num_attention_heads
        head_dim = (getattr(text_config, "head_dim", None)
                    or text_config.hidden_size // num_heads)
        if dtype is None:
            dtype = getattr(text_config, "dtype", None) or torch.get_default_dtype()
        if isinstance(dtype, str):  # configs loaded from JSON spell it "bfloat16"
            dtype = getattr(torch, dtype, dtype)
        self._kv = PagedKVCache(CacheConfig(
            num_layers=text_config.num_hidden_layers,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, dtype=dtype,
            device=device, enable_prefix_caching=False,  # token ids never reach a cache
            kv_cache_dtype=kv_cache_dtype, layer_kinds=_pool_kinds(text_config)))
        self._seq_ids: list[int] = []        # one sequence per batch row, in row order
        self._next_seq_id = 0
        self._batch: StepBatch | None = None  # the open step, shared by every layer
        self._written: set[int] = set()      # layers that wrote in the open step
        layers = [_PagedLayer(self, i) for i in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)

    # -- a step -------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new K/V and return all of that layer's K/V.

        The first layer of a forward step reserves ``T`` slots per row (`PagedKVCache.prepare`,
        new blocks as rows cross block boundaries); later layers write into the same slots.

        Parameters
        ----------
        key_states, value_states : torch.Tensor
            ``[batch_size, num_kv_heads, T, head_dim]``, the pool's dtype and device.
        layer_idx : int
            The model layer, ``0 <= layer_idx < num_hidden_layers``.
        *args, **kwargs
            ``cache_kwargs`` / ``kwargs`` from the model; unused.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            K and V ``[batch_size, num_kv_heads, seq_len, head_dim]`` (views of fresh
            gathers; every row has the same length).

        Raises
        ------
        OutOfBlocksError
            The step needs more blocks than the pool has; nothing changed.
        TypeError, ValueError
            Bad layer, shape, dtype or device (another batch size needs `reset` first);
            nothing changed.

        Mutates
        -------
        The pool slots of this step's tokens for ``layer_idx``.
        """
        self._check_states(key_states, value_states, layer_idx)
        batch_size, num_heads, num_new, head_dim = key_states.shape
        if self._batch is None or layer_idx in self._written:
            self._open_step(batch_size, num_new)
        if self._batch.num_tokens != batch_size * num_new:
            raise ValueError(f"PagedCache.update(): layer {layer_idx} got {num_new} new "
                             f"tokens per row, but this step's first layer wrote "
                             f"{self._batch.num_tokens // batch_size}")

        def tokens(states: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B * T, H, D)
            return states.transpose(1, 2).reshape(batch_size * num_new, num_heads, head_dim)

        self._kv.write(layer_idx, tokens(key_states), tokens(value_states), self._batch)
        self._written.add(layer_idx)
        keys, values = self._kv.gather(layer_idx, self._batch)  # (B, seq_len, H, D)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor,
                      layer_idx: int) -> None:
        num_layers = len(self.layers)
        if isinstance(layer_idx, bool) or not (isinstance(layer_idx, int)
                                               and 0 <= layer_idx < num_layers):
            raise ValueError(f"PagedCache.update(): layer_idx must be an int in "
                             f"[0, {num_layers}), got {layer_idx!r}")
        config = self._kv.config
        shape = (len(self._seq_ids) or None, config.num_kv_heads, None, config.head_dim)
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            check_tensor(f"PagedCache.update(): {name}", states, shape, dtype=config.dtype,
                         device=config.device)
        if value_states.shape != key_states.shape:
            raise ValueError(f"PagedCache.update(): value_states shape "
                             f"{tuple(value_states.shape)} differs from key_states shape "
                             f"{tuple(key_states.shape)}")

    # -- accounting -----------------------------------------------------------------------
    @property
    def kv_cache(self) -> PagedKVCache:
        """The `PagedKVCache` holding every row (read it; change rows through this cache)."""
        return self._kv

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """The `PagedKVCache` sequence id of each batch row, in row order."""
        return tuple(self._seq_ids)

    @property
    def num_used_blocks(self) -> int:
        """Live blocks now (a block shared by several rows counts once)."""
        return self._kv.allocator.num_live_blocks

    def stats(self) -> CacheStats:
        """The underlying `PagedKVCache.stats()`: blocks, bytes, sharing, per-row breakdown."""
        return self._kv.stats()

    @property
    def batch_size(self) -> int:
        """Rows in the cache (0 before the first forward and after `reset`)."""
        return len(self._seq_ids)

    # -- rows -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every row, returning all their blocks; the cache is ready for a new batch.

        Mutates
        -------
        Every row: afterwards ``num_used_blocks == 0`` and ``get_seq_length() == 0``.
        """
        for seq_id in self._seq_ids:
            self._kv.free(seq_id)
        self._seq_ids = []
        self._close_step()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues from row ``beam_idx[i]`` (``[batch_size]``).

        The first row to pick a source takes it over, every other pick is a `fork` of it
        (blocks shared, nothing copied), and rows nobody picked are freed. A wrong length or
        an index out of range raises `ValueError` before anything changes.

        Mutates
        -------
        `seq_ids` and the blocks' refcounts.
        """
        if self._seq_ids and len(beam_idx) != len(self._seq_ids):
            raise ValueError(f"reorder_cache(): beam_idx must have {len(self._seq_ids)} "
                             f"entries (one per row), got {len(beam_idx)}")
        self._select_rows("reorder_cache()", beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (ints or a boolean mask), in that order."""
        if isinstance(indices, torch.Tensor) and indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._select_rows("batch_select_indices()", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times in place (``r0, r0, r1, r1, ...``), by `fork`."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"batch_repeat_interleave(): repeats must be an int >= 1, "
                             f"got {repeats!r}")
        rows = torch.arange(len(self._seq_ids)).repeat_interleave(repeats)
        self._select_rows("batch_repeat_interleave()", rows)

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end of every row (speculative and prompt-lookup decoding).

        Parameters
        ----------
        max_length : int
            ``<= 0``: remove ``-max_length`` tokens (``transformers`` 5's ``crop``);
            ``> 0``: keep the first ``max_length`` tokens (the older ``crop(max_length)``).

        Mutates
        -------
        Every row's length; blocks past the kept tokens are released
        (`PagedKVCache.truncate`).
        """
        if isinstance(max_length, bool) or not hasattr(max_length, "__index__"):
            raise TypeError(f"crop(): max_length must be an int, got {max_length!r}")
        max_length = operator.index(max_length)  # numpy and 0-d tensor ints too
        length = self.get_seq_length()
        keep = max(length + max_length, 0) if max_length <= 0 else min(max_length, length)
        if keep == length:
            return
        for seq_id in self._seq_ids:
            self._kv.truncate(seq_id, keep)
        self._close_step()

    # -- internals ------------------------------------------------------------------------
    def _open_step(self, batch_size: int, num_new: int) -> None:
        """Reserve ``num_new`` slots per row, adding the rows on the first step; on
        `OutOfBlocksError` neither the `PagedKVCache` nor the rows changed."""
        seq_ids = self._seq_ids
        if not seq_ids:
            # check before add_sequence, so a failing first step leaves no empty rows behind
            needed = batch_size * self._kv.config.blocks_for(num_new)
            if not self._kv.can_allocate(needed):
                raise OutOfBlocksError(needed, self._kv.allocator.num_obtainable_blocks)
            seq_ids = list(range(self._next_seq_id, self._next_seq_id + batch_size))
            self._next_seq_id += batch_size
            for seq_id in seq_ids:
                self._kv.add_sequence(seq_id)
        if num_new == 1 and self._seq_ids:  # a decode step: the array path
            self._batch = self._kv.prepare_decode(self._kv.rows_of(seq_ids), None)
        else:
            self._batch = self._kv.prepare(dict.fromkeys(seq_ids, num_new))
        self._seq_ids = seq_ids
        self._written = set()

    def _layer_seq_length(self, layer: int) -> int:
        """Tokens layer ``layer`` holds (rows are always the same length)."""
        if not self._seq_ids:
            return 0
        length = self._kv.tables.num_tokens_of(self._seq_ids[0])
        if self._batch is not None and layer not in self._written:
            # the step reserved its slots on the first layer; this layer has not written yet
            length -= self._batch.num_tokens // len(self._seq_ids)
        return length

    def _close_step(self) -> None:
        self._batch = None
        self._written = set()

    def _select_rows(self, what: str, indices: torch.Tensor | Sequence[int]) -> None:
        """Row ``i`` becomes a copy of row ``indices[i]``; shares blocks, copies nothing."""
        if not self._seq_ids:
            return  # nothing cached yet: like DynamicCache, nothing to reorder
        sources = [int(i) for i in torch.as_tensor(indices).flatten().tolist()]
        bad = [i for i in sources if not 0 <= i < len(self._seq_ids)]
        if bad:
            raise ValueError(f"{what}: row indices must be in [0, {len(self._seq_ids)}), "
                             f"got {bad}")
        if sources == list(range(len(self._seq_ids))):
            return
        taken: set[int] = set()
        new_seq_ids = []
        for source in sources:
            seq_id = self._seq_ids[source]
            if source in taken:
                child, self._next_seq_id = self._next_seq_id, self._next_seq_id + 1
                self._kv.fork(seq_id, child)
                seq_id = child
            taken.add(source)
            new_seq_ids.append(seq_id)
        for row, seq_id in enumerate(self._seq_ids):
            if row not in taken:
                self._kv.free(seq_id)
        self._seq_ids = new_seq_ids
        self._close_step()


class _PagedLayer(CacheLayerMixin):
    """One model layer's view of a `PagedCache`: the rows are shared by every layer."""

    is_compileable = False  # rows grow and block tables change shape every step
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: PagedCache, layer: int) -> None:
        super().__init__()
        self._cache = cache
        self.layer = layer
        self.is_initialized = True  # the pool is allocated up front

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool exists from the start."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(key_states, value_states, self.layer)

    def get_seq_length(self) -> int:
        return self._cache._layer_seq_length(self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: every cached token plus the query, from position 0."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows until the pool runs out of blocks

    def _shared_rows(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("a PagedCache's rows are shared by all layers: call this "
                                  "method on the PagedCache, not on one of its layers")

    reset = crop = reorder_cache = _shared_rows
    batch_select_indices = batch_repeat_interleave = offload = prefetch = _shared_rows


def _pool_kinds(text_config: object) -> tuple[LayerKind, ...]:
    """The model's layer kinds as the pool keeps them: a chunked layer of ``C`` as a window
    of ``C``. transformers aligns a left-padded row's chunks to its first real token
    (``(kv - pad) // C == (q - pad) // C``), not to slot 0 as the pool's chunks are, so a
    chunked pool would give back keys such a row still reads; every key a chunk shows its
    query lies within the last ``C`` positions, whatever the padding."""
    return tuple(LayerKind.sliding(kind.chunk) if kind.chunk else kind
                 for kind in layer_kinds(text_config))


__all__ = ["PagedCache"]
