"""Which layers of a transformers model keep what in the paged cache: K/V pages, a recurrent
state, or nothing.

An attention-only model keeps K/V in every layer (`hf_support.layer_kinds`). A hybrid keeps
K/V in its attention layers and a recurrent state (`LayerKind.recurrent`, the states
`paged_kv.integrations.recurrent.recurrent_layers` reads) in its recurrent layers, which the
engine runs through a mixer (`paged_kv.integrations.mixers`); Nemotron-H's MLP and MoE
layers keep nothing, so the cache has no layer for them. `model_layers` gives the cache's
layers and the map from each model layer to its cache layer.

A *hybrid* layer (Falcon-H1's every layer: attention and a Mamba-2 mixer side by side on
the same input) keeps both, so it becomes two cache layers, its attention's kind (full, or
sliding for ``"hybrid_sliding"``) then its recurrent state: `ModelLayers.cache_layers` maps
each model layer to the cache layer its attention writes, `ModelLayers.state_layers` to the
one its mixer keeps its state in.

A model of recurrent layers only (Mamba, Mamba-2, Falcon-Mamba) gets one more cache layer
no model layer maps to, a *key-only* full-attention layer: the cache's prefix index keys a
state checkpoint by the blocks of an attention group, so that group must exist; its pages
are one head of `KEY_ONLY_HEAD_DIM` values (8 bytes a token in float32: nothing beside a
state), never written or read.

Served: the model types of `RECURRENT_MODEL_TYPES` (each with a mixer for its recurrent
modules; hybrid layers of `HYBRID_MODEL_TYPES` only). Refused by name: a hybrid layer of
another model type (Zamba's and Zamba2's shared attention blocks, which the decoder does not
run side by side with one mixer), a recurrent model type without a mixer.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import LayerKind, StateSpec
from .hf_support import (
    LAYER_TYPES,
    LEGACY_LAYER_TYPES,
    _kind_of_type,
    _layer_types,
    _refuse,
    layer_kinds,
)
from .recurrent import HYBRID_LAYER_TYPES, RECURRENCES, RECURRENT_LAYER_TYPES, recurrent_layers

__all__ = ["HYBRID_MODEL_TYPES", "KEY_ONLY_HEAD_DIM", "NO_CACHE_LAYER_TYPES",
           "RECURRENT_MODEL_TYPES", "ModelLayers", "model_layers"]

# model types whose recurrent layers the engine runs (through `mixers.MIXERS`), checked
# against transformers' generate
RECURRENT_MODEL_TYPES = frozenset({
    "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "lfm2", "lfm2_moe",
    "mamba", "mamba2", "nemotron_h", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
})
# model types whose "hybrid" layers the engine serves: the decoder layer runs its attention
# and its mixer side by side, each a module of its own (Falcon-H1)
HYBRID_MODEL_TYPES = frozenset({"falcon_h1"})
# a hybrid layer's attention, as the layer type an attention-only layer of that kind has
HYBRID_ATTENTION = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
# the key-only layer's head dim (one head): the smallest pages a block can have
KEY_ONLY_HEAD_DIM = 1
# layer types with no sequence mixer (Nemotron-H's MLP and MoE blocks): nothing to cache
NO_CACHE_LAYER_TYPES = frozenset({"mlp", "moe"})


@dataclasses.dataclass(frozen=True)
class ModelLayers:
    """The cache's layers of a model.

    Attributes
    ----------
    kinds : tuple of LayerKind
        One per cache layer, in model order (`CacheConfig.layer_kinds`).
    cache_layers : tuple of int or None
        One per model layer: its cache layer (a hybrid layer's: its attention's, the map the
        paged attention function reads), None for a layer that keeps nothing.
    key_only : int or None
        The key-only layer of a model of recurrent layers only (the last cache layer), else
        None.
    state_layers : tuple of int or None
        One per model layer: the cache layer its mixer keeps its state in (the map
        `paged_kv.engine.hf_recurrent.install_mixers` reads), None for a layer with no
        recurrent state. Left out, it is `cache_layers` where that layer is recurrent: only a
        hybrid layer has a state layer other than its cache layer.
    """

    kinds: tuple[LayerKind, ...]
    cache_layers: tuple[int | None, ...]
    key_only: int | None = None
    state_layers: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.state_layers is None:  # frozen: the derived default is set once, here
            object.__setattr__(self, "state_layers", tuple(
                layer if layer is not None and self.kinds[layer].is_recurrent else None
                for layer in self.cache_layers))

    @property
    def is_identity(self) -> bool:
        """Whether model layer ``i`` is cache layer ``i`` for every ``i``."""
        return all(cache == model for model, cache in enumerate(self.cache_layers))


def model_layers(config: object, dtype: torch.dtype | str = torch.float32) -> ModelLayers:
    """The cache's layers of the model `config` describes, loaded in `dtype`.

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        The model's config (its decoder text config is read).
    dtype : torch.dtype or str
        The model's dtype: a convolution window is kept in it (recurrent states in float32).

    Returns
    -------
    ModelLayers

    Raises
    ------
    UnsupportedModelError
        A layer type the engine does not serve (see the module docstring), naming the model
        type and the layer type; an attention-only model raises what `layer_kinds` raises.

    Examples
    --------
    >>> from transformers import Qwen3NextConfig
    >>> config = Qwen3NextConfig(num_hidden_layers=4, hidden_size=64,
    ...     layer_types=["linear_attention"] * 3 + ["full_attention"])
    >>> layers = model_layers(config)
    >>> [str(kind) for kind in layers.kinds], layers.cache_layers
    (['recurrent', 'recurrent', 'recurrent', 'full'], (0, 1, 2, 3))
    """
    text = _text_config(config)
    types = _types(text)
    if not any(kind in RECURRENT_LAYER_TYPES or kind in NO_CACHE_LAYER_TYPES for kind in types):
        kinds = layer_kinds(text)
        return ModelLayers(kinds, tuple(range(len(kinds))))
    model_type = getattr(text, "model_type", None)
    if len(types) != text.num_hidden_layers:
        _refuse(text, [f"layer_types has {len(types)} entries for {text.num_hidden_layers} "
                       "layers"])
    found = _refused_types(types, model_type)
    if found:
        _refuse(text, found)
    try:
        states = recurrent_layers(text, dtype)
    except NotImplementedError as error:
        _refuse(text, [str(error)])
    kinds, cache_layers, state_layers = _assign(text, types, states)
    if all(kind.is_recurrent for kind in kinds):  # a key-only layer leads the prefix cache
        return ModelLayers((*kinds, LayerKind.full()), cache_layers, len(kinds), state_layers)
    return ModelLayers(kinds, cache_layers, state_layers=state_layers)


def _assign(text: object, types: list[str], states: dict[int, tuple[StateSpec, ...]]
            ) -> tuple[tuple[LayerKind, ...], tuple[int | None, ...], tuple[int | None, ...]]:
    """The cache layers of the model layers of `types`, in model order: ``(kinds,
    cache_layers, state_layers)`` (`ModelLayers`' fields). A hybrid layer gets two, its
    attention's then its state's; an MLP layer none."""
    kinds: list[LayerKind] = []
    cache_layers: list[int | None] = []
    state_layers: list[int | None] = []
    for index, kind in enumerate(types):
        cache = state = None
        if kind in HYBRID_ATTENTION:  # its attention's cache layer, then its state's
            cache, state = len(kinds), len(kinds) + 1
            kinds += [_kind_of_type(text, HYBRID_ATTENTION[kind]),
                      LayerKind.recurrent(states[index])]
        elif index in states:
            cache = state = len(kinds)
            kinds.append(LayerKind.recurrent(states[index]))
        elif kind not in NO_CACHE_LAYER_TYPES:
            cache = len(kinds)
            kinds.append(_kind_of_type(text, kind))
        cache_layers.append(cache)
        state_layers.append(state)
    return tuple(kinds), tuple(cache_layers), tuple(state_layers)


def _types(text: object) -> list[str]:
    """The layer types: ``layer_types`` as attention reads it, and for a recurrent family
    also one its config derives on reading (Nemotron-H's and Bamba's come from
    ``hybrid_override_pattern`` / ``attn_layer_indices``)."""
    types = _layer_types(text)
    if types is None and getattr(text, "model_type", None) in RECURRENCES:
        types = [LEGACY_LAYER_TYPES.get(str(kind), str(kind))
                 for kind in getattr(text, "layer_types", None) or ()]
    return types or []


def _refused_types(types: list[str], model_type: str | None) -> list[str]:
    """The layer types of a hybrid model the engine does not serve, counted."""
    counts: dict[str, int] = {}
    for kind in types:
        counts[kind] = counts.get(kind, 0) + 1
    found = [f"{count} {kind!r} layers (attention and a recurrent state in one layer)"
             for kind, count in counts.items()
             if kind in HYBRID_LAYER_TYPES and model_type not in HYBRID_MODEL_TYPES]
    found += [f"{count} {kind!r} layers" for kind, count in counts.items()
              if kind not in LAYER_TYPES and kind not in RECURRENT_LAYER_TYPES
              and kind not in NO_CACHE_LAYER_TYPES]
    if model_type not in RECURRENT_MODEL_TYPES:
        recurrent = sum(count for kind, count in counts.items() if kind in RECURRENT_LAYER_TYPES)
        if recurrent:
            found.append(f"{recurrent} recurrent layers of a model type whose recurrent "
                         f"modules the engine does not run (it runs "
                         f"{', '.join(sorted(RECURRENT_MODEL_TYPES))})")
    return found


def _text_config(config: object) -> object:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config
