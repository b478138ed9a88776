"""The engine over hybrid layouts beyond plain serving: preemption (recompute and swap),
tensor parallelism, 8-bit pages with tensor parallelism, a Gemma-3-shaped model's blocks at
long context, prefix hits of a prompt longer than the window, the request limit, metrics.

Tokens are compared with `TinyLlama.forward_dense` (see test_tiny_hybrid.py); every step is
followed by ``cache.check()``, and a drained engine holds no block.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv import PagedKVCache
from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.limits import request_blocks

from ..conftest import make_engine
from ..conftest import prometheus_value as metric
from .conftest import prompt
from .test_serving import assert_drained, drive, tokens_of
from .test_tiny_hybrid import (
    GREEDY,
    PROMPTS,
    SHAPE,
    VARIANTS,
    one_thread,  # noqa: F401 (autouse: one torch thread)
    serve,
)

BLOCK = 4
# Gemma 3's shape: five window layers to each full one
GEMMA = TinyLlamaConfig(**{**SHAPE, "num_layers": 6}, layer_kinds=("sliding:16",) * 5 + ("full",))
# every window layer in a group of its own, window 8: a prompt longer than the window fills
# more blocks per group in its prefill step than a decode step ever holds
LOCAL = TinyLlamaConfig(**{**SHAPE, "num_layers": 6}, layer_kinds=("sliding:8",) * 5 + ("full",))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def reference():
    """``reference(model, prompt, max_tokens)``: greedy tokens of ``forward_dense``
    (memoised)."""
    memo: dict[tuple, list[int]] = {}

    def run(model: TinyLlama, tokens: list[int], max_tokens: int) -> list[int]:
        out = memo.setdefault((id(model), tuple(tokens)), [])
        while len(out) < max_tokens:
            out.append(int(model.forward_dense(torch.tensor(tokens + out))[-1].argmax()))
        return out[:max_tokens]

    return run


@pytest.fixture(scope="module")
def models() -> dict[str, TinyLlama]:
    """test_tiny_hybrid.py's sliding/full mix, without and with sinks."""
    return {name: TinyLlama(TinyLlamaConfig(**SHAPE, **VARIANTS[name]))
            for name in ("mixed", "sinks")}


@pytest.fixture(scope="module")
def gemma() -> TinyLlama:
    return TinyLlama(GEMMA, seed=0)


@pytest.fixture(scope="module")
def local() -> TinyLlama:
    return TinyLlama(LOCAL, seed=0)


# -- preemption ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_reference_tokens(models, reference, mode):
    """The sliding/full mix in a pool too small for the five prompts at once: sequences
    are preempted (freed and recomputed, or swapped out and back) and still give the
    reference tokens."""
    params = SamplingParams(max_tokens=20)
    engine = make_engine(models["mixed"], num_blocks=29, block_size=BLOCK, num_threads=1,
                         num_host_blocks=64 if mode == "swap" else 0, preemption=mode)
    ids, outputs, _ = drive(engine, {0: [(p, params) for p in PROMPTS]})
    assert [tokens_of(outputs[i]) for i in ids] == [[reference(models["mixed"], p, 20)]
                                                    for p in PROMPTS]
    assert engine.stats().num_preemptions > 0
    if mode == "swap":
        assert engine.cache.stats().num_swap_outs > 0
    assert_drained(engine)


@pytest.mark.parametrize(("mode", "lengths", "num_blocks"), [
    ("recompute", (10, 10, 10), 50), ("swap", (10, 14, 20), 64)])
def test_preemption_after_a_prompt_longer_than_the_window(local, reference, mode, lengths,
                                                          num_blocks):
    """A prompt's prefill step holds all its blocks in every window group; later steps hold
    only the window. A preempted sequence must come back within the limit the request was
    accepted under (`CacheConfig.blocks_for_sequence`, which counts steps of at most the
    prompt's length).

    Faults this catches: a recompute that prefills the whole sequence (prompt and output)
    in one step, needing more blocks than the emptied pool has (the engine waited
    forever); a swap-in sized against blocks the step's window give-back only returns
    later (OutOfBlocksError out of ``step()``)."""
    prompts = [prompt(length, seed=seed, vocab_size=SHAPE["vocab_size"])
               for seed, length in enumerate(lengths)]
    params = SamplingParams(max_tokens=60)
    engine = make_engine(local, num_blocks=num_blocks, block_size=BLOCK, num_threads=1,
                         num_host_blocks=64 if mode == "swap" else 0, preemption=mode)
    ids, outputs, _ = drive(engine, {0: [(p, params) for p in prompts]}, max_steps=600)
    assert [tokens_of(outputs[i]) for i in ids] == [[reference(local, p, 60)] for p in prompts]
    assert engine.stats().num_preemptions > 0
    if mode == "swap":
        assert engine.cache.stats().num_swap_outs > 0
    assert_drained(engine)


def test_a_swapped_sequence_holds_its_window_only_and_is_counted_in_every_group(local):
    """Swapped right after the prefill of a prompt longer than the window, a sequence
    carries to the host only what a later query reads: no more than the swap-in is sized
    for (`CacheConfig.blocks_for_sequence` of one more token). While it is out, the stats
    count its host blocks over every group and no device block or token."""
    config = local.cache_config(num_blocks=64, block_size=BLOCK, num_host_blocks=64)
    cache = PagedKVCache(config)
    tokens = prompt(21, seed=3, vocab_size=SHAPE["vocab_size"])
    cache.add_sequence("s", tokens)
    cache.prepare({"s": tokens})
    cache.swap_out("s")
    cache.check()
    host = config.num_host_blocks - cache.groups[0].swap.allocator.num_obtainable_blocks
    assert host <= config.blocks_for_sequence(len(tokens) + 1, 1) < 6 * cdiv(len(tokens), BLOCK)
    stats = cache.stats()
    assert stats.num_swapped_blocks == host
    assert (stats.num_live_blocks, stats.num_live_tokens) == (0, 0)
    assert dict(stats.blocks_by_kind) == {"full": 0, "sliding:8": 0}
    cache.swap_in("s")
    cache.check()
    stats = cache.stats()
    assert stats.num_live_blocks == host and stats.num_swapped_blocks == 0
    assert stats.num_live_tokens == host * BLOCK - stats.num_empty_slots >= len(tokens)
    cache.free("s")
    assert cache.stats().num_live_blocks == 0


# -- tensor parallelism ----------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_two_ranks_serve_the_hybrid_model_with_sinks(models, reference, kv_cache_dtype):
    """Two gloo ranks over the sliding/full mix with sinks: float pages give the reference
    tokens; int8 pages give the single process's int8 tokens (the same quantised pages, each
    rank its heads)."""
    model = models["sinks"]
    config = model.cache_config(num_blocks=96, block_size=BLOCK, kv_cache_dtype=kv_cache_dtype)
    with Engine(model, EngineConfig(cache=config, tensor_parallel_size=2, num_threads=1)) as engine:
        outputs = engine.generate(PROMPTS, GREEDY)
        engine.check()
        assert engine.cache.stats().num_given_back > 0
        assert engine.cache.stats().num_live_blocks == 0
    got = [tokens_of(out) for out in outputs]
    if kv_cache_dtype == "auto":
        assert got == [[reference(model, p, GREEDY.max_tokens)] for p in PROMPTS]
    else:
        single = serve(model, PROMPTS, block_size=BLOCK, kv_cache_dtype="int8")
        assert got == [tokens_of(out) for out in single]


# -- a Gemma-3-shaped model at long context ---------------------------------------------------
def test_long_decode_holds_the_window_and_reports_it(gemma, reference):
    """Prompt 40 + 200 tokens, in the smallest pool the request limit accepts: every step
    the full layer holds ``cdiv(n, bs)`` blocks and the five window layers within one block
    each of ``cdiv(W, bs) + 1``; the rest went back to the pool, and the metrics say so."""
    tokens, max_tokens, window = prompt(40, seed=7, vocab_size=SHAPE["vocab_size"]), 200, 16
    config = gemma.cache_config(block_size=BLOCK)
    need = request_blocks(config, len(tokens), max_tokens, len(tokens))
    assert need < len(config.layer_groups) * cdiv(len(tokens) + max_tokens - 1, BLOCK)
    engine = make_engine(gemma, num_blocks=need + 1, block_size=BLOCK, num_threads=1)
    params = SamplingParams(max_tokens=max_tokens)
    with pytest.raises(ValueError, match=r"needs \d+ blocks, more than the pool's"):
        engine.check_request(tokens, SamplingParams(max_tokens=max_tokens + BLOCK))
    formula = 5 * (cdiv(window, BLOCK) + 1)
    held = []

    def blocks_held(engine: Engine) -> None:
        if not engine.scheduler.running:
            return
        [seq] = engine.scheduler.running
        num_tokens = engine.cache.tables.num_tokens_of(seq.seq_id)
        by_kind = dict(engine.cache.stats().blocks_by_kind)
        assert by_kind["full"] == cdiv(num_tokens, BLOCK)
        if num_tokens > len(tokens):  # decoding: the window only
            assert abs(by_kind["sliding:16"] - formula) <= 5, (num_tokens, by_kind)
        held.append(by_kind["sliding:16"])
        if num_tokens == 120:  # the gauges mid-run
            text = engine.metrics_text()
            assert metric(text, "paged_kv_blocks_by_kind", '{kind="sliding:16"}') == held[-1]
            assert metric(text, "paged_kv_blocks_by_kind", '{kind="full"}') == 30

    ids, outputs, _ = drive(engine, {0: [(tokens, params)]}, on_step=blocks_held)
    assert tokens_of(outputs[ids[0]]) == [reference(gemma, tokens, max_tokens)]
    assert len(held) == max_tokens - 1 and max(held[1:]) <= formula
    stats = engine.cache.stats()
    assert stats.num_given_back >= 5 * (cdiv(len(tokens) + max_tokens, BLOCK) - formula // 5)
    text = engine.metrics_text()
    assert metric(text, "paged_kv_given_back_blocks") == stats.num_given_back > 0
    assert metric(text, "paged_kv_given_back_bytes") == stats.bytes_given_back
    assert metric(text, "paged_kv_blocks_by_kind", '{kind="full"}') == 0
    assert_drained(engine)


@pytest.mark.parametrize("length", [40, 61])
def test_a_repeated_prompt_longer_than_the_window_hits(gemma, reference, length):
    """The silent-0% class (vllm #42258): the window layers give back the prompt's blocks
    while it decodes; a later request with the same prompt must still hit every full block
    before its last token (each window group needs only its window's blocks, kept cached),
    and report it as the cached tokens of its usage."""
    tokens = prompt(length, seed=length, vocab_size=SHAPE["vocab_size"])
    engine = make_engine(gemma, num_blocks=160, block_size=BLOCK, num_threads=1)
    hits = []
    for _ in range(2):
        ids, outputs, _ = drive(engine, {0: [(tokens, GREEDY)]})
        assert tokens_of(outputs[ids[0]]) == [reference(gemma, tokens, GREEDY.max_tokens)]
        hits.append(outputs[ids[0]].prefix_hit_tokens)
    assert engine.cache.stats().num_given_back > 0
    assert hits == [0, (length - 1) // BLOCK * BLOCK]
    assert engine.stats().prefix_hit_tokens == hits[1]
    assert_drained(engine)
