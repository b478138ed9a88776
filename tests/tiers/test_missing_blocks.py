"""What an admission asks a lower tier for (`Admission.missing`, `HybridAdmission.missing`):
the prompt's full blocks after the device's hits, never the block holding the prompt's last
token (that token is always computed, so its block would be fetched for nothing, and a
tier's copy of it would turn a whole-prompt hit into no token to compute).

The tier tests serve prompts whose last token sits in a partial block, where "the block of
the last token" and "the full blocks" are the same cut; a prompt of a whole number of
blocks tells them apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_kv import CacheConfig, LayerKind, PagedKVCache
from paged_kv.core.groups.rules import group_key
from paged_kv.keys import block_keys, root_hash

BLOCK = 4
W4, FULL = LayerKind.sliding(4), LayerKind()


def _cache(kinds: tuple[LayerKind, ...] = ()) -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_layers=max(len(kinds), 1), num_kv_heads=1,
                                    head_dim=4, block_size=BLOCK, num_blocks=64,
                                    dtype=torch.float32, layer_kinds=kinds))


@pytest.mark.parametrize("length", [12, 13, 15], ids=lambda n: f"{n}-tokens")
def test_a_tier_is_asked_for_the_full_blocks_before_the_last_tokens(length):
    prompt = list(range(100, 100 + length))
    keys = block_keys(np.array(prompt), BLOCK, root_hash(None))
    before_last = (length - 1) // BLOCK  # 2 for each: 12 is 3 whole blocks, the last computed
    parent, asked, tokens = _cache().plan_admission("a", prompt).missing(BLOCK)
    assert parent == root_hash(None)
    assert asked == keys[:before_last], f"{length} tokens: {len(asked)} blocks asked"
    assert tokens.tolist() == prompt[:before_last * BLOCK]


def test_after_a_device_hit_the_tier_is_asked_for_the_rest_only():
    cache = _cache()
    prompt = list(range(100, 116))  # 4 whole blocks
    keys = block_keys(np.array(prompt), BLOCK, root_hash(None))
    cache.admit("a", prompt[:5])  # the first block filled and indexed
    plan = cache.plan_admission("b", prompt)
    assert plan.num_hit == BLOCK
    parent, asked, tokens = plan.missing(BLOCK)
    assert (parent, asked) == (keys[0], keys[1:3])
    assert tokens.tolist() == prompt[BLOCK:3 * BLOCK]


def test_a_hybrid_tier_ask_stops_before_the_last_tokens_block_in_every_group():
    """Group 1 (a window of 4) is asked for what a hit at the end of the asked blocks reads:
    from the window's first block, under its own keys; never the last token's block."""
    prompt = list(range(100, 124))  # 6 whole blocks: 5 asked of the full group
    keys = block_keys(np.array(prompt), BLOCK, root_hash(None))
    _, asked, tokens = _cache((W4, FULL)).plan_admission("a", prompt).missing(BLOCK)
    # a hit of 5 blocks (20 tokens): the window's query at 20 reads from token 17, block 4
    assert asked == [*keys[:5], group_key(keys[4], 1)]
    assert tokens.tolist() == prompt[:5 * BLOCK] + prompt[4 * BLOCK:5 * BLOCK]
