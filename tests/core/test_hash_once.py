"""A prompt's blocks are hashed once per admission: its keys are computed once, on the
request, and carried to the device lookup, the tiers and the commit that indexes its blocks
(issue 27: the scheduler's size check, the cache's lookup and the tiers' lookup each hashed
the whole prompt again). The keys the allocator registers are the request's chain."""

from __future__ import annotations

import collections
import hashlib
import time

import numpy as np
import pytest

from paged_kv import CacheConfig, PagedKVCache
from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.keys import KEY_BYTES, TOKEN_BYTES, block_keys, encode_tokens, root_hash
from paged_kv.tiers import TierConfig
from paged_kv.tiers.manager import TierManager

BLOCK = 16
MODEL = TinyLlamaConfig(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, hidden_size=32,
                        intermediate_size=64, vocab_size=200, max_position=512)


@pytest.fixture
def block_hashes(monkeypatch) -> collections.Counter:
    """Every sha256 over one block's input (a parent key and `BLOCK` int32 tokens), counted
    by the bytes hashed; any module's hashing goes through ``hashlib.sha256``."""
    real, counts = hashlib.sha256, collections.Counter()

    def counting(data=b"", *args, **kwargs):
        if len(data) == KEY_BYTES + BLOCK * TOKEN_BYTES:
            counts[bytes(data)] += 1
        return real(data, *args, **kwargs)

    monkeypatch.setattr(hashlib, "sha256", counting)
    return counts


def prompt_blocks(prompt: list[int], salt: str | None = None) -> list[bytes]:
    """The input of each full block's hash: its parent's key and its tokens."""
    tokens = np.array(prompt)
    keys = block_keys(tokens, BLOCK, root_hash(salt))
    parents = [root_hash(salt), *keys[:-1]]
    return [parent + encode_tokens(tokens[i * BLOCK:(i + 1) * BLOCK])
            for i, parent in enumerate(parents)]


def serve(engine: Engine, prompt: list[int], salt: str | None = None) -> list[int]:
    """Serve one greedy request (8 tokens) to the end; returns prompt and output tokens."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                                    salt=salt)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the request did not finish in 60 s"
        for out in engine.step():
            if out.request_id == request_id:
                return prompt + out.outputs[0].token_ids


def prompt_of(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, MODEL.vocab_size, length).tolist()


def test_each_prompt_block_is_hashed_once_per_admission(block_hashes):
    model = TinyLlama(MODEL, seed=0)
    # 40 tokens a step: the prefill runs in chunks that end inside blocks
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=BLOCK),
                                        max_num_batched_tokens=40))
    first = prompt_of(1, 5 * BLOCK + 3)
    second = first[:3 * BLOCK] + prompt_of(2, 2 * BLOCK + 7)  # shares 3 blocks
    short = prompt_of(6, BLOCK + 5)  # one block: the miss is the last key
    for prompt, salt in ((first, "t"), (second, "t"), (second, None), (short, None)):
        blocks = prompt_blocks(prompt, salt)
        block_hashes.clear()
        serve(engine, prompt, salt)
        counts = [block_hashes[block] for block in blocks]
        assert counts == [1] * len(blocks), f"hashes per full prompt block: {counts}"
    engine.close()


def test_each_prompt_block_is_hashed_once_with_tiers(block_hashes, monkeypatch):
    # fetch whenever a tier holds the blocks (not only when it beats recomputing)
    monkeypatch.setattr(TierManager, "observe_prefill", lambda self, num_tokens, seconds: None)
    model = TinyLlama(MODEL, seed=0)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=BLOCK),
                                        kv_tiers=TierConfig(host_mib=8, fetch_deadline_s=5.0)))
    prompt = prompt_of(3, 4 * BLOCK + 5)
    try:
        serve(engine, prompt)
        assert engine.tiers.flush(timeout=10)
        engine.cache.reset_prefix_cache()  # now only the host tier holds the prompt
        blocks = prompt_blocks(prompt)
        block_hashes.clear()
        serve(engine, prompt)
        assert engine.stats().tiers.loaded_blocks == 4, "the prefix came from the tier"
        counts = [block_hashes[block] for block in blocks]
        assert counts == [1] * 4, f"hashes per full prompt block: {counts}"
    finally:
        engine.close()


def test_registered_keys_are_the_requests_chain():
    """The blocks a request filled (prompt and output) are indexed under its own chained
    keys, as a router or a tier would compute them from its tokens."""
    model = TinyLlama(MODEL, seed=0)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=BLOCK),
                                        max_num_batched_tokens=40))
    tokens = serve(engine, prompt_of(4, 3 * BLOCK + 9), salt="u")
    stored = [key for event in engine.cache.take_events() if event.kind == "stored"
              for key in event.keys]
    # the last sampled token is never written: its block holds the tokens before it
    assert stored == block_keys(np.array(tokens[:-1]), BLOCK, root_hash("u"))
    assert len(stored) == 4  # 3 prompt blocks, and the 4th, filled while decoding
    engine.close()


def test_add_sequence_keys_index_the_blocks_prepare_fills(block_hashes):
    """The facade's own path: `add_sequence` with the request's keys, then `prepare`,
    hashes nothing; without keys the lookup hashes to the first miss and the commit the
    blocks it fills (the first miss's again: keeping its key costs more than its hash)."""
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK,
                         num_blocks=32)
    prompt = prompt_of(5, 3 * BLOCK + 2)
    keys = block_keys(np.array(prompt), BLOCK, root_hash(None))
    blocks = prompt_blocks(prompt)
    for given, expected in ((keys, [0, 0, 0]), ((), [2, 1, 1])):
        cache = PagedKVCache(config)
        block_hashes.clear()
        cache.add_sequence("a", prompt, keys=given)
        cache.prepare({"a": prompt})
        assert [block_hashes[b] for b in blocks] == expected
        assert [cache.allocator.block_hash(b) for b in cache.tables.blocks("a")[:3]] == keys
