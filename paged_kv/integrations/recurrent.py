"""Which layers of a transformers model are recurrent, and what state each keeps per sequence.

A recurrent layer (Mamba-1, Mamba-2, a gated delta net, a short convolution) keeps a
fixed-size state per sequence instead of K/V per token. transformers 5.x keeps every such
state in its generic cache layers (``cache_utils.LinearAttentionLayer``, and
``LinearAttentionAndFullAttentionLayer`` for a layer that also attends): a layer holds
``conv_states[0]``, the last ``kernel`` inputs of its causal depthwise convolution, of shape
``(batch, channels, kernel)``, and, except LFM2's short convolution, ``recurrent_states[0]``,
the SSM or delta-rule state. Which layers are recurrent comes from ``config.layer_types``
(``"linear_attention"``, ``"conv"``, ``"hybrid"``: attention and a recurrent state in one
layer); the cache allocates each state lazily, in the dtype of the first tensor the layer
hands it, so the shapes and dtypes below are read from each family's modeling code and
checked against the tensors its cache holds after a forward
(tests/integrations/test_recurrent_specs.py).

Per family, by the model type of the text config (the recurrence its layers run): the
``"conv"`` state, in the model's dtype, then the ``"ssm"`` / ``"recurrent"`` state, in float32.

- qwen3_next, qwen3_5_text, qwen3_5_moe_text, olmo_hybrid (gated delta rule):
  conv ``(2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads *
  linear_value_head_dim, linear_conv_kernel_dim)``; recurrent ``(linear_num_value_heads,
  linear_key_head_dim, linear_value_head_dim)``.
- mamba2 (Mamba-2): conv ``(I + 2 * n_groups * state_size, conv_kernel)`` with
  ``I = int(expand * hidden_size)``; ssm ``(num_heads, head_dim, state_size)``.
- falcon_h1 (Mamba-2 beside attention in every layer, all of them ``"hybrid"``): conv
  ``(I + 2 * mamba_n_groups * mamba_d_state, mamba_d_conv)`` with ``I = mamba_d_ssm``, else
  ``int(mamba_expand * hidden_size)``; ssm ``(mamba_n_heads, mamba_d_head, mamba_d_state)``.
- granitemoehybrid, bamba (Mamba-2): as falcon_h1, ``I = int(mamba_expand * hidden_size)``.
- nemotron_h (Mamba-2): conv ``(I + 2 * n_groups * ssm_state_size, conv_kernel)`` with
  ``I = mamba_num_heads * mamba_head_dim``; ssm ``(mamba_num_heads, mamba_head_dim,
  ssm_state_size)``.
- zamba2 (Mamba-2; its ``"hybrid"`` layers also attend): conv ``(I + 2 * mamba_ngroups *
  mamba_d_state, mamba_d_conv)`` with ``I = int(mamba_expand * hidden_size)``; ssm
  ``(n_mamba_heads, mamba_headdim, mamba_d_state)``.
- mamba, falcon_mamba (Mamba-1): conv ``(intermediate_size, conv_kernel)``; ssm
  ``(intermediate_size, state_size)``.
- jamba (Mamba-1): conv ``(I, mamba_d_conv)`` with ``I = mamba_expand * hidden_size``; ssm
  ``(I, mamba_d_state)``.
- zamba (Mamba-1 split in heads; its ``"hybrid"`` layers also attend): conv ``(I,
  mamba_d_conv)`` with ``I = mamba_expand * hidden_size``; ssm ``(n_mamba_heads,
  I // n_mamba_heads, mamba_d_state)``.
- lfm2, lfm2_moe (gated short convolution): conv ``(hidden_size, conv_L_cache)``; no other.

The convolution window is kept in the model's dtype (it is the layer's projected input);
every SSM and delta-rule state is float32 whatever the model's dtype: transformers' torch
recurrences upcast to float32 before the scan (``.float()``), and the state is allocated
like the scan's final state. No family reads a dtype setting for it (Nemotron-H's
``mamba_ssm_cache_dtype`` is read by no modeling code). Every recurrent layer of a model
holds the same states. A recurrent model of another type is refused by name
(`NotImplementedError`) rather than sized wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from ..config import StateSpec  # moved to the config (floor 0); re-exported here

__all__ = ["CACHE_ATTRIBUTES", "RECURRENCES", "RECURRENT_LAYER_TYPES", "StateSpec",
           "hybrid_layers", "recurrent_layers", "state_bytes_per_sequence"]

# transformers' layer_types of layers that keep a recurrent state ("mamba": the legacy
# spelling it remaps to "linear_attention"); the hybrid ones also keep attention K/V
HYBRID_LAYER_TYPES = frozenset({"hybrid", "hybrid_sliding"})
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba"}) | HYBRID_LAYER_TYPES
# the transformers cache-layer attribute (a dict by state index, index 0 here) each state
# name is held in
CACHE_ATTRIBUTES = {"conv": "conv_states", "ssm": "recurrent_states",
                    "recurrent": "recurrent_states"}
# recurrent model types whose config lists no layer_types (their own cache classes)
RECURRENT_WITHOUT_LAYER_TYPES = {"rwkv": "RWKV time mixing", "xlstm": "mLSTM"}


Reader = Callable[[object, torch.dtype], tuple[StateSpec, ...]]


def _conv(channels: int, kernel: int, dtype: torch.dtype) -> StateSpec:
    return StateSpec("conv", (int(channels), int(kernel)), dtype)


def _gated_delta_net(config: object, dtype: torch.dtype) -> tuple[StateSpec, ...]:
    """Qwen3-Next's gated delta net (Qwen3.5, OLMo-Hybrid): the convolution runs over the
    concatenated q, k, v projections; the state is one ``key_head_dim x value_head_dim``
    memory per value head (keys are repeated over value-head groups)."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    state = (config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)
    return (_conv(2 * key_dim + value_dim, config.linear_conv_kernel_dim, dtype),
            StateSpec("recurrent", tuple(map(int, state)), torch.float32))


def _mamba2(heads: str, head_dim: str, state: str, groups: str, kernel: str,
            intermediate: Callable[[object], int]) -> Reader:
    """A Mamba-2 mixer's states, from the names its family gives the config fields: the
    convolution runs over x, B and C (``intermediate + 2 * groups * state`` channels); the
    SSM state is ``(heads, head_dim, state)``."""

    def specs(config: object, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        size = int(getattr(config, state))
        channels = intermediate(config) + 2 * int(getattr(config, groups)) * size
        ssm = (int(getattr(config, heads)), int(getattr(config, head_dim)), size)
        return (_conv(channels, getattr(config, kernel), dtype),
                StateSpec("ssm", ssm, torch.float32))

    return specs


def _mamba1(kernel: str, state: str, intermediate: Callable[[object], int],
            heads: str | None = None) -> Reader:
    """A Mamba-1 mixer's states: the convolution runs over x (``intermediate`` channels),
    the SSM state is ``(intermediate, state)``, or ``(heads, intermediate // heads, state)``
    where the mixer splits x in heads (Zamba)."""

    def specs(config: object, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        inner, size = intermediate(config), int(getattr(config, state))
        split = int(getattr(config, heads)) if heads else 0
        ssm = (split, inner // split, size) if split else (inner, size)
        return (_conv(inner, getattr(config, kernel), dtype),
                StateSpec("ssm", ssm, torch.float32))

    return specs


def _short_conv(config: object, dtype: torch.dtype) -> tuple[StateSpec, ...]:
    """LFM2's gated short convolution: a window over the hidden state, no SSM state."""
    return (_conv(config.hidden_size, config.conv_L_cache, dtype),)


def _expanded(expand: str) -> Callable[[object], int]:
    """``int(config.<expand> * hidden_size)``: how most mixers size their inner dim."""
    return lambda config: int(getattr(config, expand) * config.hidden_size)


def _falcon_h1_inner(config: object) -> int:
    ssm = getattr(config, "mamba_d_ssm", None)
    return int(ssm) if ssm is not None else _expanded("mamba_expand")(config)


_GRANITE_FIELDS = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                   "mamba_d_conv")
# model type (of the text config) -> (the recurrence its layers run, its states' reader)
_FAMILIES: dict[str, tuple[str, Reader]] = {
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid"),
                    ("gated_delta_rule", _gated_delta_net)),
    "mamba2": ("mamba2", _mamba2("num_heads", "head_dim", "state_size", "n_groups",
                                 "conv_kernel", _expanded("expand"))),
    "falcon_h1": ("mamba2", _mamba2(*_GRANITE_FIELDS, _falcon_h1_inner)),
    **dict.fromkeys(("granitemoehybrid", "bamba"),
                    ("mamba2", _mamba2(*_GRANITE_FIELDS, _expanded("mamba_expand")))),
    "nemotron_h": ("mamba2", _mamba2("mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                                     "n_groups", "conv_kernel",
                                     lambda c: int(c.mamba_num_heads * c.mamba_head_dim))),
    "zamba2": ("mamba2", _mamba2("n_mamba_heads", "mamba_headdim", "mamba_d_state",
                                 "mamba_ngroups", "mamba_d_conv", _expanded("mamba_expand"))),
    **dict.fromkeys(("mamba", "falcon_mamba"),
                    ("mamba1", _mamba1("conv_kernel", "state_size",
                                       lambda c: int(c.intermediate_size)))),
    "jamba": ("mamba1", _mamba1("mamba_d_conv", "mamba_d_state", _expanded("mamba_expand"))),
    "zamba": ("mamba1", _mamba1("mamba_d_conv", "mamba_d_state", _expanded("mamba_expand"),
                                heads="n_mamba_heads")),
    **dict.fromkeys(("lfm2", "lfm2_moe"), ("short_conv", _short_conv)),
}
# the recurrence each mapped model type's recurrent layers run: "gated_delta_rule",
# "mamba2", "mamba1" (selective scan) or "short_conv"
RECURRENCES = {model_type: recurrence for model_type, (recurrence, _) in _FAMILIES.items()}


def recurrent_layers(config: object, dtype: torch.dtype | str = torch.float32
                     ) -> dict[int, tuple[StateSpec, ...]]:
    """Every recurrent layer of the model and the states transformers' cache keeps for it.

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        The model's config; a composite (multimodal) one's decoder text config is read.
    dtype : torch.dtype or str, default torch.float32
        The dtype the model is loaded in (``torch_dtype``); a name such as ``"bfloat16"``
        is read as ``torch.bfloat16``.

    Returns
    -------
    dict of int to tuple of StateSpec
        Layer index -> its states in the order its transformers cache layer holds them
        (``conv`` first, then ``ssm`` / ``recurrent`` where there is one); empty when no
        layer is recurrent. A layer that also attends (`hybrid_layers`: every layer of
        Falcon-H1) is in it too.

    Raises
    ------
    NotImplementedError
        Recurrent layers in a model type this module does not map; the message names the
        model type and each recurrent layer type.

    Examples
    --------
    >>> from transformers import Mamba2Config
    >>> config = Mamba2Config(hidden_size=64, num_heads=16, head_dim=8, state_size=16,
    ...                       n_groups=2, conv_kernel=4, num_hidden_layers=2)
    >>> for spec in recurrent_layers(config, torch.bfloat16)[1]:
    ...     print(spec.name, spec.shape, spec.dtype, spec.nbytes)
    conv (192, 4) torch.bfloat16 1536
    ssm (16, 8, 16) torch.float32 8192
    """
    text = _text_config(config)
    model_type = getattr(text, "model_type", None)
    dtype = _as_dtype(dtype)
    layers = _recurrent_layer_types(text, model_type)
    if not layers:
        return {}
    if model_type not in _FAMILIES:
        counts = {kind: list(layers.values()).count(kind) for kind in sorted(set(layers.values()))}
        found = ", ".join(f"{n} {kind!r} layers" for kind, n in counts.items())
        raise NotImplementedError(
            f"model type {model_type!r} has {found} (recurrent state), whose states paged_kv "
            f"does not map; it maps {', '.join(sorted(_FAMILIES))}")
    specs = _FAMILIES[model_type][1](text, dtype)
    return dict.fromkeys(layers, specs)


def hybrid_layers(config: object) -> tuple[int, ...]:
    """The layers that keep both attention K/V and a recurrent state (transformers'
    ``"hybrid"`` layer type: every layer of Falcon-H1, the shared-attention layers of Zamba
    and Zamba2), in order; a subset of `recurrent_layers`' keys."""
    types = _layer_types(_text_config(config))
    return tuple(index for index, kind in enumerate(types) if kind in HYBRID_LAYER_TYPES)


def state_bytes_per_sequence(specs: Mapping[int, Iterable[StateSpec]] | Iterable[StateSpec]
                             ) -> int:
    """Bytes of recurrent state one sequence keeps.

    Parameters
    ----------
    specs : mapping of int to iterable of StateSpec, or iterable of StateSpec
        `recurrent_layers`' result (every layer summed) or one layer's states.

    Returns
    -------
    int
        The sum of the states' `StateSpec.nbytes`.
    """
    if isinstance(specs, Mapping):
        return sum(state_bytes_per_sequence(layer) for layer in specs.values())
    return sum(spec.nbytes for spec in specs)


def _recurrent_layer_types(text: object, model_type: str | None) -> dict[int, str]:
    """Layer index -> layer type of each recurrent layer; raises for a recurrent model type
    whose config has no ``layer_types``."""
    if model_type in RECURRENT_WITHOUT_LAYER_TYPES:
        raise NotImplementedError(
            f"model type {model_type!r} has {text.num_hidden_layers} "
            f"{RECURRENT_WITHOUT_LAYER_TYPES[model_type]!r} layers (recurrent state, in its "
            "own cache class), whose states paged_kv does not map")
    return {index: kind for index, kind in enumerate(_layer_types(text))
            if kind in RECURRENT_LAYER_TYPES}


def _layer_types(text: object) -> list[str]:
    types = getattr(text, "layer_types", None) or ()
    return [str(kind) for kind in types]


def _text_config(config: object) -> object:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, not {dtype!r}")
    return dtype
