"""`CacheConfig`: the one validated, frozen description of a paged KV cache's shape."""

from __future__ import annotations

import dataclasses
import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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

    Examples
    --------
    >>> cfg = CacheConfig(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16,
    ...                   num_blocks=128, dtype=torch.float16)
    >>> cfg.bytes_per_block  # 2 layers * 2 (K, V) * 16 tokens * 4 heads * 64 * 2 bytes
    32768
    >>> cfg.bytes_per_token
    2048
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
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"CacheConfig.enable_prefix_caching: expected a bool, "
                f"got {self.enable_prefix_caching!r}"
            )

    @property
    def element_size(self) -> int:
        """Bytes per element of `dtype`."""
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V: the unit the pool hands out."""
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
