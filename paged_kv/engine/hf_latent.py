"""A transformers model's multi-head latent attention (DeepSeek V2 / V3), on latent pages.

DeepSeek's attention compresses a token's keys and values into one latent row per layer:
``c`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the rotated rope key ``k_pe``
(``qk_rope_head_dim``), expanded per head by ``kv_b_proj``. The engine pages that row, not
the expansion: each such layer is a full-attention cache layer of one kv head of
``(R + P) / 2`` values whose K plane holds the row's first half and V plane its second
(`latent_pages` reads them back as one row), so everything page-level — prefix caching,
fork, preemption, swap, tiers, the hand-off, 8-bit pages — moves latents unchanged, and the
pool's bytes per token are the latent's.

Each attention module gets a forward of its own (on the instance, the weights its own): its
queries, latent and rotary exactly as the module computes them, the latent written to the
pages, then attention in the absorbed form (`paged_kv.kernels.latent.latent_attention`:
``q_nope W_UK`` against the latents, the weighted latent sum through ``W_UV``) for prefill
and decode alike, and ``o_proj``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import torch

from ..core.batch import StepBatch
from ..core.cache import PagedKVCache
from ..integrations.hf_architectures import LATENT_MODEL_TYPES
from ..integrations.hf_layers import ModelLayers
from ..integrations.hf_support import UnsupportedModelError
from ..kernels.latent import absorbed_weights, latent_attention
from .hf_recurrent import StepContext

__all__ = ["install_latent", "latent_pages"]

# (q_pe [1, H, T, P], k_pe [1, 1, T, P], position_embeddings) -> both rotated, same shapes
Rotary = Callable[[torch.Tensor, torch.Tensor, object], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class _Latent:
    """What a latent module's forward needs beyond the module (whose non-persistent buffers
    ``paged_kv_w_uk [H, qk_nope, R]`` and ``paged_kv_w_uv [H, R, v]`` hold its absorbed
    up-projections, `absorbed_weights`, so they move with the model): its cache layer and
    its rotary."""

    layer: int
    rotary: Rotary


def install_latent(model: torch.nn.Module, layers: ModelLayers, step: StepContext) -> int:
    """Give every latent attention module of `model` a forward over the packed step and the
    latent pages (see the module docstring); returns how many were given one (0 for a model
    type outside `LATENT_MODEL_TYPES`).

    Raises
    ------
    UnsupportedModelError
        A latent model whose attention modules are not all found (a cache layer without
        one would keep nothing).
    """
    model_type = getattr(model.config, "model_type", None)
    if model_type not in LATENT_MODEL_TYPES:
        return 0
    given: set[int] = set()
    for module in model.modules():
        if not (hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj")):
            continue
        layer = layers.cache_layers[module.layer_idx]
        w_uk, w_uv = absorbed_weights(module)
        # buffers, not attributes: a model moved to another device takes them along
        module.register_buffer("paged_kv_w_uk", w_uk, persistent=False)
        module.register_buffer("paged_kv_w_uv", w_uv, persistent=False)
        latent = _Latent(layer, _rotary(module, model_type))
        module.forward = functools.partial(_attend, module, latent, step)
        given.add(layer)
    missing = sorted(set(range(len(layers.kinds))) - given)
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}: cache layers {missing} have no latent attention module "
            "(kv_a_proj_with_mqa, kv_b_proj) the engine runs, so they would keep nothing",
            [f"layers {missing} without a latent attention module"])
    return len(given)


def _rotary(module: torch.nn.Module, model_type: str) -> Rotary:
    """The rotary the module's own modeling code applies (the same function, so the rope
    keys are stored exactly as it rotates them): V2's complex ``freqs_cis``; V3's
    ``rope_interleave`` (de-interleaved pairs out) or plain ``rotate_half``."""
    modeling = sys.modules[type(module).__module__]
    if model_type == "deepseek_v2":
        return modeling.apply_rotary_emb
    apply = (modeling.apply_rotary_pos_emb_interleave if module.config.rope_interleave
             else modeling.apply_rotary_pos_emb)
    return lambda q, k, embeddings: apply(q, k, *embeddings)


def latent_pages(cache: PagedKVCache, layer: int, batch: StepBatch,
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor],
                            tuple[torch.Tensor, torch.Tensor] | None, StepBatch]:
    """One latent layer's pages as `latent_attention` reads them.

    Returns
    -------
    pages : (torch.Tensor, torch.Tensor)
        The layer's K and V planes ``[num_blocks, block_size, (R + P) / 2]`` each (views,
        their one head squeezed): a token's latent row is the K half then the V half.
    scales : (torch.Tensor, torch.Tensor) or None
        Their ``[num_blocks, block_size]`` scales with 8-bit pages, else None.
    batch : StepBatch
        The batch whose block tables name the layer's blocks.
    """
    # one layer group (DeepSeek's layers are all full attention): layer i is the pool's
    # plane i, named by the step's own block tables; a layout of several groups keeps a
    # layer in its group's plane, which only the cache knows
    if len(cache.config.layer_groups) != 1:
        raise ValueError(f"latent pages: the cache has {len(cache.config.layer_groups)} layer "
                         f"groups; latent layers are served in a cache of one")
    if cache.config.is_packed or cache.config.kv_rotation:
        # latent_attention reads one 8-bit scale per row and unrotated rows
        raise ValueError(f"latent pages: kv_cache_dtype={cache.config.kv_cache_dtype!r}, "
                         f"kv_rotation={cache.config.kv_rotation}: latent layers are served "
                         f"on float or 8-bit pages without rotation")
    key, value = cache.pool.layer(layer)
    key_scales, value_scales = cache.pool.layer_scales(layer)
    scales = None if key_scales is None else (key_scales[..., 0], value_scales[..., 0])
    return (key[:, :, 0], value[:, :, 0]), scales, batch


def _attend(module: torch.nn.Module, latent: _Latent, step: StepContext,
            hidden_states: torch.Tensor, *args: object,
            position_embeddings: object = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """The module's forward on the packed step: ``[1, T, hidden] -> ([1, T, hidden], None)``;
    the mask and transformers' cache the decoder layer passes have no use here (the pages
    are the cache, and `latent_attention` is causal per sequence)."""
    cache, batch = step.cache, step.batch
    if cache is None or batch is None:
        raise RuntimeError(f"{type(module).__name__} runs only inside HFCausalLM.forward "
                           "(its latents are in the paged cache)")
    if position_embeddings is None and args:  # V3's forward takes it second, by position
        position_embeddings = args[0]
    x = hidden_states[0]  # [T, hidden]
    tokens, heads = x.shape[0], module.num_heads
    nope, rope, rank = module.qk_nope_head_dim, module.qk_rope_head_dim, module.kv_lora_rank
    q = (module.q_proj(x) if module.q_lora_rank is None
         else module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x))))
    q_nope, q_pe = q.view(tokens, heads, nope + rope).split([nope, rope], dim=-1)
    c, k_pe = module.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
    c = module.kv_a_layernorm(c)
    # the rotary functions take transformers' [batch, heads, seq, dim]
    q_pe, k_pe = latent.rotary(q_pe.transpose(0, 1)[None], k_pe[None, None],
                               position_embeddings)
    row = torch.cat([c, k_pe[0, 0].to(c.dtype)], dim=-1)  # [T, R + P]: the page row
    half = row.shape[1] // 2
    cache.write(latent.layer, row[:, None, :half].contiguous(), row[:, None, half:].contiguous(),
                batch)
    pages, scales, batch = latent_pages(cache, latent.layer, batch)
    # absorbed: q_latent_h = q_nope_h W_UK_h, so the scores read the latents as they are
    q_latent = torch.einsum("thn,hnr->thr", q_nope, module.paged_kv_w_uk)
    out = latent_attention(q_latent, q_pe[0].transpose(0, 1).contiguous().to(q_latent.dtype),
                           pages, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                           module.scaling, scales=scales)  # [T, H, R]
    out = torch.einsum("thr,hrv->thv", out, module.paged_kv_w_uv).reshape(tokens, -1)
    step.ran.add(latent.layer)
    return module.o_proj(out)[None], None
