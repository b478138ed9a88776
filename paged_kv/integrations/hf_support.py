"""What of a transformers model's attention paged_kv implements, read from its config.

paged_kv's attention serves every layer kind of `paged_kv.config.LayerKind` — full
attention, a sliding window, chunked local attention — with learned attention sinks and
soft-capped logits on any of them. `layer_kinds` maps a config's ``layer_types`` (or its
``sliding_window`` / ``attention_chunk_size`` when it has none) to those kinds. A model
whose layers ask for more — linear (recurrent, Mamba) layers, cross-attention,
bidirectional attention, a layer type this module does not know, keys and values of head
dims other than the pages' one ``head_dim`` (DeepSeek's multi-head latent attention, which
the engine alone serves, paging the latent: ``unsupported_features(latent=True)``), shapes
that vary by layer — would be served wrong tokens or fail every step, so it is refused by
name (`require_supported`). The engine refuses more, by model type
(`paged_kv.integrations.hf_architectures`): what a config does not say.

Only the config is read (no weights), so the command line refuses a checkpoint before it
loads one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..config import LayerKind

__all__ = ["UnsupportedModelError", "layer_kinds", "require_supported",
           "unsupported_features", "window_of"]

# transformers' `layer_types` names of the layer kinds paged_kv serves, by LayerKind.attention
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding",
               "chunked_attention": "chunked"}
# the legacy spellings transformers still reads (configuration_utils._LEGACY_LAYER_TYPE_REMAP)
LEGACY_LAYER_TYPES = {"attention": "full_attention"}
# settings that decide a layer's K/V shape or its kind, or skip its attention: transformers'
# per_layer_config may vary them, paged_kv's pool and layer kinds have one of each
PER_LAYER_ATTENTION_SETTINGS = ("head_dim", "num_key_value_heads", "num_attention_heads",
                                "v_head_dim", "sliding_window", "attention_chunk_size",
                                "layer_types", "skip")


class UnsupportedModelError(ValueError):
    """A model asks for attention paged_kv does not implement (it would be served wrong
    tokens): the message names the model type and each unsupported setting or layer type,
    and `features` lists those settings."""

    def __init__(self, message: str, features: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.features = list(features)


def layer_kinds(config: object) -> tuple[LayerKind, ...]:
    """Each layer's `LayerKind`, as the model's attention reads the past.

    ``layer_types`` decides per layer (``"full_attention"``, ``"sliding_attention"`` with
    ``sliding_window``, ``"chunked_attention"`` with ``attention_chunk_size``; Qwen2's
    ``use_sliding_window`` / ``max_window_layers``, Gemma 3's ``sliding_window_pattern`` and
    gpt-oss's alternation are already spelled out there by transformers). A config without
    ``layer_types`` (Mistral) applies its ``sliding_window`` or ``attention_chunk_size`` to
    every layer. A window or chunk at least ``max_position_embeddings`` long never cuts a
    sequence, so that layer is full attention.

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        A model config (its decoder text config is read).

    Returns
    -------
    tuple of LayerKind
        One per layer (``num_hidden_layers`` of them).

    Raises
    ------
    UnsupportedModelError
        A layer type paged_kv does not serve (linear attention / Mamba, an unknown type), a
        window layer without a window, or ``layer_types`` of the wrong length; the message
        names the model type and the layer type.
    """
    text = _text_config(config)
    num_layers = text.num_hidden_layers
    types = _layer_types(text)
    if types is None:  # no per-layer kinds: a window or chunk applies to every layer
        window, chunk = window_of(text), _bites(text, getattr(text, "attention_chunk_size", None))
        if window and chunk:
            _refuse(text, [f"both sliding_window={window} and attention_chunk_size={chunk} "
                           "on every layer"])
        kind = (LayerKind.sliding(window) if window else LayerKind.chunked(chunk) if chunk
                else LayerKind.full())
        return (kind,) * num_layers
    if len(types) != num_layers:
        _refuse(text, [f"layer_types has {len(types)} entries for {num_layers} layers"])
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        _refuse(text, [f"layer_types has {sum(t == kind for t in types)} {kind!r} layers"
                       for kind in unknown])
    return tuple(_kind_of_type(text, kind) for kind in types)


def window_of(config: object) -> int:
    """The sliding window the config's window layers read, 0 when none cuts a sequence
    (no ``sliding_window``, ``use_sliding_window=False``, or one at least
    ``max_position_embeddings`` long)."""
    if getattr(config, "use_sliding_window", True) is False:
        return 0
    return _bites(config, getattr(config, "sliding_window", None))


def unsupported_features(config: object, *, layers: bool = True,
                         latent: bool = False) -> list[str]:
    """Every setting of `config` paged_kv does not serve: layer types other than full,
    sliding and chunked attention, cross-attention, bidirectional attention, keys or values
    of another head dim than the pages' one (latent attention, unless `latent`), and
    attention shapes or kinds that transformers' ``per_layer_config`` varies by layer.

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        A model config (its decoder text config is read).
    layers : bool
        Check the layer types here (attention kinds only); False leaves them to the caller
        (the engine's `paged_kv.integrations.hf_layers.model_layers`, which also serves
        recurrent layers).
    latent : bool
        The caller serves multi-head latent attention itself (the engine, for the model
        types of `hf_architectures.LATENT_MODEL_TYPES`: it pages the latent, not per-head
        K/V), so a ``kv_lora_rank`` config's head dims are not named here. `PagedCache`,
        which pages what the model's own attention hands its cache, leaves it False.

    Returns
    -------
    list of str
        ``"setting=value"`` strings; empty when paged_kv computes what the model asks.
    """
    text = _text_config(config)
    found = []
    for holder in (config, text) if text is not config else (config,):  # composite, text
        if getattr(holder, "is_encoder_decoder", False):
            found.append("is_encoder_decoder=True (cross-attention to an encoder)")
        if getattr(holder, "add_cross_attention", False):
            found.append("add_cross_attention=True (cross-attention layers)")
    if getattr(text, "cross_attention_layers", None):  # Mllama's text model
        found.append(f"cross_attention_layers={list(text.cross_attention_layers)}")
    if getattr(text, "use_bidirectional_attention", False):
        found.append("use_bidirectional_attention=True (not causal)")
    per_layer = _per_layer_settings(text)
    found += per_layer + ([] if latent and _global(text, "kv_lora_rank")
                          else _head_dim_mismatches(text))
    blocks = getattr(text, "layers_block_type", None)  # Jamba-style hybrid layer lists
    if layers and isinstance(blocks, list | tuple):
        found += [f"layers_block_type has {sum(b == kind for b in blocks)} {kind!r} layers"
                  for kind in sorted(set(map(str, blocks)) - {"attention"})]
    try:
        if layers and not per_layer:  # a window set per layer cannot be read globally
            layer_kinds(text)
    except UnsupportedModelError as exc:
        found += exc.features
    return list(dict.fromkeys(found))


def require_supported(config: object, who: str, features: Iterable[str] | None = None,
                      note: str = "") -> None:
    """Raise `UnsupportedModelError` naming the model type and every setting in `features`
    (default `unsupported_features(config)`), `note` appended to its message; return when
    there is none."""
    found = list(unsupported_features(config) if features is None else features)
    if found:
        raise UnsupportedModelError(_message(config, found, who) + note, found)


def _per_layer_settings(text: object) -> list[str]:
    """Settings transformers' ``per_layer_config`` gives other values on some layers (a
    heterogeneous config, Gemma 4's): the pool holds one K/V shape for every layer and the
    layer kinds are read from the global settings."""
    if not getattr(text, "is_heterogeneous", False):
        return []
    layers = list(text.per_layer_config)
    return [f"{name} varying by layer (per_layer_config)" for name in PER_LAYER_ATTENTION_SETTINGS
            if len({repr(getattr(layer, name, None)) for layer in layers}) > 1]


def _head_dim_mismatches(text: object) -> list[str]:
    """Keys or values whose head dim is not the one head_dim the pages hold both in
    (``head_dim``, else ``hidden_size // num_attention_heads``): multi-head latent attention
    (DeepSeek V2 / V3: keys of ``qk_nope_head_dim + qk_rope_head_dim``, values of
    ``v_head_dim``, from a ``kv_lora_rank`` latent) or a ``v_head_dim`` of its own."""
    page_dim = _global(text, "head_dim") or _default_head_dim(text)
    nope, rope = _global(text, "qk_nope_head_dim"), _global(text, "qk_rope_head_dim")
    key_dim = _global(text, "qk_head_dim") or (nope or 0) + (rope or 0) or page_dim
    value_dim = _global(text, "v_head_dim") or page_dim
    rank = _global(text, "kv_lora_rank")
    if not rank and key_dim == value_dim == page_dim:
        return []
    latent = f"multi-head latent attention (kv_lora_rank={rank}): " if rank else ""
    return [f"{latent}keys of head dim {key_dim} and values of head dim {value_dim}, where "
            f"paged_kv's pages hold keys and values of one head_dim ({page_dim})"]


def _default_head_dim(text: object) -> int | None:
    hidden, heads = _global(text, "hidden_size"), _global(text, "num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _global(config: object, name: str) -> object:
    """``config.name``, None when unset or set per layer: a heterogeneous config raises
    transformers' ``AmbiguousGlobalPerLayerAttributeError`` (a RuntimeError) on reading a
    per-layer setting globally, and `_per_layer_settings` reports those."""
    try:
        return getattr(config, name, None)
    except RuntimeError:
        return None


def _kind_of_type(text: object, layer_type: str) -> LayerKind:
    attention = LAYER_TYPES[layer_type]
    if attention == "full":
        return LayerKind.full()
    name = "sliding_window" if attention == "sliding" else "attention_chunk_size"
    raw = getattr(text, name, None)
    if raw is None:  # transformers' own mask builder fails on such a layer
        _refuse(text, [f"{layer_type!r} layers with no {name}"])
    if attention == "sliding" and getattr(text, "use_sliding_window", True) is False:
        # the model contradicts itself: SmolLM3's mask still windows such a layer by
        # sliding_window while its module passes no window (flash attention reads none),
        # Qwen2-MoE's sliding_window=0 fails the mask builder; never guess which is meant
        _refuse(text, [f"{layer_type!r} layers with use_sliding_window=False "
                       f"(sliding_window={raw})"])
    span = window_of(text) if attention == "sliding" else _bites(text, raw)
    return LayerKind(attention, span) if span else LayerKind.full()


def _layer_types(text: object) -> list[str] | None:
    """``layer_types`` when the model's attention reads it: a config class with no such
    field or property (Mistral) keeps a stray ``layer_types`` as an attribute its modeling
    code never reads (Mistral applies ``sliding_window`` to every layer)."""
    types = getattr(text, "layer_types", None)
    if types is None or (dataclasses.is_dataclass(text)
                         and not hasattr(type(text), "layer_types")
                         and "layer_types" not in {f.name for f in dataclasses.fields(text)}):
        return None
    return [LEGACY_LAYER_TYPES.get(str(kind), str(kind)) for kind in types]


def _bites(config: object, span: int | None) -> int:
    """`span` when it cuts some sequence the model can take, else 0."""
    limit = getattr(config, "max_position_embeddings", None)
    return int(span) if span and (limit is None or span < limit) else 0


def _refuse(text: object, found: list[str]) -> None:
    raise UnsupportedModelError(_message(text, found, "paged_kv"), found)


def _message(config: object, found: list[str], who: str) -> str:
    model_type = getattr(config, "model_type", None) or type(config).__name__
    return (f"{who}: model type {model_type!r} is not supported: it uses "
            f"{'; '.join(found)}, which paged_kv's attention does not implement (it serves "
            "full, sliding-window and chunked causal self-attention layers), so it would be "
            "served wrong tokens")


def _text_config(config: object) -> object:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config
