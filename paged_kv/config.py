"""`CacheConfig`: the one validated, frozen description of a paged KV cache's shape."""

from __future__ import annotations

import dataclasses
import math

import torch

from .layer_kinds import (  # noqa: F401  (re-exported: the config's vocabulary)
    ATTENTION_KINDS,
    NO_RECURRENT_ONLY,
    LayerKind,
    StateSpec,
    group_layers,
)
from .tenants.policy import TenantPolicy

# slots of the state slab a checkpoint policy ranks (`paged_kv.core.groups.slot_loops`'s
# MAX_SLOTS, which its tests compare with this)
MAX_STATE_SLOTS = 1 << 21

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the torch dtype each page format needs, by attribute name (float8 types are optional): an
# 8-bit format's page element type; a 4-bit one's (`PACKED_FORMATS`) scale type
KV_CACHE_DTYPES = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                   "int4": "bfloat16", "nvfp4": "float8_e4m3fn"}
# 4-bit formats: two values a byte (uint8 pages of head_dim / 2), one scale per GROUP values
PACKED_FORMATS = ("int4", "nvfp4")
GROUP = 16
# one scale per (token, layer, K/V, kv head) of 8-bit pages; bfloat16 for float32's range
SCALE_DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape of a paged KV cache.

    The pool is one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
    block 0 is the reserved null block, so ``num_blocks - 1`` blocks are usable.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model dimensions of the K/V being cached (all >= 1).
    block_size : int
        Tokens per block (>= 1; any size, powers of two not required).
    num_blocks : int
        Blocks in the pool, the null block included (>= 2).
    dtype : torch.dtype
        float32, float16 or bfloat16.
    device : str or torch.device
        Where the pool lives.
    enable_prefix_caching : bool
        Index full blocks by their token prefix so later sequences can reuse them.
    num_host_blocks : int
        Blocks in the host (CPU) pool that swapped-out sequences move to (0 = no swapping).
    max_num_seqs : int
        Initial rows of the page tables (they grow on demand).
    kv_cache_dtype : str
        How pages store K/V: ``"auto"`` in `dtype`; ``"int8"``, ``"fp8_e4m3"`` or
        ``"fp8_e5m2"`` in 8 bits with one `SCALE_DTYPE` scale per (token, layer, K/V, kv head)
        beside them (see docs/architecture.md); ``"int4"`` (symmetric, a `SCALE_DTYPE` scale
        per `GROUP` values) or ``"nvfp4"`` (e2m1 values, an e4m3 scale per `GROUP`: vLLM's
        NVFP4 layout) in 4 bits, two values a byte, `head_dim` a multiple of `GROUP`.
        `write` takes and `gather` / `attention` return `dtype` either way.
    kv_rotation : bool
        Rotate keys by a fixed orthonormal Hadamard per head before they are stored (and
        queries alike in `attention`, which is thus unchanged in exact arithmetic; `gather`
        rotates keys back): spreads outlier channels over the head, for 4-bit pages.
    layer_kinds : tuple of LayerKind
        One per layer: full attention, a sliding window, chunked local attention or a
        recurrent layer (see `LayerKind`); empty (the default) means every layer is full
        attention.
    tenants : TenantPolicy, optional
        How tenants (prefix-cache salts) share the cached blocks: quotas, reservations,
        soft retention (see `paged_kv.tenants`); None (the default): one global LRU.
    num_state_slots : int
        Slots of the state slab beside the pool (docs/architecture.md, "Recurrent state"):
        one slot holds every recurrent layer's states of one sequence
        (`state_bytes_per_slot`), as a resident sequence's live state or as a prefix
        checkpoint. At least 1 when `layer_kinds` has recurrent layers (at most
        `MAX_STATE_SLOTS`, 2,097,152); 0 otherwise.
    reuse_block_tables : bool
        Keep each step's block tables and update them by the next step's changes (vLLM's
        persistent block table; `paged_kv.core.step_table`) instead of giving every batch
        tables of its own (False, the default). A decode step of the same rows then writes
        the few entries that changed (rows that opened a block, blocks a window gave back),
        not a new ``[B, max_blocks]`` table (1 MB at 1,024 rows whose longest holds 4K
        tokens). In exchange a batch's `block_tables` and host arrays are valid until the
        next step only, which may update them in place: for a caller that drops each
        batch before preparing the next, as the engine does (it turns this on).

    Examples
    --------
    >>> cfg = CacheConfig(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16,
    ...                   num_blocks=128, dtype=torch.float16)
    >>> cfg.bytes_per_block  # 2 layers * 2 (K, V) * 16 tokens * 4 heads * 64 * 2 bytes
    32768
    >>> cfg.bytes_per_token
    2048
    >>> cfg8 = dataclasses.replace(cfg, kv_cache_dtype="int8")
    >>> cfg8.bytes_per_token  # 2 layers * 2 * 4 heads * (64 int8 + a 2-byte scale)
    1056
    >>> dataclasses.replace(cfg, kv_cache_dtype="nvfp4").bytes_per_token  # 4 * (32 + 4 * 1)
    576
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    num_blocks: int = 1024
    dtype: torch.dtype = torch.float16
    device: str | torch.device = "cpu"
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    max_num_seqs: int = 256
    kv_cache_dtype: str = "auto"
    layer_kinds: tuple[LayerKind, ...] = ()
    tenants: TenantPolicy | None = None
    num_state_slots: int = 0
    kv_rotation: bool = False
    reuse_block_tables: bool = False

    def __post_init__(self) -> None:
        minimums = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "block_size": 1,
                    "num_blocks": 2, "num_host_blocks": 0, "max_num_seqs": 1,
                    "num_state_slots": 0}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"CacheConfig.{name}: expected an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"CacheConfig.{name}: expected >= {minimum}, got {value}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"CacheConfig.dtype: expected one of float32, float16, bfloat16, got {self.dtype!r}"
            )
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"CacheConfig.device: not a device: {self.device!r}") from exc
        object.__setattr__(self, "device", device)
        self._check_kv_cache_dtype()
        self._check_layer_kinds()
        if self.tenants is not None:
            if not isinstance(self.tenants, TenantPolicy):
                raise ValueError(f"CacheConfig.tenants: expected a TenantPolicy or None, "
                                 f"got {type(self.tenants).__name__}")
            self.tenants.check(self.num_blocks)
        if not isinstance(self.reuse_block_tables, bool):
            raise ValueError(f"CacheConfig.reuse_block_tables: expected a bool, "
                             f"got {self.reuse_block_tables!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"CacheConfig.enable_prefix_caching: expected a bool, "
                f"got {self.enable_prefix_caching!r}"
            )

    def _check_kv_cache_dtype(self) -> None:
        if not isinstance(self.kv_cache_dtype, str) or (
                self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES):
            raise ValueError(f"CacheConfig.kv_cache_dtype: expected one of 'auto', "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.is_quantized and not hasattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype]):
            raise ValueError(f"CacheConfig.kv_cache_dtype={self.kv_cache_dtype!r} needs "
                             f"torch.{KV_CACHE_DTYPES[self.kv_cache_dtype]}, which torch "
                             f"{torch.__version__} lacks; use 'int8' or upgrade torch")
        if self.is_packed and self.head_dim % GROUP:
            raise ValueError(f"CacheConfig.head_dim: kv_cache_dtype={self.kv_cache_dtype!r} "
                             f"keeps a scale per {GROUP} values of a head: expected a multiple "
                             f"of {GROUP}, got {self.head_dim}")
        if not isinstance(self.kv_rotation, bool):
            raise ValueError(f"CacheConfig.kv_rotation: expected a bool, "
                             f"got {self.kv_rotation!r}")

    def _check_layer_kinds(self) -> None:
        kinds = self.layer_kinds
        if not isinstance(kinds, list | tuple) or not all(isinstance(k, LayerKind)
                                                        for k in kinds):
            raise ValueError(f"CacheConfig.layer_kinds: expected a tuple of LayerKind, "
                             f"got {kinds!r}")
        if kinds and len(kinds) != self.num_layers:
            raise ValueError(f"CacheConfig.layer_kinds: expected one per layer "
                             f"({self.num_layers}), got {len(kinds)}")
        # all full attention is the default layout: one spelling of it, so configs compare
        object.__setattr__(self, "layer_kinds",
                           () if all(k.is_full for k in kinds) else tuple(kinds))
        recurrent = sum(kind.is_recurrent for kind in kinds)
        if recurrent == len(kinds) and kinds:
            raise ValueError(f"CacheConfig.layer_kinds: {NO_RECURRENT_ONLY}")
        if recurrent and self.num_state_slots < 1:
            raise ValueError(f"CacheConfig.num_state_slots: {recurrent} recurrent layers keep "
                             f"their states in slots of the state slab: expected >= 1 "
                             f"(one per resident sequence, more for prefix checkpoints), "
                             f"got {self.num_state_slots}")
        if self.num_state_slots > MAX_STATE_SLOTS:
            raise ValueError(f"CacheConfig.num_state_slots: at most {MAX_STATE_SLOTS} (a "
                             f"checkpoint's rank holds its slot in 21 bits), got "
                             f"{self.num_state_slots}")
        if not recurrent and self.num_state_slots:
            raise ValueError(f"CacheConfig.num_state_slots: no recurrent layer keeps a state: "
                             f"expected 0, got {self.num_state_slots}")

    def kind_of(self, layer: int) -> LayerKind:
        """The `LayerKind` of `layer`."""
        return self.layer_kinds[layer] if self.layer_kinds else _FULL

    @property
    def is_quantized(self) -> bool:
        """Whether pages hold 8- or 4-bit codes with scales (`kv_cache_dtype` is not
        "auto")."""
        return self.kv_cache_dtype != "auto"

    @property
    def is_packed(self) -> bool:
        """Whether pages hold 4-bit codes, two a byte (`PACKED_FORMATS`)."""
        return self.kv_cache_dtype in PACKED_FORMATS

    @property
    def cache_dtype(self) -> torch.dtype:
        """Element type of the pages: `dtype`, the 8-bit type of `kv_cache_dtype`, or uint8
        (two 4-bit codes) for packed pages."""
        if not self.is_quantized:
            return self.dtype
        if self.is_packed:
            return torch.uint8
        return getattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype])

    @property
    def page_dim(self) -> int:
        """Page elements per head: `head_dim`, or ``head_dim // 2`` bytes when packed."""
        return self.head_dim // 2 if self.is_packed else self.head_dim

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Scales per (token, head): ``()`` for one (8-bit), ``(head_dim // GROUP,)`` when
        packed."""
        return (self.head_dim // GROUP,) if self.is_packed else ()

    @property
    def scale_dtype(self) -> torch.dtype:
        """The scales' dtype: `SCALE_DTYPE`, or float8_e4m3fn for nvfp4."""
        if self.kv_cache_dtype == "nvfp4":
            return torch.float8_e4m3fn
        return SCALE_DTYPE

    @property
    def element_size(self) -> int:
        """Bytes per page element (`cache_dtype`)."""
        return self.cache_dtype.itemsize

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep K/V per token (all but the recurrent ones)."""
        return self.num_layers - len(self.recurrent_layers)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state (`LayerKind.recurrent`), in order."""
        return tuple(layer for layer, kind in enumerate(self.layer_kinds) if kind.is_recurrent)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all attention layers, K and V (scales
        included); a recurrent layer keeps no bytes per token (`state_bytes_per_slot`)."""
        scales = math.prod(self.scale_shape) * self.scale_dtype.itemsize
        per_head = self.page_dim * self.element_size + (scales if self.is_quantized else 0)
        return 2 * self.num_attention_layers * self.num_kv_heads * per_head

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes of one slot of the state slab: every recurrent layer's states of one
        sequence (0 without recurrent layers)."""
        return sum(kind.state_bytes for kind in self.layer_kinds)

    @property
    def layer_groups(self) -> tuple[tuple[LayerKind, tuple[int, ...]], ...]:
        """The layers a block spans, as ``(kind, layers)`` groups (see `group_layers`): one
        group of every layer for a full-attention model; the recurrent layers, if any, in
        one last group that holds no blocks."""
        return group_layers(self.layer_kinds or (_FULL,) * self.num_layers)

    @property
    def group_size(self) -> int:
        """Layers one block holds: all of them for a uniform model, an attention group's
        for a hybrid one (each group of layers has its own block table; see
        `group_layers`)."""
        return len(self.layer_groups[0][1])

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across the layers it spans (`group_size`), K and V (scales
        included): the unit the pool hands out."""
        return (self.bytes_per_token * self.block_size * self.group_size
                // self.num_attention_layers)

    @property
    def state_bytes(self) -> int:
        """Bytes of the state slab: `num_state_slots` slots of `state_bytes_per_slot`."""
        return self.state_bytes_per_slot * self.num_state_slots

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole device pool (the null block included) and the state slab."""
        return self.bytes_per_block * self.num_blocks + self.state_bytes

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a sequence can hold: all but the null block."""
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (of one layer group)."""
        return -(-num_tokens // self.block_size)

    def blocks_for_sequence(self, num_tokens: int, step_tokens: int | None = None) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, over every layer
        group, when it gains at most `step_tokens` tokens a step (None: all at once).

        A full group holds a block per `block_size` tokens; a window (chunk) group only
        what its queries still read: the window (chunk) and the step's tokens, plus one
        block for alignment; the recurrent group none (its states are a slot of the state
        slab).

        Examples
        --------
        >>> cfg = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16,
        ...                   layer_kinds=(LayerKind.sliding(64), LayerKind()))
        >>> cfg.blocks_for_sequence(1024, step_tokens=1)  # 64 + 5 (4 + 1 for the window)
        69
        """
        full = self.blocks_for(num_tokens)
        step = num_tokens if step_tokens is None else min(step_tokens, num_tokens)
        return sum(full if kind.is_full else min(full, self.blocks_for(kind.span + step - 1)
                                                 + 1)
                   for kind, _ in self.layer_groups if not kind.is_recurrent)

    @classmethod
    def for_memory(cls, budget_bytes: int, *, num_layers: int, num_kv_heads: int,
                   head_dim: int, block_size: int = 16, **kwargs) -> CacheConfig:
        """Size `num_blocks` so the pool fits in `budget_bytes` (less the state slab's
        bytes, when `num_state_slots` is given).

        Examples
        --------
        >>> cfg = CacheConfig.for_memory(1 << 20, num_layers=2, num_kv_heads=4, head_dim=64,
        ...                              dtype=torch.float16)
        >>> cfg.num_blocks  # 1 MiB // 32 KiB per block
        32
        >>> CacheConfig.for_memory(1 << 20, num_layers=2, num_kv_heads=4, head_dim=64,
        ...                        dtype=torch.float16, kv_cache_dtype="int8").num_blocks
        62
        """
        probe = cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=block_size, num_blocks=2, **kwargs)
        num_blocks = math.floor((budget_bytes - probe.state_bytes) / probe.bytes_per_block)
        if num_blocks < 2:
            raise ValueError(
                f"CacheConfig.for_memory: budget_bytes={budget_bytes} holds {num_blocks} blocks "
                f"of {probe.bytes_per_block} bytes beside a state slab of {probe.state_bytes}; "
                f"at least 2 are needed (one is the null block)"
            )
        return dataclasses.replace(probe, num_blocks=num_blocks)


_FULL = LayerKind()
