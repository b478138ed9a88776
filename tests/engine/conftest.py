"""Fixtures of the serving tests: each test module's model, and seeded prompts."""

from __future__ import annotations

import pytest
import torch

from paged_kv.engine import TinyLlama


@pytest.fixture(scope="module")
def model(request) -> TinyLlama:
    """The test module's `TinyLlama`, built once per module from its ``CONFIG`` and its
    ``MODEL_SEED`` (0 unless it sets one): float32 weights, as ``cache_config()`` is."""
    module = request.module
    return TinyLlama(module.CONFIG, seed=getattr(module, "MODEL_SEED", 0))


def prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """`length` token ids below `vocab_size`, drawn from a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()
