"""Fixtures for the tier stores: real ``redis-server`` processes on free loopback ports."""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from paged_kv.bench.netdelay import RedisServer

REDIS_SERVER = shutil.which("redis-server")


@pytest.fixture
def redis_servers(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """A factory of `RedisServer` (``maxmemory="4mb"``, ``policy="allkeys-lru"``); every
    server it started is stopped at teardown. Skips without ``redis-server``; fails in CI."""
    if REDIS_SERVER is None:
        _missing("the redis-server binary (not on PATH)")
    if importlib.util.find_spec("redis") is None:
        _missing("the redis client (pip install -e '.[tiers]')")
    started: list[RedisServer] = []

    def start(maxmemory: str | None = None, policy: str = "allkeys-lru") -> RedisServer:
        for attempt in range(3):  # the free port may be taken before the server binds it
            try:
                server = RedisServer(str(tmp_path / f"redis-{len(started)}-{attempt}"),
                                     maxmemory, policy)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _missing(what: str) -> None:
    """Fail in CI (where .ci/run installs everything), skip elsewhere."""
    message = f"the remote tier's tests need {what}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def redis_server(redis_servers: Callable[..., RedisServer]) -> str:
    """The URL of a fresh ``redis-server``: ``redis://127.0.0.1:PORT/0``."""
    return redis_servers().url


# -- engines with tiers (test_engine_tiers.py, test_tiers_adversarial.py) -------------------
TIER_MODEL = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                  intermediate_size=128, vocab_size=256, max_position=1024)
BLOCK_SIZE = 16
MAX_TOKENS = 8
ENGINE_TIMEOUT_S = 30.0  # bound on serving one batch of requests


def full_block_tokens(prompt: list[int], block_size: int = BLOCK_SIZE) -> int:
    """Prompt tokens a full prefix hit covers: whole blocks, never the last token's."""
    return (len(prompt) - 1) // block_size * block_size


def random_prompts(count: int, length: int, seed: int, vocab: int = 256) -> list[list[int]]:
    """`count` distinct random prompts of `length` tokens (greedy outputs on these differ)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def serve_prompts(engine, prompts: list[list[int]], salt: str | None = None,
          timeout_s: float = ENGINE_TIMEOUT_S) -> list:
    """`RequestOutput` of each prompt (greedy, `MAX_TOKENS`), stepping the engine by hand
    (so a tenant's `salt` can be given) until all finished, bounded by `timeout_s`."""

    from paged_kv.engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS)
    ids = [engine.add_request(prompt, params, salt=salt) for prompt in prompts]
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while any(i not in done for i in ids):
        assert time.monotonic() < deadline, f"requests not done in {timeout_s} s"
        done.update((out.request_id, out) for out in engine.step())
    return [done[i] for i in ids]


def tokens_of(outputs: list) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def tier_stats(engine) -> dict:
    """``{tier name: TierStats}`` of an engine's tiers now."""
    return {tier.tier: tier for tier in engine.stats().tiers.tiers}


def chained_keys(prompt: list[int], salt: str | None = None,
                 block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained keys (`paged_kv.keys.hash_block`) of `prompt`'s full blocks."""
    import numpy as np

    from paged_kv.keys import encode_tokens, hash_block, root_hash

    tokens = np.asarray(prompt, dtype=np.int64)
    chain, keys = root_hash(salt), []
    for start in range(0, full_block_tokens(prompt, block_size), block_size):
        chain = hash_block(chain, encode_tokens(tokens[start:start + block_size]))
        keys.append(chain)
    return keys


def fingerprint(engine):
    """The `codec.Fingerprint` of `engine`'s blocks in its tiers."""
    return engine.tiers.fingerprint


def store_keys(engine, prompt: list[int], salt: str | None = None) -> list[str]:
    """The store keys (`codec.store_key`, as patched now) of `prompt`'s full blocks, as
    `engine`'s tiers name them."""
    from paged_kv.tiers import codec

    namespace = fingerprint(engine).namespace
    return [codec.store_key(namespace, key)
            for key in chained_keys(prompt, salt, engine.cache.config.block_size)]


@pytest.fixture(scope="session")
def tier_model():
    """``tier_model(seed=0)``: the small `TinyLlama` of `TIER_MODEL`, built once per seed."""
    from paged_kv.engine import TinyLlama, TinyLlamaConfig

    models: dict[int, object] = {}

    def get(seed: int = 0):
        if seed not in models:
            models[seed] = TinyLlama(TinyLlamaConfig(**TIER_MODEL), seed=seed)
        return models[seed]
    return get


@pytest.fixture
def tier_engines(tier_model):
    """``tier_engines(tiers=None, seed=0, block_size=16, kv_cache_dtype="auto",
    num_blocks=128)``: an `Engine` over `tier_model(seed)`; every one made is closed (its
    tier threads stopped) at teardown."""
    from paged_kv.engine import Engine
    from paged_kv.engine.config import EngineConfig

    engines: list = []

    def make(tiers=None, *, seed: int = 0, block_size: int = BLOCK_SIZE,
             kv_cache_dtype: str = "auto", num_blocks: int = 128):
        model = tier_model(seed)
        engine = Engine(model, EngineConfig(
            cache=model.cache_config(num_blocks=num_blocks, block_size=block_size,
                                     kv_cache_dtype=kv_cache_dtype),
            kv_tiers=tiers))
        engines.append(engine)
        return engine

    yield make
    for engine in reversed(engines):
        engine.close()


@pytest.fixture(scope="session")
def reference_tokens(tier_model):
    """``reference_tokens(prompts, seed=0, block_size=16, kv_cache_dtype="auto")``: the
    greedy tokens of each prompt on an engine without tiers, each computed from scratch
    (the device prefix cache dropped first); memoised."""
    from paged_kv.engine import Engine
    from paged_kv.engine.config import EngineConfig

    engines: dict[tuple, object] = {}
    memo: dict[tuple, list[int]] = {}

    def run(prompts, *, seed: int = 0, block_size: int = BLOCK_SIZE,
            kv_cache_dtype: str = "auto") -> list[list[int]]:
        config = (seed, block_size, kv_cache_dtype)
        if config not in engines:
            model = tier_model(seed)
            engines[config] = Engine(model, EngineConfig(cache=model.cache_config(
                num_blocks=128, block_size=block_size, kv_cache_dtype=kv_cache_dtype)))
        engine = engines[config]
        for prompt in prompts:
            if (*config, tuple(prompt)) not in memo:
                engine.cache.reset_prefix_cache()
                [out] = serve_prompts(engine, [prompt])
                assert out.prefix_hit_tokens == 0
                memo[(*config, tuple(prompt))] = out.outputs[0].token_ids
        return [memo[(*config, tuple(prompt))] for prompt in prompts]

    yield run
    for engine in engines.values():
        engine.close()


def tiers_summary(engine) -> str:
    """An engine's tier counters in one short line, for assertion messages."""
    stats = engine.stats().tiers
    tiers = "; ".join(f"{t.tier}: hit {t.hit_tokens} miss {t.misses} bad {t.verify_failures} "
                      f"held {t.blocks} wrote {t.written_blocks}" for t in stats.tiers)
    return (f"{tiers}; dropped {stats.dropped_writes} fallbacks {stats.deadline_fallbacks} "
            f"skipped {stats.skipped_fetches} loaded {stats.loaded_blocks} "
            f"fetches {stats.fetches}")


@pytest.fixture
def fetch_always(monkeypatch):
    """Engines' tiers fetch whenever a tier holds a prompt's blocks: the estimate of whether
    a fetch beats recomputing is kept from ever seeing a prefill (until then, as documented,
    fetching counts as worth it). On this tiny model a fetch and a recompute cost about the
    same, so the estimate would make hits depend on the machine's load; it is not what
    these tests check."""
    from paged_kv.tiers.manager import TierManager

    monkeypatch.setattr(TierManager, "observe_prefill", lambda self, num_tokens, seconds: None)
