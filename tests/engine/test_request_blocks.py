"""The request limit of a hybrid layout (`limits.request_blocks`) and the steps a recomputed
sequence catches up in (`limits.catch_up_tokens`), against the blocks a cache really holds
and an engine that preempts.

A window group holds its window and one step's tokens, so a sequence's peak is its prompt's
step (every group holds the prompt's blocks) or its last decode step (the full groups hold
everything); the limit once added the full groups at the longest to a prompt-sized step
there (89 blocks for a 75-token prompt and 30 new tokens that never hold more than 76) and
refused requests that fit. The tighter limit stays a safe bound: a straight run never holds
more, and a recomputed sequence, which could hold up to the old count in one step of its
prompt's length near its end, catches up in steps the pool holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_kv import CacheConfig, LayerKind, OutOfBlocksError, PagedKVCache
from paged_kv.engine import SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.limits import catch_up_tokens, request_blocks
from paged_kv.engine.threads import intra_op_threads

from ..conftest import make_engine
from .conftest import prompt
from .test_serving import assert_drained, drive, tokens_of

BLOCK = 4
# 3 window layers and 1 full one: four groups of one layer
KINDS = (LayerKind.sliding(4),) * 3 + (LayerKind(),)
SHAPE = dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
             intermediate_size=128, vocab_size=256, max_position=512)
PROMPT_LEN, MAX_TOKENS = 75, 30


def _cache(kinds: tuple[LayerKind, ...], num_blocks: int, block_size: int = BLOCK
           ) -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_layers=len(kinds), num_kv_heads=1, head_dim=4,
                                    block_size=block_size, num_blocks=num_blocks,
                                    dtype=torch.float32, layer_kinds=kinds,
                                    enable_prefix_caching=False))


def _run(cache: PagedKVCache, steps: list[int]) -> int:
    """Prepare a new sequence's tokens in steps of `steps` tokens; the most blocks held."""
    cache.add_sequence("s")
    peak = 0
    for count in steps:
        cache.prepare({"s": count})
        peak = max(peak, cache.stats().num_live_blocks)
    cache.free("s")
    return peak


def test_the_limit_counts_what_the_prompt_and_the_decode_steps_hold():
    config = _cache(KINDS, 200).config
    old = config.blocks_for_sequence(PROMPT_LEN + MAX_TOKENS - 1, PROMPT_LEN)
    need = request_blocks(config, PROMPT_LEN, MAX_TOKENS, PROMPT_LEN)
    assert (old, need) == (89, 76)  # 4 groups of cdiv(75, 4) blocks in the prompt's step
    cache = _cache(KINDS, need + 1)  # exactly the limit: one more would run out
    assert _run(cache, [PROMPT_LEN] + [1] * (MAX_TOKENS - 1)) == need


# (layer kinds, block size, prompt length, max tokens, prompt step)
CASES = [
    pytest.param(KINDS, 4, 75, 30, 75, id="three-windows-one-full"),
    pytest.param(KINDS, 4, 75, 30, 16, id="chunked-prefill"),
    pytest.param((LayerKind.sliding(8), LayerKind()), 4, 9, 120, 9, id="long-decode"),
    pytest.param((LayerKind.sliding(5), LayerKind.chunked(8), LayerKind()), 3, 40, 17, 11,
                 id="window-chunk-full-bs3"),
    pytest.param((LayerKind.sliding(6), LayerKind.sliding(3)), 4, 33, 25, 33,
                 id="windows-only"),
]


@pytest.mark.parametrize(("kinds", "block_size", "prompt_len", "max_tokens", "step"), CASES)
def test_a_straight_run_never_holds_more_than_the_limit(kinds, block_size, prompt_len,
                                                        max_tokens, step):
    """In a pool of exactly the limit, whatever the prompt's chunks (at most `step`), then
    one token a step to the longest: never out of blocks."""
    config = _cache(kinds, 2, block_size).config
    need = request_blocks(config, prompt_len, max_tokens, step)
    cache = _cache(kinds, need + 1, block_size)
    rng = np.random.default_rng(prompt_len)
    peaks = []
    for _ in range(4):
        chunks, left = [], prompt_len
        while left:
            chunks.append(int(rng.integers(1, min(step, left) + 1)))
            left -= chunks[-1]
        peaks.append(_run(cache, chunks + [1] * (max_tokens - 1)))
    peaks.append(_run(cache, [step] * (prompt_len // step) + [prompt_len % step] * (
        prompt_len % step > 0) + [1] * (max_tokens - 1)))
    assert max(peaks) <= need


@pytest.mark.parametrize(("kinds", "block_size", "prompt_len", "max_tokens", "step"), CASES)
def test_a_recomputed_sequence_catches_up_within_the_limit(kinds, block_size, prompt_len,
                                                           max_tokens, step):
    """A sequence preempted after decoding, recomputed from any first chunk (a budget cuts
    it short) in the steps `catch_up_tokens` allows: never out of blocks in a pool of the
    limit."""
    config = _cache(kinds, 2, block_size).config
    need = request_blocks(config, prompt_len, max_tokens, step)
    cache = _cache(kinds, need + 1, block_size)
    longest = prompt_len + max_tokens - 1
    for num_tokens in range(prompt_len + 1, longest + 1, 3):
        for first in range(1, num_tokens, 5):
            cache.add_sequence("s")
            done, budget = 0, first  # the first step's budget, then the rest
            while done < num_tokens:
                count = min(catch_up_tokens(cache.config, num_tokens, num_tokens - done),
                            budget)
                cache.prepare({"s": count})
                done, budget = done + count, num_tokens
            assert done == num_tokens
            cache.free("s")


def test_a_step_of_the_prompts_length_near_the_end_runs_out():
    """Why the catch-up steps: preempted at 101 tokens and recomputed from a first chunk of
    26 (a budget cut it), a step of the prompt's length to 101 takes the old count, 89
    blocks, from a pool of 76; the catch-up takes the rest in two steps."""
    cache = _cache(KINDS, 77)
    cache.add_sequence("s")
    cache.prepare({"s": 26})
    with pytest.raises(OutOfBlocksError, match="requested 76, only 63"):
        cache.prepare({"s": PROMPT_LEN})  # 26 -> 101: 89 blocks, 13 more than the pool
    assert catch_up_tokens(cache.config, 101, PROMPT_LEN) < PROMPT_LEN
    done = 26
    while done < 101:
        done += (count := catch_up_tokens(cache.config, 101, 101 - done))
        cache.prepare({"s": count})
    assert cache.stats().num_live_blocks <= 76


def test_a_request_that_fits_is_accepted_and_served():
    """The request the old limit refused ("needs 89 blocks, more than the pool's 76") runs
    alone in a pool of 76 blocks, with the reference's tokens; one block fewer is refused
    up front."""
    model = TinyLlama(TinyLlamaConfig(**SHAPE, layer_kinds=("sliding:4",) * 3 + ("full",)),
                      seed=0)
    tokens = prompt(PROMPT_LEN, seed=5, vocab_size=SHAPE["vocab_size"])
    params = SamplingParams(max_tokens=MAX_TOKENS)
    small = make_engine(model, num_blocks=76, block_size=BLOCK, num_threads=1)
    with pytest.raises(ValueError, match="needs 76 blocks, more than the pool's 75"):
        small.check_request(tokens, params)
    small.close()
    engine = make_engine(model, num_blocks=77, block_size=BLOCK, num_threads=1)
    engine.check_request(tokens, params)
    peak = []
    with intra_op_threads(1):
        ids, outputs, _ = drive(engine, {0: [(tokens, params)]},
                                on_step=lambda e: peak.append(e.cache.stats().num_live_blocks))
    assert tokens_of(outputs[ids[0]]) == [_reference(model, tokens, MAX_TOKENS)]
    assert max(peak) <= 76
    assert_drained(engine)
    engine.close()


def test_a_preempted_sequence_catches_up_in_the_engine():
    """Two requests that each fit a pool of 36 blocks (the 35-token one exactly, with its
    32-token prefill chunks) but not together: the later one is preempted after decoding
    past its prompt and recomputed. In steps of its prompt's length (the old policy) it
    needs more blocks than the pool from its second step on, and the engine never drains;
    in catch-up steps it gives the reference's tokens."""
    model = TinyLlama(TinyLlamaConfig(**SHAPE, layer_kinds=("sliding:4",) * 3 + ("full",)),
                      seed=0)
    requests = [(prompt(4, seed=6, vocab_size=SHAPE["vocab_size"]), 100),
                (prompt(35, seed=5, vocab_size=SHAPE["vocab_size"]), 60)]
    engine = make_engine(model, num_blocks=37, block_size=BLOCK, num_threads=1,
                         max_num_batched_tokens=32)
    assert request_blocks(engine.cache.config, 35, 60, 32) == 36
    with intra_op_threads(1):
        ids, outputs, _ = drive(engine, {0: [(tokens, SamplingParams(max_tokens=max_tokens))
                                             for tokens, max_tokens in requests]},
                                max_steps=400)
        expected = [_reference(model, tokens, max_tokens) for tokens, max_tokens in requests]
    assert engine.stats().num_preemptions > 0
    assert [tokens_of(outputs[i]) for i in ids] == [[tokens] for tokens in expected]
    assert_drained(engine)
    engine.close()


def _reference(model: TinyLlama, tokens: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the model's cache-free forward pass."""
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(int(model.forward_dense(torch.tensor(tokens + out))[-1].argmax()))
    return out
