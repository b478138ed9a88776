"""A block's way through the tiers, step by step: written to each tier once that tier took
it (not when the write was queued), loaded back with the parent it was computed with and
in the order eviction expects, fetched under the default deadline, and a request aborted
while its prompt is loading from a tier leaves the engine stepping."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from paged_kv.core.cache import PagedKVCache
from paged_kv.core.step.prefix import match_prefix
from paged_kv.engine import SamplingParams
from paged_kv.keys import encode_tokens, hash_block, root_hash
from paged_kv.tiers import TierConfig

from ..conftest import tiny_config
from .conftest import (
    BLOCK_SIZE,
    ENGINE_TIMEOUT_S,
    chained_keys,
    full_block_tokens,
    random_prompts,
    serve_prompts,
    store_keys,
    tier_stats,
    tiers_summary,
    tokens_of,
)

PROMPT_LEN = 70  # 4 full blocks before the last token's block


def answers(store) -> bool:
    """Whether `store` (a RedisStore) is out of its backoff and a call to it succeeded."""
    if not store.available:
        return False
    errors = store.num_errors
    store.contains(["0f:00"])
    return store.num_errors == errors


# -- written once a tier took it -------------------------------------------------------------
@pytest.mark.usefixtures("fetch_always")
def test_blocks_computed_while_redis_was_down_reach_it_once_it_is_back(redis_servers,
                                                                        tier_engines):
    redis = pytest.importorskip("redis")
    from paged_kv.tiers import remote

    server = redis_servers()
    engine = tier_engines(TierConfig(host_mib=8, remote_url=server.url, fetch_deadline_s=5.0))
    [prompt] = random_prompts(1, PROMPT_LEN, seed=53)
    server.stop(kill=True)
    serve_prompts(engine, [prompt])  # computed: the host takes the blocks, Redis cannot
    assert engine.tiers.flush(timeout=10)
    assert tier_stats(engine)["host"].blocks == full_block_tokens(prompt) // BLOCK_SIZE
    assert tier_stats(engine)["remote"].written_blocks == 0

    server.start()  # empty, on the same port
    store = engine.tiers.stores[1]
    give_up = time.monotonic() + remote.BACKOFF_MAX_S + 5
    while not answers(store):
        assert time.monotonic() < give_up, "the remote tier never answered again"
        time.sleep(0.1)
    engine.cache.reset_prefix_cache()
    [out] = serve_prompts(engine, [prompt])  # from the host: stored on the device again
    assert out.prefix_hit_tokens == full_block_tokens(prompt), tiers_summary(engine)
    assert engine.tiers.flush(timeout=10)
    admin = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        names = ["pkv:" + name for name in store_keys(engine, prompt)]
        assert admin.exists(*names) == len(names), tiers_summary(engine)
    finally:
        admin.close()
    # and only Redis was written: the host held them already
    assert tier_stats(engine)["host"].written_blocks == len(names)
    assert tier_stats(engine)["remote"].written_blocks == len(names)

    replica = tier_engines(TierConfig(remote_url=server.url, fetch_deadline_s=5.0))
    [shared] = serve_prompts(replica, [prompt])
    assert shared.prefix_hit_tokens == full_block_tokens(prompt), tiers_summary(replica)
    assert shared.outputs[0].token_ids == out.outputs[0].token_ids


# -- loaded back as computed -------------------------------------------------------------------
@pytest.mark.usefixtures("fetch_always")
def test_loaded_blocks_are_stored_with_their_real_parents(tier_engines):
    engine = tier_engines(TierConfig(host_mib=8, fetch_deadline_s=5.0))
    [prompt] = random_prompts(1, PROMPT_LEN, seed=59)
    keys = chained_keys(prompt)  # 4 blocks
    serve_prompts(engine, [prompt])
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    stored: list = []
    after_step = engine.tiers.after_step
    engine.tiers.after_step = lambda events: (stored.extend(
        e for e in events if e.kind == "stored"), after_step(events))[1]

    # blocks 0-1 come back first (a prompt of 2 full blocks), then 2-3 after them
    [head] = serve_prompts(engine, [prompt[:2 * BLOCK_SIZE + 1]])
    [whole] = serve_prompts(engine, [prompt])
    assert head.prefix_hit_tokens == 2 * BLOCK_SIZE
    assert whole.prefix_hit_tokens == 4 * BLOCK_SIZE, tiers_summary(engine)
    assert engine.stats().tiers.loaded_blocks == 4
    parents = {key: parent for event in stored
               for key, parent in zip(event.keys, event.parents, strict=True)}
    assert parents[keys[0]] == root_hash(None)  # as a computed first block's
    assert parents[keys[1]] == keys[0]
    assert parents[keys[2]] == keys[1], "the run after a device prefix chains from it"
    assert parents[keys[3]] == keys[2]


def test_a_loaded_run_is_evicted_tail_first():
    cache = PagedKVCache(tiny_config(num_blocks=12, num_host_blocks=0))
    size = cache.config.block_size
    tokens = np.arange(1, 4 * size + 2, dtype=np.int64)  # 4 full blocks and a last token
    keys, chain = [], root_hash(None)
    for start in range(0, 4 * size, size):
        chain = hash_block(chain, encode_tokens(tokens[start:start + size]))
        keys.append(chain)
    payload = torch.zeros(4, cache.pool.block_nbytes, dtype=torch.uint8)
    assert cache.load_cached(keys, tokens[:4 * size], payload, root_hash(None)) == 4
    assert match_prefix(cache.allocator, tokens, size) == 4 * size
    allocator = cache.allocator
    allocator.allocate(allocator.num_free_blocks + 1)  # one cached block must go
    assert match_prefix(allocator, tokens, size) == 3 * size, "the head was evicted first"
    allocator.allocate(2)
    assert match_prefix(allocator, tokens, size) == 1 * size


# -- the default deadline ----------------------------------------------------------------------
def test_the_default_fetch_deadline_follows_the_recompute_estimate(tier_engines):
    engine = tier_engines(TierConfig(host_mib=1))  # no fetch_deadline_s: the default
    tiers = engine.tiers
    keys = [bytes([i]) * 32 for i in range(10)]
    tokens = np.zeros(10 * BLOCK_SIZE, dtype=np.int64)

    def deadline_s() -> float:
        fetch = tiers.start_fetch(keys, tokens, root_hash(None))
        fetch.cancelled = True
        return fetch.deadline - fetch.started

    assert deadline_s() == pytest.approx(1.0, abs=0.05)  # nothing measured yet
    tiers.observe_prefill(1000, 2.0)  # 2 ms a token: 160 tokens take 0.32 s
    assert deadline_s() == pytest.approx(0.75 * 0.32, abs=0.02)
    for _ in range(50):
        tiers.observe_prefill(1000, 1e-4)  # a very fast model: the floor
    assert deadline_s() == pytest.approx(0.02, abs=0.01)


# -- abort while loading -----------------------------------------------------------------------
@pytest.mark.usefixtures("fetch_always")
def test_a_request_aborted_while_loading_leaves_the_engine_stepping(tier_engines,
                                                                   reference_tokens):
    engine = tier_engines(TierConfig(host_mib=8, fetch_deadline_s=30.0))
    prompts = random_prompts(2, PROMPT_LEN, seed=61)
    serve_prompts(engine, prompts)
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    [store] = engine.tiers.stores
    gate, get = threading.Event(), store.get
    store.get = lambda keys: (gate.wait(ENGINE_TIMEOUT_S), get(keys))[1]  # a slow tier
    try:
        request_id = engine.add_request(prompts[0], SamplingParams(max_tokens=4))
        engine.step()
        assert engine.stats().num_loading == 1
        fetch = engine.scheduler.loading[0].fetch
        assert engine.abort(request_id)
        assert fetch.cancelled and engine.stats().num_loading == 0
        for _ in range(3):
            assert engine.step() == []
    finally:
        gate.set()
    deadline = time.monotonic() + 10
    while not fetch.done:
        assert time.monotonic() < deadline, "the cancelled fetch never ended"
        time.sleep(0.01)
    assert tokens_of(serve_prompts(engine, prompts)) == reference_tokens(prompts)
    assert not engine.has_unfinished_requests
    engine.check()




def test_an_engine_that_fails_to_start_releases_its_disk_directory(tmp_path, tier_model):
    """A constructor failing after the tiers opened (here: the events port is taken) closes
    them, so a retry in the same process gets the disk directory back."""
    zmq = pytest.importorskip("zmq")
    from paged_kv.engine import Engine
    from paged_kv.engine.config import EngineConfig
    from paged_kv.events import KVEventsConfig
    from paged_kv.tiers.disk import DiskStore

    config = TierConfig(disk_dir=str(tmp_path / "disk"), disk_mib=1)
    model = tier_model()
    context = zmq.Context.instance()
    taken = context.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match="--kv-events: cannot bind"):  # after the tiers
            Engine(model, EngineConfig(cache=model.cache_config(num_blocks=32), kv_tiers=config,
                                       kv_events=KVEventsConfig(f"tcp://127.0.0.1:{port}", None)))
    finally:
        taken.close(linger=0)
    DiskStore(config.disk_dir, cap_bytes=1 << 20).close()  # not held by the failed engine
