"""The hybrid layout by example: how layers group, what a block weighs, prefix hits for
every mix of kinds (after the window's early blocks were evicted too), events, the blocks
given back, the memory a Gemma-3-shaped model saves, and a stranger's batch refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_kv import CacheConfig, LayerKind, OutOfBlocksError, PagedKVCache
from paged_kv.config import group_layers
from paged_kv.core.groups.rules import group_key
from paged_kv.keys import block_keys, encode_tokens, root_hash

W4, W8, C8, FULL = LayerKind.sliding(4), LayerKind.sliding(8), LayerKind.chunked(8), LayerKind()


def _cache(kinds: tuple[LayerKind, ...], num_blocks: int = 64, block_size: int = 4,
           **overrides) -> PagedKVCache:
    fields = dict(num_layers=len(kinds), num_kv_heads=1, head_dim=4, block_size=block_size,
                  num_blocks=num_blocks, dtype=torch.float32, layer_kinds=kinds)
    fields.update(overrides)
    return PagedKVCache(CacheConfig(**fields))


def _run(cache: PagedKVCache, seq_id: str, tokens: list[int], *, decode_from: int) -> None:
    """Admit `seq_id` with ``tokens[:decode_from]``, then decode the rest one by one (the
    window rows give blocks back as they go)."""
    cache.admit(seq_id, tokens[:decode_from])
    for token in tokens[decode_from:]:
        cache.prepare({seq_id: [token]})


def _cached_columns(cache: PagedKVCache, group: int, tokens: list[int]) -> list[bool]:
    """Whether each full block of `tokens` is in the prefix cache for layer group
    `group` (under the key that names the group)."""
    bs = cache.config.block_size
    keys = block_keys(np.array(tokens), bs, root_hash(None))
    return [cache.allocator.lookup(group_key(key, group),
                                   encode_tokens(np.array(tokens[i * bs:(i + 1) * bs])))
            is not None for i, key in enumerate(keys)]


# -- grouping and sizes -------------------------------------------------------------------
def test_gemma3_shape_groups_by_threes():
    """Gemma 3: five local layers, then a global one, three times: groups of 3 layers (the
    rarest kind's count), the full group first."""
    local = LayerKind.sliding(512)
    kinds = ((local,) * 5 + (FULL,)) * 3
    groups = group_layers(kinds)
    assert [(str(kind), layers) for kind, layers in groups] == [
        ("full", (5, 11, 17)), ("sliding:512", (0, 1, 2)), ("sliding:512", (3, 4, 6)),
        ("sliding:512", (7, 8, 9)), ("sliding:512", (10, 12, 13)),
        ("sliding:512", (14, 15, 16))]
    assert sorted(layer for _, layers in groups for layer in layers) == list(range(18))


def test_gpt_oss_shape_alternates_into_two_groups():
    """gpt-oss: sliding and full layers alternate: one group of each, half the layers."""
    window = LayerKind.sliding(128)
    kinds = (window, FULL) * 12
    assert [(str(kind), layers) for kind, layers in group_layers(kinds)] == [
        ("full", tuple(range(1, 24, 2))), ("sliding:128", tuple(range(0, 24, 2)))]


def test_a_hybrid_block_spans_one_group_of_layers():
    kinds = ((LayerKind.sliding(512),) * 5 + (FULL,)) * 3
    config = CacheConfig(num_layers=18, num_kv_heads=2, head_dim=8, block_size=16,
                         num_blocks=10, dtype=torch.float16, layer_kinds=kinds)
    assert config.group_size == 3
    # 3 layers * (K, V) * 16 tokens * 2 heads * 8 dims * 2 bytes
    assert config.bytes_per_block == 3 * 2 * 16 * 2 * 8 * 2
    assert config.bytes_per_block * 6 == config.bytes_per_token * config.block_size
    cache = PagedKVCache(config)
    assert cache.pool.nbytes == config.total_bytes == config.bytes_per_block * 10
    int8 = CacheConfig(num_layers=18, num_kv_heads=2, head_dim=8, block_size=16,
                       num_blocks=10, layer_kinds=kinds, kv_cache_dtype="int8")
    assert int8.bytes_per_block == 3 * 2 * 16 * 2 * (8 + 2)  # int8 values, bf16 scales


# -- prefix hits --------------------------------------------------------------------------
MIXES = {
    "full+sliding": (W4, FULL),
    "full+chunked": (FULL, C8),
    "sliding+chunked": (W4, C8),
    "window-only": (W4, W8),
    "one-window-group": (W4, W4),
    "all-kinds": (W4, FULL, C8, W8),
}


@pytest.mark.parametrize("kinds", MIXES.values(), ids=MIXES.keys())
def test_a_repeated_prompt_hits_for_every_mix(kinds):
    """The silent-0% regression: a group that never indexes its blocks (or indexes them
    under keys the lookup does not ask for) makes every hit 0."""
    cache = _cache(kinds)
    prompt = list(range(100, 121))  # 5 full blocks and one token
    cache.admit("a", prompt)
    hit, batch = cache.admit("b", prompt)
    assert hit == 20 and batch.num_tokens == 1
    cache.free("a")
    cache.free("b")
    hit, _ = cache.admit("c", prompt)  # from blocks no sequence holds any more
    assert hit == 20
    cache.check()


@pytest.mark.parametrize("kinds", MIXES.values(), ids=MIXES.keys())
def test_a_repeated_prompt_of_whole_blocks_still_computes_its_last_token(kinds):
    """Every block of a prompt of whole blocks is cached once it ran, the last token's
    block too; a repeat hits all but that block, so its last token is computed (its logits
    are what the request samples from). A window leader (no full group) finds its hit right
    to left, not through the uniform lookup that stops before the last token's block."""
    cache = _cache(kinds)
    prompt = list(range(100, 120))  # 5 whole blocks
    cache.admit("a", prompt)
    assert all(_cached_columns(cache, 0, prompt))
    hit, batch = cache.admit("b", prompt)
    assert (hit, batch.num_tokens) == (16, 4)
    assert cache.plan_admission("c", prompt).count == 4
    cache.check()


@pytest.mark.parametrize("kinds", MIXES.values(), ids=MIXES.keys())
def test_a_hit_survives_the_window_moving_on(kinds):
    """A sequence decoded well past its prompt has given its early window blocks back;
    they stay indexed, so its whole history is still a prefix hit."""
    cache = _cache(kinds)
    tokens = list(range(100, 133))  # 8 full blocks and one token
    _run(cache, "a", tokens, decode_from=6)
    assert cache.stats().num_given_back > 0
    cache.free("a")
    hit, _ = cache.admit("b", [*tokens, 7])
    assert hit == 32
    cache.check()


@pytest.mark.parametrize("kinds", MIXES.values(), ids=MIXES.keys())
def test_a_prompt_diverging_inside_a_block_hits_the_blocks_before_it(kinds):
    cache = _cache(kinds)
    prompt = list(range(100, 121))
    cache.admit("a", prompt)
    cache.free("a")
    hit, _ = cache.admit("b", [*prompt[:10], 1, 2, 3, 4, 5, 6])  # diverges in block 2
    assert hit == 8
    cache.check()


def _evict_early_window_blocks(kinds, num_blocks):
    """Decode a long sequence (the window rows give their early blocks back, so those are
    the least recently used cached blocks), free it, then take the free blocks and two
    more: the two evicted are the window's first blocks."""
    cache = _cache(kinds, num_blocks=num_blocks)
    tokens = list(range(100, 132))  # 8 full blocks
    _run(cache, "a", tokens, decode_from=8)
    cache.free("a")
    pressure = cache.allocator.num_free_blocks + 2
    cache.admit("filler", [7] * (4 * (pressure // len(cache.groups))))
    return cache, tokens


def test_a_hit_after_the_windows_early_blocks_were_evicted():
    """Right to left (vLLM's rule): a window layer needs only the blocks its next query
    reads, so a hit far past evicted early blocks is still found; the same blocks read
    left to right, as a full layer must, give nothing."""
    cache, tokens = _evict_early_window_blocks((W4, FULL), num_blocks=20)
    window = next(g.index for g in cache.groups if not g.kind.is_full)
    cached = _cached_columns(cache, window, tokens)
    assert not cached[0] and all(cached[2:]), "the pressure did not evict the early blocks"
    assert cache.groups[0].kind.is_full  # the full group reads them left to right
    assert cache.groups[0].accepted_hit(8, cached.__getitem__) == 0
    assert cache.groups[window].accepted_hit(8, cached.__getitem__) == 8
    assert all(_cached_columns(cache, 0, tokens))
    hit, _ = cache.admit("b", [*tokens, 1])
    assert hit == 32
    cache.check()


def test_a_window_only_hit_after_its_early_blocks_were_evicted():
    """Mistral-like (every layer a window): the leading group is a window too, so its
    lookup must also go right to left."""
    cache, tokens = _evict_early_window_blocks((W4, W8), num_blocks=14)
    for group in cache.groups:
        cached = _cached_columns(cache, group.index, tokens)
        assert not cached[0] and all(cached[6:]), "the pressure did not evict early blocks"
    assert cache.plan_admission("b", [*tokens, 1]).num_hit == 32


# -- capacity -----------------------------------------------------------------------------
def _forked_at_a_window_edge(num_blocks: int):
    """Two forks of one 4-token sequence (blocks of 2, windows of 3 and a chunk of 4):
    their next token makes both give back the same shared blocks."""
    kinds = (LayerKind.sliding(3), FULL, LayerKind.sliding(3), LayerKind.chunked(4))
    cache = _cache(kinds, num_blocks=num_blocks, block_size=2, enable_prefix_caching=False)
    cache.admit("a", [1, 2, 3, 4])
    cache.fork("a", "b")
    return cache


def test_num_blocks_needed_credits_shared_blocks_forks_give_back_together():
    cache = _forked_at_a_window_edge(num_blocks=40)
    step = {"a": [5], "b": [5]}
    needed = cache.num_blocks_needed(step)
    before = cache.allocator.num_obtainable_blocks
    cache.prepare(step)
    assert before - cache.allocator.num_obtainable_blocks == needed


def test_a_forked_step_that_fits_is_not_refused():
    """8 new blocks, 4 shared ones given back first: 5 obtainable are enough (one row at a
    time it succeeds), so the step must not raise."""
    cache = _forked_at_a_window_edge(num_blocks=18)
    cache.admit("filler", [9, 9])  # one block in each of the 4 groups
    assert cache.allocator.num_obtainable_blocks == 5
    cache.prepare({"a": [5], "b": [5]})
    cache.check()


def test_the_same_forked_step_one_row_at_a_time_fits():
    """The control of the test above: the pool does hold the step."""
    cache = _forked_at_a_window_edge(num_blocks=18)
    cache.admit("filler", [9, 9])
    cache.prepare({"a": [5]})
    cache.prepare({"b": [5]})
    assert cache.allocator.num_obtainable_blocks == 1
    with pytest.raises(OutOfBlocksError):
        cache.prepare({"filler": 16})
    cache.check()


# -- events and accounting ----------------------------------------------------------------
def test_events_name_every_groups_stored_blocks():
    """A step's stored events cover every group: the leader's under the prompt's keys,
    every other group's under the same keys and its group byte."""
    cache = _cache((W4, FULL, C8))
    prompt = list(range(100, 113))  # 3 full blocks
    cache.take_events()
    cache.admit("a", prompt)
    stored = [e for e in cache.take_events() if e.kind == "stored"]
    keys = block_keys(np.array(prompt), 4, root_hash(None))
    by_group = {index: [k for e in stored for k in e.keys if k in
                        {group_key(key, index) for key in keys}]
                for index in range(len(cache.groups))}
    for index in range(len(cache.groups)):
        assert len(by_group[index]) == 3, f"group {index}: {len(by_group[index])} stored"
        if index:
            assert all(k[-1] == index and len(k) == len(keys[0]) + 1
                       for k in by_group[index])
    for event in stored:  # parents chain under the same group's keys
        assert all(len(p) == len(k) for p, k in zip(event.parents, event.keys, strict=True)
                   if p)


def test_a_long_decode_holds_about_a_window_per_window_group():
    kinds = (W8, FULL, C8, W8)
    cache = _cache(kinds, num_blocks=200)
    n = 200
    _run(cache, "a", list(range(n)), decode_from=10)
    stats = cache.stats()
    by_kind = dict(stats.blocks_by_kind)
    bs = 4
    assert by_kind["full"] == -(-n // bs)
    # one window group of W8 per sliding layer (2 layers, groups of 1), one chunked
    assert abs(by_kind["sliding:8"] - 2 * (-(-8 // bs) + 1)) <= 2
    assert abs(by_kind["chunked:8"] - (-(-8 // bs) + 1)) <= 1
    window_groups = 3
    kept = by_kind["sliding:8"] + by_kind["chunked:8"]
    assert stats.num_given_back == window_groups * -(-n // bs) - kept
    assert stats.bytes_given_back == stats.num_given_back * cache.config.bytes_per_block
    assert stats.num_live_blocks == by_kind["full"] + kept


def test_gemma3_shape_holds_a_quarter_of_the_full_models_bytes():
    """18 layers (15 sliding:512, 3 full) in blocks of 16 holding one 8192-token sequence,
    prefilled in chunks of 512 then one decode step: at most 25% of the live bytes the
    same model takes with every layer full."""
    local = LayerKind.sliding(512)
    kinds = ((local,) * 5 + (FULL,)) * 3
    tokens = list(range(8192))

    def live_bytes(layer_kinds) -> int:
        cache = _cache(layer_kinds, num_blocks=1100, block_size=16, dtype=torch.float16)
        cache.admit("a", tokens, max_tokens=512)
        for start in range(512, 8192, 512):
            cache.prepare({"a": tokens[start:start + 512]})
        cache.prepare({"a": [1]})
        return cache.stats().live_bytes

    hybrid, full = live_bytes(kinds), live_bytes((FULL,) * 18)
    assert hybrid <= 0.25 * full, f"{hybrid} bytes, {hybrid / full:.1%} of all-full"


# -- a stranger's batch -------------------------------------------------------------------
def test_a_batch_from_another_cache_is_refused():
    cache = _cache((W4, FULL))
    cache.add_sequence("a")
    key = torch.zeros(1, 1, 4)
    uniform = _cache((FULL, FULL))
    uniform.add_sequence("a")
    with pytest.raises(ValueError, match="not a StepBatch this cache's prepare"):
        cache.write(0, key, key, uniform.prepare({"a": [1]}))
    other = _cache((W4, FULL, C8))
    other.add_sequence("a")
    with pytest.raises(ValueError, match="not a StepBatch this cache's prepare"):
        cache.write(1, key, key, other.prepare({"a": [1]}))
