"""Serve a Hugging Face causal LM from a local directory, its attention on the paged cache.

The model's own attention modules compute Q/K/V and rotary positions; a registered
attention function (``attn_implementation="paged_kv"``) then writes K/V into the paged pool
and attends from the pages, so transformers' attention cache is never used. A step's tokens
of all sequences run as one packed row; each token's position comes from ``position_ids``.
Needs the ``hf`` extra.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import CacheConfig, LayerKind
from ..core.batch import StepBatch
from ..core.cache import PagedKVCache
from ..integrations.hf_architectures import latent_head_dim, require_served
from ..integrations.hf_layers import KEY_ONLY_HEAD_DIM, model_layers
from ..integrations.hf_support import UnsupportedModelError
from .hf_latent import install_latent
from .hf_recurrent import StepContext, install_mixers

ATTN_IMPLEMENTATION = "paged_kv"
# state slots of a model with recurrent layers when its cache config names none: the live
# states of the engine's default 64 sequences, as many again for prefix-cache checkpoints
DEFAULT_STATE_SLOTS = 128
# the positions a model without a position limit (recurrent layers only) takes a sequence to
NO_POSITION_LIMIT = 1 << 17


def _paged_kv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query (1, Hq, N, D)``, ``key/value (1, Hkv, N, D)``
    -> ``(1, N, Hq, D)``, through ``paged_kv_cache`` and ``paged_kv_batch`` in `kwargs`.

    The layer's window or chunk is the cache's `LayerKind` for it (the attention mask
    transformers built is not read); the sinks (gpt-oss's ``s_aux``) and the soft-cap (Gemma
    2's ``softcap``) are what the model passes, as its own attention functions take them.
    """
    cache: PagedKVCache = kwargs["paged_kv_cache"]
    batch: StepBatch = kwargs["paged_kv_batch"]
    step: StepContext = kwargs["paged_kv_step"]
    layer = kwargs["paged_kv_cache_layers"][module.layer_idx]  # its layer of the cache
    _check_window(module, layer, cache.config.kind_of(layer), kwargs.get("sliding_window"))
    step.ran.add(layer)
    cache.write(layer, key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(),
                batch)
    out = cache.attention(layer, query[0].transpose(0, 1).contiguous(), batch, scale=scaling,
                          sinks=_sinks(module, kwargs), softcap=kwargs.get("softcap") or 0.0)
    return out[None], None


def _sinks(module: torch.nn.Module, kwargs: dict) -> torch.Tensor | None:
    """The layer's learned sink logits ``[num_q_heads]``: what the model passes (gpt-oss:
    ``s_aux``), else a ``sinks`` parameter of the module (which gpt-oss's eager attention
    reads directly)."""
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def _check_window(module: torch.nn.Module, layer: int, kind: LayerKind,
                  asked: int | None) -> None:
    """The last guard against wrong tokens: the window a layer asks the attention function
    for (``sliding_window``) must be the window the cache serves that layer with. A window
    at least ``max_position_embeddings`` long never cuts a sequence and counts as none."""
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    window = asked if asked and (limit is None or asked < limit) else 0
    if window != kind.window:
        raise UnsupportedModelError(
            f"layer {layer} of {type(module).__name__} asks the paged attention for "
            f"sliding_window={asked!r}, but the cache serves that layer as {kind} "
            f"(window {kind.window}): its config and its modules disagree on the layer's kind")


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_kv_attention)


@dataclasses.dataclass(frozen=True)
class _ModelLimits:
    vocab_size: int
    max_position: int


class HFCausalLM(torch.nn.Module):
    """A transformers causal LM behind the interface `Engine` drives.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only model of a model type the engine serves
        (`paged_kv.integrations.hf_architectures.SERVED_MODEL_TYPES`: Llama, Mistral, Qwen2,
        Gemma, gpt-oss and about a hundred others, each checked against ``generate``;
        hybrids with recurrent layers; DeepSeek V2 / V3's latent attention, paged as the
        latent: `paged_kv.engine.hf_latent`).

    Attributes
    ----------
    kv_shape : (int, int, int)
        ``(num_layers, num_kv_heads, head_dim)`` of the pages: a latent model's is ``(layers,
        1, (kv_lora_rank + qk_rope_head_dim) / 2)``, each token's latent row in two halves.
    num_latent : int
        Latent attention layers (0 for any other model).
    eos_token_ids : tuple of int
        The checkpoint's ``generation_config.eos_token_id`` (one id or several; the model
        config's when there is no generation config): the engine stops a sequence at them.

    Raises
    ------
    UnsupportedModelError
        A ValueError: the model has layers paged_kv does not serve — cross-attention, an
        unknown layer type, keys and values of other head dims outside the latent model
        types, a sparse indexer — or is of a model type the engine does not serve, and would be
        served wrong tokens or fail every step (see `paged_kv.integrations.hf_support` and
        `hf_architectures`). Full, sliding-window and chunked layers, attention sinks and
        soft-capped logits are served.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        require_served(model.config, type(self).__name__)
        layers = model_layers(model.config, model.dtype)
        self.layer_kinds = layers.kinds
        # model layer -> the cache layer its attention writes (a layer that keeps nothing
        # has none; a hybrid layer's state is in another, `layers.state_layers`)
        self.cache_layers = layers.cache_layers
        self._step = StepContext()
        self.num_recurrent = install_mixers(model, layers, self._step)
        # latent attention layers (DeepSeek V2 / V3): one kv head of half a latent row
        self.num_latent = install_latent(model, layers, self._step)
        _register()
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        self.model = model.eval()
        hf = model.config
        self.name = f"{type(model).__name__} ({getattr(hf, 'name_or_path', '') or 'local'})"
        # a model of recurrent layers only has no position limit of its own
        self.config = _ModelLimits(hf.vocab_size, getattr(hf, "max_position_embeddings", None)
                                   or NO_POSITION_LIMIT)
        # the key-only layer of a model of recurrent layers only: no model layer runs it
        self.key_only = layers.key_only
        self.kv_shape = ((len(self.layer_kinds), 1, latent_head_dim(hf)) if self.num_latent
                         else (len(self.layer_kinds), 1, KEY_ONLY_HEAD_DIM)
                         if self.key_only is not None
                         else (len(self.layer_kinds), getattr(hf, "num_key_value_heads", None)
                               or hf.num_attention_heads,
                               getattr(hf, "head_dim", None)
                               or hf.hidden_size // hf.num_attention_heads))
        self.eos_token_ids = _eos_token_ids(model)
        self.path: str | None = None  # set by from_pretrained: workers load the same files

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> HFCausalLM:
        """Load a checkpoint from a local directory (never downloads).

        Raises
        ------
        FileNotFoundError
            `path` is not a local directory.
        UnsupportedModelError
            A ValueError: the config has layers paged_kv does not serve (cross-attention,
            an unknown layer type, a sparse indexer) or a model type the
            engine does not serve, checked before any weight is read.
        """
        from transformers import AutoModelForCausalLM

        if not Path(path).is_dir():
            raise FileNotFoundError(f"model path {str(path)!r} is not a local directory")
        check_checkpoint(path)
        _register()
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                     attn_implementation=ATTN_IMPLEMENTATION)
        loaded = cls(model)
        loaded.path = str(path)
        return loaded

    def cache_config(self, num_blocks: int = 1024, block_size: int = 16,
                     **overrides) -> CacheConfig:
        """The `CacheConfig` whose K/V shape and layer kinds (`layer_kinds`) match the model.

        A model with recurrent layers gets `DEFAULT_STATE_SLOTS` state slots unless
        ``num_state_slots`` is among `overrides` (live states of running sequences, the
        rest prefix-cache checkpoints)."""
        num_layers, num_kv_heads, head_dim = self.kv_shape
        fields = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, num_blocks=num_blocks, dtype=self.model.dtype,
                      layer_kinds=self.layer_kinds,
                      num_state_slots=DEFAULT_STATE_SLOTS if self.num_recurrent else 0)
        fields.update(overrides)
        return CacheConfig(**fields)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: StepBatch, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One step: ``[N]`` tokens and positions -> ``[len(logits_indices), vocab]`` logits."""
        if logits_indices is None:
            logits_indices = torch.arange(token_ids.shape[0])
        step = self._step
        step.open(cache, batch)
        try:
            output = self.model(input_ids=token_ids[None], position_ids=positions[None],
                                use_cache=False, logits_to_keep=logits_indices,
                                paged_kv_cache=cache, paged_kv_batch=batch,
                                paged_kv_step=step, paged_kv_cache_layers=self.cache_layers)
            ran = step.ran | ({self.key_only} if self.key_only is not None else set())
        finally:
            step.close()
        if len(ran) != cache.config.num_layers:
            # a cache layer that never reached the attention function nor a mixer kept no
            # state of the past: its logits would be wrong tokens
            missing = sorted(set(range(cache.config.num_layers)) - ran)
            raise UnsupportedModelError(
                f"{self.name}: layers {missing} did not attend through the paged cache (not "
                "attention layers, or attention that does not dispatch through "
                "config._attn_implementation), so the model cannot be served from it")
        return output.logits[0].float()


def check_checkpoint(path: str | Path) -> None:
    """Refuse a local checkpoint whose config has layers paged_kv does not serve, or whose
    model type the engine does not serve (`hf_architectures.require_served`), reading only
    its ``config.json`` (no weights).

    Raises
    ------
    UnsupportedModelError
        Naming the model type and each setting (a ValueError).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    require_served(config, f"model {Path(path).name!r}")


def _eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """``eos_token_id`` of the generation config (else the model config): None, int or list."""
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, list | tuple) else [eos]))
