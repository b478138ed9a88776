"""`limits.request_blocks`' count for layouts of full-attention groups only (one block per
`block_size` tokens, the longest counted once, the group count remembered per config)
against the general two-call count, and `check_request`'s token scan by types against the
ids it must refuse."""

from __future__ import annotations

import random

import pytest
import torch

from paged_kv import CacheConfig, LayerKind
from paged_kv.config import StateSpec
from paged_kv.engine import SamplingParams
from paged_kv.engine.limits import check_request, request_blocks

FULL, WINDOW = LayerKind(), LayerKind.sliding(8)
STATE = LayerKind.recurrent((StateSpec("ssm", (2, 4), torch.float32),))
LAYOUTS = [
    pytest.param((FULL,), id="one layer"),
    pytest.param((FULL,) * 5, id="five full layers"),
    pytest.param((WINDOW, FULL, WINDOW, FULL), id="windows: the general count"),
    pytest.param((STATE, FULL, STATE, FULL), id="recurrent and full: two full groups"),
    pytest.param((STATE, STATE, FULL), id="recurrent and one full group"),
]


def _config(kinds: tuple[LayerKind, ...], block_size: int) -> CacheConfig:
    return CacheConfig(num_layers=len(kinds), num_kv_heads=1, head_dim=4,
                       block_size=block_size, num_blocks=64, dtype=torch.float32,
                       layer_kinds=kinds, num_state_slots=4 if STATE in kinds else 0)


@pytest.mark.parametrize("kinds", LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_the_count_is_the_general_one(kinds, block_size):
    config = _config(kinds, block_size)
    rng = random.Random(block_size)
    for _ in range(200):
        prompt_len, max_tokens = rng.randint(1, 300), rng.randint(0, 300)
        step = rng.randint(1, prompt_len)
        general = max(config.blocks_for_sequence(prompt_len, step),
                      config.blocks_for_sequence(prompt_len + max_tokens - 1, 1))
        got = request_blocks(config, prompt_len, max_tokens, step)
        assert got == general, (f"{kinds} block {block_size}: prompt {prompt_len}, "
                                f"max_tokens {max_tokens}, step {step}")


def test_a_config_rebuilt_at_the_same_address_is_counted_anew():
    for _ in range(200):  # configs made and dropped: ids are reused, counts must not be
        kinds = random.choice([(FULL,) * 3, (WINDOW, FULL)])
        config = _config(kinds, 4)
        expected = max(config.blocks_for_sequence(40, 40), config.blocks_for_sequence(49, 1))
        assert request_blocks(config, 40, 10, 40) == expected, kinds


class _Model:
    vocab_size, max_position = 100, 4096


@pytest.mark.parametrize("bad", [True, 1.0, -1, 100, "3", None])
def test_the_scan_refuses_what_it_refused(bad):
    config = _config((FULL,), 16)
    prompt = [5, 6, bad, 7]
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 100\), got \[") as e:
        check_request(prompt, SamplingParams(max_tokens=4), _Model, 4, config)
    assert repr(bad) in str(e.value)


def test_the_scan_passes_ints_at_both_ends():
    config = _config((FULL,), 16)
    assert check_request((0, 99, 5), SamplingParams(max_tokens=4), _Model, 4,
                         config) == [0, 99, 5]
