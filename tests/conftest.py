"""Shared helpers for the paged_kv tests."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from paged_kv import CacheConfig

ROOT = Path(__file__).resolve().parents[1]  # the repository, for subprocesses run from it


def tiny_config(**overrides) -> CacheConfig:
    """A small cache config for state-machine and bad-input tests."""
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=24,
                  dtype=torch.float32, device="cpu", num_host_blocks=16)
    fields.update(overrides)
    return CacheConfig(**fields)


def assert_same_snapshot(before: tuple, after: tuple, what: str = "") -> None:
    """Compare two `paged_kv.core.cache.snapshot(cache)` values, tensors by exact equality."""
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if isinstance(a, tuple) and any(isinstance(x, torch.Tensor) for x in a):
            for x, y in zip(a, b, strict=True):
                assert (x is None and y is None) or torch.equal(x, y), f"{what}: pool changed"
        else:
            assert a == b, f"{what}: part {i} of the state changed"


def tiny_llama_config(**overrides):
    """A transformers `LlamaConfig` small enough for CPU tests; the wide init keeps logits
    apart, so greedy choices are not decided by rounding. Needs the hf extra."""
    import transformers

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3)
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)



def prometheus_value(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus exposition text (fails unless there exactly once)."""
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    found = re.findall(pattern, text, re.MULTILINE)
    assert len(found) == 1, f"{name}{labels} not exactly once in metrics:\n{text}"
    return float(found[0])


def make_engine(model, num_blocks: int = 256, block_size: int = 16, num_host_blocks: int = 0,
                **kwargs):
    """An `Engine` over `model` with a pool of `num_blocks` (and a host pool for swap)."""
    from paged_kv.engine import Engine
    from paged_kv.engine.config import EngineConfig

    cache = model.cache_config(num_blocks=num_blocks, block_size=block_size,
                               num_host_blocks=num_host_blocks)
    return Engine(model, EngineConfig(cache=cache, **kwargs))


def save_configs(tmp_path_factory, configs: dict) -> dict[str, Path]:
    """Each ``name: (config, ...)`` of `configs` saved alone (``config.json``, no weights)
    in a folder of its own: a refusal at load reads the config, never a weight."""
    paths = {}
    for name, (config, *_) in configs.items():
        paths[name] = tmp_path_factory.mktemp(name.replace(" ", "-"))
        config.save_pretrained(paths[name])
    return paths
