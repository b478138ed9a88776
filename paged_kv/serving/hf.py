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

from ..cache import PagedKVCache
from ..config import CacheConfig
from ..integrations.hf_support import (
    UnsupportedModelError,
    loaded_model_features,
    require_supported,
    unsupported_features,
)
from ..page_table import StepBatch

ATTN_IMPLEMENTATION = "paged_kv"


def _paged_kv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query (1, Hq, N, D)``, ``key/value (1, Hkv, N, D)``
    -> ``(1, N, Hq, D)``, through ``paged_kv_cache`` and ``paged_kv_batch`` in `kwargs`."""
    _refuse_unimplemented(module, kwargs)
    cache: PagedKVCache = kwargs["paged_kv_cache"]
    batch: StepBatch = kwargs["paged_kv_batch"]
    layer = module.layer_idx
    cache.write(layer, key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(),
                batch)
    out = cache.attention(layer, query[0].transpose(0, 1).contiguous(), batch, scale=scaling)
    return out[None], None


def _refuse_unimplemented(module: torch.nn.Module, kwargs: dict) -> None:
    """The last guard against wrong tokens: a layer that asks the attention function for a
    window, a soft-cap or sinks the kernels do not compute (a model the config check did not
    know) fails its step instead of attending to everything."""
    window = kwargs.get("sliding_window")
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    asked = [f"{name}={kwargs[name]!r}" for name in ("softcap", "s_aux", "sinks")
             if kwargs.get(name) is not None]
    if window is not None and (limit is None or window < limit):
        asked.append(f"sliding_window={window}")
    if asked:
        raise UnsupportedModelError(
            f"layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__} asks the "
            f"paged attention for {', '.join(asked)}, which its kernels do not implement")


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
        A decoder-only model whose attention modules dispatch through
        ``config._attn_implementation`` (Llama, Mistral, Qwen2 and most others).

    Attributes
    ----------
    eos_token_ids : tuple of int
        The checkpoint's ``generation_config.eos_token_id`` (one id or several; the model
        config's when there is no generation config): the engine stops a sequence at them.

    Raises
    ------
    UnsupportedModelError
        A ValueError: the model asks for attention the paged kernels do not implement — a
        sliding window, chunked or linear layers, soft-capped attention logits, learned
        sinks — and would be served wrong tokens (see `paged_kv.integrations.hf_support`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        require_supported(model.config, type(self).__name__,
                          unsupported_features(model.config) + loaded_model_features(model))
        _register()
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        self.model = model.eval()
        hf = model.config
        self.name = f"{type(model).__name__} ({getattr(hf, 'name_or_path', '') or 'local'})"
        self.config = _ModelLimits(hf.vocab_size, hf.max_position_embeddings)
        self.kv_shape = (hf.num_hidden_layers, getattr(hf, "num_key_value_heads", None)
                          or hf.num_attention_heads,
                          getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
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
            A ValueError: the config asks for attention the kernels do not implement (a
            window, chunked or linear layers, soft-capped logits, sinks), checked before
            any weight is read.
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
        """The `CacheConfig` whose K/V shape matches the model."""
        num_layers, num_kv_heads, head_dim = self.kv_shape
        fields = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, num_blocks=num_blocks, dtype=self.model.dtype)
        fields.update(overrides)
        return CacheConfig(**fields)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: StepBatch, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One step: ``[N]`` tokens and positions -> ``[len(logits_indices), vocab]`` logits."""
        if logits_indices is None:
            logits_indices = torch.arange(token_ids.shape[0])
        output = self.model(input_ids=token_ids[None], position_ids=positions[None],
                            use_cache=False, logits_to_keep=logits_indices,
                            paged_kv_cache=cache, paged_kv_batch=batch)
        return output.logits[0].float()


def check_checkpoint(path: str | Path) -> None:
    """Refuse a local checkpoint whose config asks for attention the paged kernels do not
    implement, reading only its ``config.json`` (no weights).

    Raises
    ------
    UnsupportedModelError
        Naming the model type and each setting (a ValueError).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    require_supported(config, f"model {Path(path).name!r}")


def _eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """``eos_token_id`` of the generation config (else the model config): None, int or list."""
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, list | tuple) else [eos]))
