"""`CacheConfig`: the one validated, frozen description of a paged KV cache's shape."""

from __future__ import annotations

import dataclasses
import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# page element type of each 8-bit format, by torch attribute name (float8 types are optional)
KV_CACHE_DTYPES = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
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
        beside them (see docs/architecture.md). `write` takes and `gather` / `attention`
        return `dtype` either way.

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

    def __post_init__(self) -> None:
        minimums = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "block_size": 1,
                    "num_blocks": 2, "num_host_blocks": 0, "max_num_seqs": 1}
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
        if not isinstance(self.kv_cache_dtype, str) or (
                self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES):
            raise ValueError(f"CacheConfig.kv_cache_dtype: expected one of 'auto', "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.is_quantized and not hasattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype]):
            raise ValueError(f"CacheConfig.kv_cache_dtype={self.kv_cache_dtype!r} needs "
                             f"torch.{KV_CACHE_DTYPES[self.kv_cache_dtype]}, which torch "
                             f"{torch.__version__} lacks; use 'int8' or upgrade torch")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"CacheConfig.enable_prefix_caching: expected a bool, "
                f"got {self.enable_prefix_caching!r}"
            )

    @property
    def is_quantized(self) -> bool:
        """Whether pages hold 8-bit values with scales (`kv_cache_dtype` is not "auto")."""
        return self.kv_cache_dtype != "auto"

    @property
    def cache_dtype(self) -> torch.dtype:
        """Element type of the pages: `dtype`, or the 8-bit type of `kv_cache_dtype`."""
        if not self.is_quantized:
            return self.dtype
        return getattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype])

    @property
    def element_size(self) -> int:
        """Bytes per page element (`cache_dtype`)."""
        return self.cache_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V (scales included)."""
        scale_bytes = SCALE_DTYPE.itemsize if self.is_quantized else 0
        per_head = self.head_dim * self.element_size + scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V (scales included): the unit the
        pool hands out."""
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole device pool (the null block included)."""
        return self.bytes_per_block * self.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a sequence can hold: all but the null block."""
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    @classmethod
    def for_memory(cls, budget_bytes: int, *, num_layers: int, num_kv_heads: int,
                   head_dim: int, block_size: int = 16, **kwargs) -> CacheConfig:
        """Size `num_blocks` so the pool fits in `budget_bytes`.

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
        num_blocks = math.floor(budget_bytes / probe.bytes_per_block)
        if num_blocks < 2:
            raise ValueError(
                f"CacheConfig.for_memory: budget_bytes={budget_bytes} holds {num_blocks} blocks "
                f"of {probe.bytes_per_block} bytes; at least 2 are needed (one is the null block)"
            )
        return dataclasses.replace(probe, num_blocks=num_blocks)
