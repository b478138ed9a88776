"""KV events of a hybrid layout: each further layer group's blocks are published under the
leading group's key with the group's number as a 33rd byte (`paged_kv.core.groups.rules.
group_key`), chained like the leading group's; a prompt's 32-byte keys are the ones a router
computes from its tokens (`paged_kv.keys.block_keys`), so prefix routing still works."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from paged_kv import CacheConfig, LayerKind, PagedKVCache
from paged_kv.core.groups.rules import group_key
from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.events import KVEventsConfig, decode_batch
from paged_kv.keys import block_keys, root_hash
from paged_kv.router import PrefixIndex

from .test_kv_events import ANY, _drain, _sub

BLOCK = 4
SHAPE = dict(num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
             intermediate_size=128, vocab_size=256, max_position=512)
KINDS = {"mixed": ("sliding:8", "full") * 3,  # groups 0 (full) and 1
         "gemma": ("sliding:8",) * 5 + ("full",)}  # groups 0 (full) and 1-5


def published(kinds: tuple[str, ...], prompts: list[list[int]], num_blocks: int,
              ) -> tuple[list[list], Engine]:
    """Every event an engine over `kinds` published while serving `prompts` one after the
    other (3 tokens each), in order; the engine, closed."""
    model = TinyLlama(TinyLlamaConfig(**SHAPE, layer_kinds=kinds), seed=0)
    engine = Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=num_blocks, block_size=BLOCK),
        kv_events=KVEventsConfig(ANY, ANY, token_ids=True), num_threads=1))
    socket = _sub(engine.events.endpoint)
    try:
        time.sleep(0.3)  # the subscription reaches the publisher before anything is sent
        for tokens in prompts:
            engine.generate([tokens], SamplingParams(max_tokens=3))
        batches = [decode_batch(frames[2]) for frames in _drain(socket)]
    finally:
        socket.close(0)
        engine.close()
    return [event for _, events in batches for event in events], engine


@pytest.mark.parametrize("kinds", list(KINDS))
def test_every_group_publishes_its_blocks_under_its_key(kinds):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, 41).tolist()  # five windows of 8
    events, engine = published(KINDS[kinds], [prompt], num_blocks=96)
    num_groups = len(engine.cache.groups)
    stored = [event for event in events if event[0] == "BlockStored"]
    keys = {key for event in stored for key in event[1]}
    assert {len(key) for key in keys} == {32, 33}
    assert {key[32] for key in keys if len(key) == 33} == set(range(1, num_groups))

    # the prompt's 32-byte keys are a router's, and every group stored each of its blocks
    prompt_keys = block_keys(np.array(prompt), BLOCK, root_hash())
    assert len(prompt_keys) == 10
    assert set(prompt_keys) <= {key for key in keys if len(key) == 32}
    for group in range(1, num_groups):
        assert {group_key(key, group) for key in prompt_keys} <= keys

    # a group's chain links like the leading group's: its own parent, the same tokens
    for _, hashes, parent, tokens, block_size, _lora, medium in stored:
        assert (block_size, medium) == (BLOCK, "GPU") and parent is not None
        assert len(tokens) == BLOCK * len(hashes)
        for i, key in enumerate(hashes):
            before = parent if i == 0 else hashes[i - 1]
            assert len(before) == len(key) and before[32:] == key[32:], "one group a chain"
            piece = np.asarray(tokens[i * BLOCK:(i + 1) * BLOCK], "<i4").tobytes()
            assert hashlib.sha256(before[:32] + piece).digest() == key[:32]

    index = PrefixIndex()
    index.apply("replica", events)
    assert index.match(prompt_keys, ["replica"]) == {"replica": len(prompt_keys)}


def test_stored_minus_removed_is_the_index_of_every_group():
    """A small pool: later prompts evict earlier blocks of every group; what the events
    say is held is what the engine's prefix index holds, group keys included."""
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 13).tolist()
    prompts = [shared + rng.integers(0, 256, int(n)).tolist() for n in (30, 20, 28, 25)]
    events, engine = published(KINDS["gemma"], prompts, num_blocks=80)
    held: set[bytes] = set()
    kinds = set()
    for event in events:
        kinds.add(event[0])
        if event[0] == "BlockStored":
            held.update(event[1])
        elif event[0] == "BlockRemoved":
            assert set(event[1]) <= held
            held.difference_update(event[1])
    assert "BlockRemoved" in kinds
    allocator = engine.cache.allocator
    indexed = {allocator.block_hash(b) for b in range(allocator.num_blocks)} - {None}
    assert held == indexed and any(len(key) == 33 for key in indexed)


@pytest.mark.parametrize("kinds", [(LayerKind.sliding(4), LayerKind()),
                                   (LayerKind.sliding(4), LayerKind.sliding(8))],
                         ids=["full-led", "window-led"])
def test_a_block_a_decode_step_fills_chains_from_the_one_before_it_in_every_group(kinds):
    """The events above stop 3 tokens after the prompt, so every block they store filled
    in the prompt's step. Blocks that fill on later steps, one token at a time, are
    mirrored into each other group under its key, chained from the block before them
    there (never from themselves): a subscriber rebuilds each key from its parent."""
    cache = PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4,
                                     block_size=BLOCK, num_blocks=32, layer_kinds=kinds))
    tokens = list(range(100, 114))
    cache.admit("a", tokens[:6])  # block 0 fills in the prompt's step
    for token in tokens[6:]:  # blocks 1 and 2 fill on decode steps (tokens 8 and 12)
        cache.prepare({"a": [token]})
    stored = [event for event in cache.take_events() if event.kind == "stored"]
    parent_of = {key: parent for event in stored
                 for key, parent in zip(event.keys, event.parents, strict=True)}
    keys = block_keys(np.array(tokens), BLOCK, root_hash())
    assert len(keys) == 3
    for group in range(len(cache.groups)):
        for column, key in enumerate(keys):
            before = group_key(keys[column - 1] if column else root_hash(), group)
            assert parent_of[group_key(key, group)] == before, (group, column)
    for event in stored:  # each key is its parent's hash with its block's tokens
        for i, (key, parent) in enumerate(zip(event.keys, event.parents, strict=True)):
            piece = event.token_ids[i * BLOCK * 4:(i + 1) * BLOCK * 4]
            assert hashlib.sha256(parent[:32] + piece).digest() == key[:32]
