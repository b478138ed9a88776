"""`TinyLlama`: a small Llama-style decoder with seeded random weights, defined here.

RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP; its attention runs
through `PagedKVCache.write` + `PagedKVCache.attention`. `forward_dense` runs the same
weights over a whole sequence with no cache: the reference every cached run is checked
against.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..cache import PagedKVCache
from ..config import CacheConfig
from ..page_table import StepBatch


@dataclasses.dataclass(frozen=True)
class TinyLlamaConfig:
    """Dimensions of `TinyLlama` (the default runs fast on 2 CPU cores)."""

    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    hidden_size: int = 256
    intermediate_size: int = 512
    vocab_size: int = 2048
    rope_theta: float = 10000.0
    max_position: int = 4096
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value <= 0:
                raise ValueError(f"TinyLlamaConfig.{field.name}: expected > 0, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyLlamaConfig.num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class TinyLlama(torch.nn.Module):
    """A Llama-style decoder whose attention reads and writes a paged KV cache.

    Parameters
    ----------
    config : TinyLlamaConfig, optional
    seed : int
        Seed of the random weights.

    Examples
    --------
    >>> model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
    ...                                   vocab_size=50, num_heads=4, head_dim=16))
    >>> model.forward_dense(torch.tensor([1, 2, 3])).shape
    torch.Size([3, 50])
    """

    def __init__(self, config: TinyLlamaConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config = config or TinyLlamaConfig()
        self.seed = seed
        # sums the partial outputs of the row-parallel projections across tensor-parallel
        # ranks (see `serving.parallel`); the identity in one process
        self.reduce = _identity
        generator = torch.Generator().manual_seed(seed)

        def weight(*shape: int) -> torch.nn.Parameter:
            scale = shape[-1] ** -0.5
            return torch.nn.Parameter(torch.randn(*shape, generator=generator) * scale,
                                      requires_grad=False)

        hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        self.embed = weight(config.vocab_size, hidden)
        self.layers = torch.nn.ModuleList()
        for _ in range(config.num_layers):
            layer = torch.nn.Module()
            layer.qkv = weight(q_dim + 2 * kv_dim, hidden)
            layer.out = weight(hidden, q_dim)
            layer.gate_up = weight(2 * config.intermediate_size, hidden)
            layer.down = weight(hidden, config.intermediate_size)
            layer.norm1 = torch.nn.Parameter(torch.ones(hidden), requires_grad=False)
            layer.norm2 = torch.nn.Parameter(torch.ones(hidden), requires_grad=False)
            self.layers.append(layer)
        self.norm = torch.nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.lm_head = weight(config.vocab_size, hidden)
        inv_freq = config.rope_theta ** (-torch.arange(0, config.head_dim, 2) / config.head_dim)
        angles = torch.outer(torch.arange(config.max_position).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # (max_position, D/2)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def cache_config(self, num_blocks: int = 1024, block_size: int = 16,
                     **overrides) -> CacheConfig:
        """The `CacheConfig` whose K/V shape matches this model; `overrides` set any other
        field, e.g. ``kv_cache_dtype="int8"`` for 8-bit pages."""
        fields = dict(num_layers=self.config.num_layers, num_kv_heads=self.config.num_kv_heads,
                      head_dim=self.config.head_dim, block_size=block_size,
                      num_blocks=num_blocks, dtype=torch.float32)
        fields.update(overrides)
        return CacheConfig(**fields)

    # -- shared pieces -----------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_norm_eps) * weight

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x (T, heads, D)`` at ``positions (T,)``, half-split layout."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def _qkv(self, layer: torch.nn.Module, x: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        q, k, v = (self._rms_norm(x, layer.norm1) @ layer.qkv.T).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            dim=-1)
        q = self._rotate(q.view(-1, c.num_heads, c.head_dim), positions)
        k = self._rotate(k.view(-1, c.num_kv_heads, c.head_dim), positions)
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def _mlp(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = (self._rms_norm(x, layer.norm2) @ layer.gate_up.T).chunk(2, dim=-1)
        return self.reduce((F.silu(gate) * up) @ layer.down.T)

    def _check_tokens(self, token_ids: torch.Tensor) -> None:
        if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got "
                             f"[{int(token_ids.min())}, {int(token_ids.max())}]")

    # -- the two forwards ------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: StepBatch, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One step over a batch's new tokens, reading and writing the paged cache.

        Parameters
        ----------
        token_ids, positions : torch.Tensor
            ``[batch.num_tokens]`` int64: the new tokens and their positions in their
            sequences, in the batch's token order.
        cache : PagedKVCache
        batch : StepBatch
            From ``cache.prepare`` for these tokens.
        logits_indices : torch.Tensor, optional
            ``[num_rows]`` int64 rows of the step whose logits are wanted (default all).

        Returns
        -------
        torch.Tensor
            ``[num_rows, vocab_size]`` float32 logits.
        """
        self._check_tokens(token_ids)
        x = self.embed[token_ids]  # (T, hidden)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            cache.write(index, k.contiguous(), v.contiguous(), batch)
            attended = cache.attention(index, q.contiguous(), batch)  # (T, Hq, D)
            x = x + self.reduce(attended.reshape(x.shape[0], -1) @ layer.out.T)
            x = x + self._mlp(layer, x)
        if logits_indices is not None:
            x = x[logits_indices]
        return self._rms_norm(x, self.norm) @ self.lm_head.T

    @torch.no_grad()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The same model over a whole sequence with no cache: ``[T]`` -> ``[T, vocab]``."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        self._check_tokens(token_ids)
        positions = torch.arange(token_ids.shape[0])
        x = self.embed[token_ids]
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            attended = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                enable_gqa=True).transpose(0, 1)  # (T, Hq, D)
            x = x + attended.reshape(x.shape[0], -1) @ layer.out.T
            x = x + self._mlp(layer, x)
        return self._rms_norm(x, self.norm) @ self.lm_head.T
