"""`TinyLlama`: a small Llama-style decoder with seeded random weights, defined here.

RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP; its attention runs
through `PagedKVCache.write` + `PagedKVCache.attention`. `forward_dense` runs the same
weights over a whole sequence with no cache: the reference every cached run is checked
against.

Layers may be hybrid, as the open models are: each full attention, a sliding window
(Mistral, Gemma, gpt-oss) or chunked-local (Llama 4), optionally with learned attention
sinks (gpt-oss) and logit soft-capping (Gemma 2). The default config has none of them and is
the same model, weight for weight, as before they existed.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..config import CacheConfig, LayerKind
from ..core.batch import StepBatch
from ..core.cache import PagedKVCache

# the dimensions, each > 0
_SIZES = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
          "intermediate_size", "vocab_size", "rope_theta", "max_position", "rms_norm_eps")
_KIND_SPELLING = "'full', 'sliding:W' or 'chunked:C' (W, C >= 1 tokens)"


def parse_layer_kind(text: str | LayerKind) -> LayerKind:
    """The `LayerKind` a string names: ``"full"``, ``"sliding:W"`` or ``"chunked:C"``.

    Examples
    --------
    >>> parse_layer_kind("sliding:8").window, parse_layer_kind("full").is_full
    (8, True)
    """
    if isinstance(text, LayerKind):
        return text
    if not isinstance(text, str):
        raise ValueError(f"expected {_KIND_SPELLING}, got {text!r}")
    attention, _, span = text.partition(":")
    if attention == "full" and not span:
        return LayerKind.full()
    if attention not in ("sliding", "chunked") or not span.isdigit():
        raise ValueError(f"expected {_KIND_SPELLING}, got {text!r}")
    try:
        return LayerKind(attention, int(span))
    except ValueError as error:
        raise ValueError(f"expected {_KIND_SPELLING}, got {text!r} ({error})") from None


@dataclasses.dataclass(frozen=True)
class TinyLlamaConfig:
    """Dimensions of `TinyLlama` (the default runs fast on 2 CPU cores), and its layer kinds.

    Parameters
    ----------
    layer_kinds : tuple of str
        One per layer: ``"full"``, ``"sliding:W"`` (the last W tokens, the query's own
        included) or ``"chunked:C"`` (its own aligned chunk of C tokens); `LayerKind` values
        are accepted and stored as these strings. Empty (the default) or all ``"full"`` is
        the plain model, and is stored as ``()`` so both spellings compare equal.
    sinks : bool
        Each layer gets a learned attention-sink logit per query head (gpt-oss), seeded
        like the other weights and drawn after them (the other weights stay the same).
    softcap : float
        Attention-logit soft-cap of every layer (Gemma 2's ``softcap * tanh(s / softcap)``
        of the scaled scores); 0 for none.
    """

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
    layer_kinds: tuple[str, ...] = ()
    sinks: bool = False
    softcap: float = 0.0

    def __post_init__(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"TinyLlamaConfig.{name}: expected > 0, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyLlamaConfig.num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        self._check_layer_kinds()
        if not isinstance(self.sinks, bool):
            raise ValueError(f"TinyLlamaConfig.sinks: expected a bool, got {self.sinks!r}")
        softcap = self.softcap
        if (isinstance(softcap, bool) or not isinstance(softcap, int | float)
                or not math.isfinite(softcap) or softcap < 0):
            raise ValueError(f"TinyLlamaConfig.softcap: expected a finite float >= 0 "
                             f"(0 = off), got {softcap!r}")

    def _check_layer_kinds(self) -> None:
        kinds = self.layer_kinds
        if not isinstance(kinds, list | tuple):
            raise ValueError(f"TinyLlamaConfig.layer_kinds: expected a tuple of {_KIND_SPELLING}"
                             f" strings, one per layer, got {kinds!r}")
        if kinds and len(kinds) != self.num_layers:
            raise ValueError(f"TinyLlamaConfig.layer_kinds: expected one per layer "
                             f"({self.num_layers}), got {len(kinds)}")
        parsed = []
        for index, kind in enumerate(kinds):
            try:
                parsed.append(parse_layer_kind(kind))
            except ValueError as error:
                raise ValueError(f"TinyLlamaConfig.layer_kinds[{index}]: {error}") from None
        # one spelling per model (as CacheConfig's): strings, and () for all full attention
        object.__setattr__(self, "layer_kinds", () if all(k.is_full for k in parsed)
                           else tuple(str(k) for k in parsed))

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """The layers' `LayerKind` values as `CacheConfig.layer_kinds` spells them (empty
        when every layer is full attention)."""
        return tuple(parse_layer_kind(kind) for kind in self.layer_kinds)

    def kind_of(self, layer: int) -> LayerKind:
        """The `LayerKind` of `layer`."""
        return parse_layer_kind(self.layer_kinds[layer]) if self.layer_kinds else LayerKind()


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
        if config.sinks:  # drawn last: every other weight is the sink-free model's
            for layer in self.layers:
                layer.sinks = torch.nn.Parameter(
                    torch.randn(config.num_heads, generator=generator), requires_grad=False)
        inv_freq = config.rope_theta ** (-torch.arange(0, config.head_dim, 2) / config.head_dim)
        angles = torch.outer(torch.arange(config.max_position).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # (max_position, D/2)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def cache_config(self, num_blocks: int = 1024, block_size: int = 16,
                     **overrides) -> CacheConfig:
        """The `CacheConfig` whose K/V shape and layer kinds match this model; `overrides`
        set any other field, e.g. ``kv_cache_dtype="int8"`` for 8-bit pages."""
        fields = dict(num_layers=self.config.num_layers, num_kv_heads=self.config.num_kv_heads,
                      head_dim=self.config.head_dim, block_size=block_size,
                      num_blocks=num_blocks, dtype=torch.float32,
                      layer_kinds=self.config.kinds)
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

    def _attention_options(self, cache: PagedKVCache) -> dict:
        """`cache.attention`'s sinks / soft-cap keywords common to every layer (none for a
        model without them, so its calls stay as they were); ValueError unless the cache
        was built for this model's layer kinds (full attention over a window layer's cache,
        or the reverse, would give wrong tokens silently)."""
        c = self.config
        if cache.config.layer_kinds != c.kinds:
            raise ValueError(f"TinyLlama: the cache's layer_kinds "
                             f"{[str(k) for k in cache.config.layer_kinds]} are not the "
                             f"model's {list(c.layer_kinds)} (build the cache from "
                             f"model.cache_config())")
        if c.sinks:
            for index, layer in enumerate(self.layers):
                if layer.sinks.shape != (c.num_heads,):  # a shard must keep its heads' sinks
                    raise ValueError(f"TinyLlama layer {index}: {layer.sinks.shape[0]} sink "
                                     f"logits for {c.num_heads} query heads")
        return {"softcap": c.softcap} if c.softcap else {}

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
        options = self._attention_options(cache)
        x = self.embed[token_ids]  # (T, hidden)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            cache.write(index, k.contiguous(), v.contiguous(), batch)
            if self.config.sinks:
                options["sinks"] = layer.sinks
            attended = cache.attention(index, q.contiguous(), batch, **options)  # (T, Hq, D)
            x = x + self.reduce(attended.reshape(x.shape[0], -1) @ layer.out.T)
            x = x + self._mlp(layer, x)
        if logits_indices is not None:
            x = x[logits_indices]
        return self._rms_norm(x, self.norm) @ self.lm_head.T

    @torch.no_grad()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The same model over a whole sequence with no cache: ``[T]`` -> ``[T, vocab]``.

        Plain layers run SDPA's causal attention; hybrid ones (a window, a chunk, sinks or a
        soft-cap) run `_dense_attention`'s explicit float32 softmax, written from the
        definitions and independent of the kernels."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        self._check_tokens(token_ids)
        positions = torch.arange(token_ids.shape[0])
        x = self.embed[token_ids]
        plain = not (self.config.layer_kinds or self.config.sinks or self.config.softcap)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            if plain:
                attended = F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                    enable_gqa=True).transpose(0, 1)  # (T, Hq, D)
            else:
                attended = self._dense_attention(index, q, k, v)
            x = x + attended.reshape(x.shape[0], -1) @ layer.out.T
            x = x + self._mlp(layer, x)
        return self._rms_norm(x, self.norm) @ self.lm_head.T

    def _dense_attention(self, index: int, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s attention over ``q (T, Hq, D)``, ``k, v (T, Hkv, D)``: scaled
        scores, soft-capped, masked to what each query sees, a float32 softmax whose
        denominator also holds ``exp(sink)`` of each head (gpt-oss), ``(T, Hq, D)`` out."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * c.head_dim ** -0.5
        if c.softcap:
            scores = c.softcap * torch.tanh(scores / c.softcap)
        visible = visible_keys(c.kind_of(index), q.shape[0])  # (T, T)
        scores = scores.masked_fill(~visible, float("-inf"))  # (Hq, T, T)
        if c.sinks:  # a column every query attends to, holding nothing
            sink = self.layers[index].sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :q.shape[0]]
        return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def visible_keys(kind: LayerKind, length: int) -> torch.Tensor:
    """``[length, length]`` bool: whether query ``i`` sees key ``j`` under `kind` (causal;
    sliding window W: ``i - W < j``; chunked C: ``j // C == i // C``)."""
    position = torch.arange(length)
    query, key = position[:, None], position[None, :]
    visible = key <= query
    if kind.window:
        visible &= key > query - kind.window
    if kind.chunk:
        visible &= key // kind.chunk == query // kind.chunk
    return visible
