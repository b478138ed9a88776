"""The model's part of a tier fingerprint: a digest of all its weights' bytes, and a digest
of everything else that shapes its K/V (its config, its layers' kinds).

Two engines share tier values only when their blocks would hold the same K/V for the same
tokens. The weights decide that, and so does every config field the forward pass reads
before it writes K/V: RoPE (``rope_theta``, ``rope_scaling`` / ``rope_parameters``), the
norms' epsilon, attention heads and bias, layer types. Rather than list those fields, and
miss the next one a model family adds, the whole config goes in, minus the fields known not
to change K/V (`IGNORED_CONFIG_FIELDS`): a field wrongly left in only costs sharing between
two deployments that differ in it; one wrongly left out would serve wrong K/V.

The weights are read in full once at start-up (xxh3-128, a few GB/s; every parameter and
buffer, with its name, shape and dtype), so two checkpoints differing in one embedding row
never share a block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .codec import Fingerprint

if TYPE_CHECKING:
    import torch

    from ..config import CacheConfig

try:
    import xxhash
except ImportError:  # the tiers extra brings it; sha256 digests the same bytes, more slowly
    xxhash = None

# Config fields that cannot change a block's K/V: names, paths and versions; token ids and
# generation defaults (sampling, not the forward pass); output switches; a classifier
# head's labels; how weights were initialised (the weights themselves are digested).
IGNORED_CONFIG_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "architectures",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens",
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
    "task_specific_params", "tokenizer_class", "prefix",
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "output_scores", "return_dict_in_generate",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "exponential_decay_length_penalty",
    "remove_invalid_values",
    "initializer_range", "initializer_factor",
})


def model_fingerprint(model: torch.nn.Module, config: CacheConfig, model_id: str = "",
                      tp_rank: int = 0, tp_size: int = 1) -> Fingerprint:
    """The fingerprint of `model`'s blocks in a cache of `config`.

    Parameters
    ----------
    model : torch.nn.Module
        `TinyLlama`, `HFCausalLM` or any module whose weights are its parameters and
        buffers (a transformers config found on it or a submodule is read as the config).
    config : CacheConfig
        The cache the blocks come from (dtype, page format, block size, shape).
    model_id : str
        Names the weights instead of their digest (the config is in the fingerprint either
        way); empty: `weights_id` reads them.
    """
    return Fingerprint.of(config, model_id or weights_id(model), config_id(model),
                          tp_rank, tp_size)


def weights_id(model: torch.nn.Module) -> str:
    """A digest of all of `model`'s weights: every parameter and buffer (non-persistent
    ones too: RoPE tables follow the config), by name, with its shape, dtype and every
    byte. Tied parameters are read once."""
    digest = xxhash.xxh3_128() if xxhash is not None else hashlib.sha256()
    for name, tensor in _tensors(model):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(_raw_bytes(tensor))
    return digest.hexdigest()[:32]


def config_id(model: torch.nn.Module) -> str:
    """A digest of what shapes `model`'s K/V besides its weights: its class, the kinds of
    its layers (every submodule's path and class) and its config (`config_fields`)."""
    identity = {"modules": [f"{name}:{type(module).__module__}.{type(module).__qualname__}"
                            for name, module in model.named_modules()],
                "config": config_fields(model)}
    text = json.dumps(identity, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def config_fields(model: torch.nn.Module) -> dict[str, Any]:
    """The config of `model` as a dict, minus `IGNORED_CONFIG_FIELDS` (at every level of
    nested configs): a transformers config on the model or its first submodule that has
    one (``HFCausalLM.model``), else a dataclass config (`TinyLlamaConfig`), else the
    attributes of ``model.config``; empty when there is none."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if callable(getattr(config, "to_dict", None)):
            return _without_ignored(config.to_dict())
    config = getattr(model, "config", None)
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return _without_ignored(dataclasses.asdict(config))
    return _without_ignored(dict(getattr(config, "__dict__", {"repr": repr(config)})))


def _without_ignored(fields: Any) -> Any:
    if isinstance(fields, dict):
        return {str(k): _without_ignored(v) for k, v in fields.items()
                if k not in IGNORED_CONFIG_FIELDS}
    if isinstance(fields, list | tuple):
        return [_without_ignored(v) for v in fields]
    return fields


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers, each sorted by name (independent of registration order)."""
    yield from sorted(model.named_parameters(), key=lambda item: item[0])
    yield from sorted(model.named_buffers(), key=lambda item: item[0])


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is contiguous on the CPU: a flat uint8 view
    (numpy has no bfloat16 or float8; the bytes are what matter)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
