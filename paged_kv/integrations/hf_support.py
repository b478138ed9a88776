"""What of a transformers model's attention paged_kv implements, read from its config.

paged_kv's attention kernels compute full causal attention over every cached token, with
a scale and grouped heads. A model whose layers ask for more — a sliding window, chunked
local attention, linear (recurrent) layers, soft-capped attention logits, or learned
attention sinks — would be served wrong tokens silently if its attention ran on those
kernels, so it is refused by name until the kernels implement the feature.

Only the config is read (no weights), so the command line refuses a checkpoint before it
loads one; `loaded_model_features` adds what only the loaded modules show.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["UnsupportedModelError", "loaded_model_features", "require_supported",
           "unsupported_features", "window_features"]

# model types whose attention adds learned per-head sink logits to the softmax, where the
# config has no field that says so (their modules carry a ``sinks`` parameter)
SINK_MODEL_TYPES = frozenset({"gpt_oss"})


class UnsupportedModelError(ValueError):
    """A model asks for attention paged_kv's kernels do not implement (it would be served
    wrong tokens): the message names the model type and each setting."""


def window_features(config: object) -> list[str]:
    """The settings that make some layer attend to less than the whole past.

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        A (text) config.

    Returns
    -------
    list of str
        ``"setting=value"`` strings, e.g. ``"sliding_window=32 on 'sliding_attention'
        layers"``; empty when every layer is full attention. A window or chunk at least
        ``max_position_embeddings`` long never cuts anything and is not listed.
    """
    limit = getattr(config, "max_position_embeddings", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    chunk = getattr(config, "attention_chunk_size", None)

    def bites(span: int | None) -> bool:
        return span is not None and (limit is None or span < limit)

    kinds = getattr(config, "layer_types", None)
    if kinds is None:  # no per-layer kinds: a window or chunk applies to every layer
        found = [f"sliding_window={window} on every layer"] if bites(window) else []
        return found + ([f"attention_chunk_size={chunk} on every layer"] if bites(chunk)
                        else [])
    found = []
    for kind in sorted(set(kinds) - {"full_attention"}):
        count = sum(k == kind for k in kinds)
        if "sliding" in kind:
            if bites(window):
                found.append(f"sliding_window={window} on {count} {kind!r} layers")
        elif "chunk" in kind:
            if bites(chunk):
                found.append(f"attention_chunk_size={chunk} on {count} {kind!r} layers")
        else:
            found.append(f"layer_types has {count} {kind!r} layers")
    return found


def unsupported_features(config: object) -> list[str]:
    """Every setting of `config` that paged_kv's attention kernels do not implement:
    `window_features`, attention-logit soft-capping and learned attention sinks.

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        A model config (its decoder text config is read).

    Returns
    -------
    list of str
        ``"setting=value"`` strings; empty when the kernels compute what the model asks.
    """
    text = _text_config(config)
    found = window_features(text)
    for name, value in sorted(_fields(text)):
        # the final-logit cap is applied by the model's head, outside attention
        if "softcap" in name and ("attn" in name or "attention" in name) and value:
            found.append(f"{name}={value}")
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if getattr(text, "model_type", None) in SINK_MODEL_TYPES \
            or any(str(key).endswith("sinks") for key in plan):
        found.append("attention sinks (learned per-head sink logits)")
    return found


def loaded_model_features(model: object) -> list[str]:
    """What only the loaded modules show: parameters named ``sinks`` (learned attention
    sinks that no config field announces)."""
    names = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] == "sinks"]
    return [f"attention sinks ({len(names)} layers with a 'sinks' parameter)"] if names else []


def require_supported(config: object, who: str, features: Iterable[str] | None = None) -> None:
    """Raise `UnsupportedModelError` naming the model type and every setting in `features`
    (default `unsupported_features(config)`); return when there is none."""
    found = list(unsupported_features(config) if features is None else features)
    if not found:
        return
    model_type = getattr(config, "model_type", None) or type(config).__name__
    raise UnsupportedModelError(
        f"{who}: model type {model_type!r} is not supported: it uses {'; '.join(found)}, "
        "which paged_kv's attention kernels do not implement (they attend to every cached "
        "token, with no window, soft-cap or sink), so it would be served wrong tokens")


def _text_config(config: object) -> object:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _fields(config: object) -> Iterable[tuple[str, object]]:
    to_dict = getattr(config, "to_dict", None)
    return (to_dict() if to_dict is not None else vars(config)).items()
