"""Caller mistakes raise a clear error naming what was wrong, and change nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from paged_kv import CacheConfig, OutOfBlocksError, PagedKVCache
from paged_kv.core import decode_rows as decode
from paged_kv.core.cache import snapshot

from ..conftest import assert_same_snapshot, tiny_config

# the decode bookkeeping's two variants (`paged_kv.core.decode_rows`): each checks rows its own way
VARIANTS = [pytest.param(False, id="numpy"),
            pytest.param(True, id="numba", marks=pytest.mark.skipif(
                decode.numba is None, reason="numba (the fast extra) is not installed"))]


@pytest.fixture(params=VARIANTS)
def cache(request) -> PagedKVCache:
    """A cache with history: a prefix-sharing pair, a fork, a swapped-out sequence; on each
    decode variant."""
    cache = PagedKVCache(tiny_config(), compiled=request.param)
    prompt = list(range(10))
    for seq_id in ("a", "b"):
        hit = cache.add_sequence(seq_id, prompt)
        batch = cache.prepare({seq_id: prompt[hit:]})
        for layer in range(2):
            k = torch.randn(batch.num_tokens, 2, 4)
            cache.write(layer, k, -k, batch)
    cache.fork("a", "a.1")
    cache.add_sequence("z", [3, 3, 3])
    cache.prepare({"z": [3, 3, 3]})
    cache.swap_out("z")
    return cache


def _batch(cache: PagedKVCache):
    return cache.prepare({"a": [1]})


# (case id, call, exception type, pattern the message must contain)
BAD_CALLS = [
    ("add duplicate id", lambda c: c.add_sequence("a"), ValueError, "'a' already exists"),
    ("add unhashable id", lambda c: c.add_sequence(["x"]), TypeError, "hashable"),
    ("add float prompt", lambda c: c.add_sequence("n", [1.5, 2.0]), TypeError, "ints"),
    ("add negative token", lambda c: c.add_sequence("n", [1, -3]), ValueError, "token ids"),
    ("add string prompt", lambda c: c.add_sequence("n", "hello"), TypeError, "sequence of ints"),
    ("prepare unknown id", lambda c: c.prepare({"nope": [1]}), KeyError, "'nope'"),
    ("prepare empty", lambda c: c.prepare({}), ValueError, "at least one"),
    ("prepare zero count", lambda c: c.prepare({"a": 0}), ValueError, "'a' has 0"),
    ("prepare negative count", lambda c: c.prepare({"a": -2}), ValueError, "'a' has -2"),
    ("prepare no tokens", lambda c: c.prepare({"a": []}), ValueError, "'a' has no new tokens"),
    ("prepare float tokens", lambda c: c.prepare({"a": [1.0]}), TypeError, "ints"),
    ("prepare mixed float", lambda c: c.prepare({"a": 1, "b": [0.5]}), TypeError, "'b'"),
    ("prepare ragged ids", lambda c: c.prepare({"a": [[1, 2]], "b": [3]}), TypeError, "'a'"),
    ("add salt not str", lambda c: c.add_sequence("n", [1], salt=5), TypeError, "salt"),
    ("prepare swapped", lambda c: c.prepare({"z": [1]}), ValueError, "swapped out"),
    ("prepare not a mapping", lambda c: c.prepare([("a", [1])]), TypeError, "mapping"),
    ("rows_of unknown", lambda c: c.rows_of(["a", "nope"]), KeyError, "'nope'"),
    ("rows_of swapped", lambda c: c.rows_of(["z"]), ValueError, "not resident"),
    ("decode swapped row", lambda c: c.prepare_decode(
        np.array([c.tables.row_of["z"]]), np.array([1])), ValueError, "not resident"),
    ("decode unused row", lambda c: c.prepare_decode(np.array([63]), np.array([1])),
     ValueError, "not resident"),
    ("decode row past the end", lambda c: c.prepare_decode(  # one past the last row
        np.array([c.tables.num_tokens.shape[0]]), np.array([1])), ValueError, "not resident"),
    ("decode negative row", lambda c: c.prepare_decode(np.array([-1]), np.array([1])),
     ValueError, "not resident"),
    ("decode row twice", lambda c: c.prepare_decode(np.array([0, 0]), np.array([1, 2])),
     ValueError, "twice"),
    ("decode float rows", lambda c: c.prepare_decode(np.array([0.0]), np.array([1])),
     TypeError, "rows"),
    ("decode no rows", lambda c: c.prepare_decode(np.array([], dtype=int), np.array([])),
     TypeError, "non-empty"),
    ("decode token count", lambda c: c.prepare_decode(c.rows_of(["a", "b"]), np.array([1])),
     ValueError, "one per row"),
    ("decode negative token", lambda c: c.prepare_decode(c.rows_of(["a"]), np.array([-1])),
     ValueError, "token ids"),
    ("free unknown", lambda c: c.free("nope"), KeyError, "double free"),
    ("fork onto existing", lambda c: c.fork("a", "b"), ValueError, "'b' already exists"),
    ("fork unknown parent", lambda c: c.fork("nope", "c"), KeyError, "'nope'"),
    ("fork swapped parent", lambda c: c.fork("z", "c"), ValueError, "swapped out"),
    ("swap_in resident", lambda c: c.swap_in("a"), ValueError, "not swapped out"),
    ("swap_out swapped", lambda c: c.swap_out("z"), ValueError, "swapped out"),
    ("truncate too long", lambda c: c.truncate("a", 11), ValueError, "[0, 10]"),
    ("truncate negative", lambda c: c.truncate("a", -1), ValueError, "got -1"),
    ("truncate float", lambda c: c.truncate("a", 2.0), TypeError, "num_tokens must be an int"),
    ("truncate swapped", lambda c: c.truncate("z", 1), ValueError, "swapped out"),
    ("tokens of unknown", lambda c: c.tables.num_tokens_of("nope"), KeyError, "'nope'"),
    ("gather pad_to short", lambda c: c.gather(0, ["a"], pad_to=3), ValueError, "pad_to"),
    ("gather layer range", lambda c: c.gather(5, ["a"]), ValueError, "layer 5 out of range"),
    ("gather unknown", lambda c: c.gather(0, ["a", "nope"]), KeyError, "'nope'"),
    ("gather duplicate", lambda c: c.gather(0, ["a", "a"]), ValueError, "duplicate"),
    ("gather swapped", lambda c: c.gather(0, ["z"]), ValueError, "swapped out"),
    ("gather bad out", lambda c: c.gather(0, ["a"], out=(torch.empty(1, 9, 2, 4),) * 2),
     ValueError, "out[0]: expected shape (1, 10, 2, 4)"),
    ("gather packed layer", lambda c: c.gather(-1, ["a"], packed=True), ValueError, "layer -1"),
    ("gather packed pad_to", lambda c: c.gather(0, ["a"], pad_to=10, packed=True), ValueError,
     "pad_to"),
    ("load_cached bad payload", lambda c: c.load_cached(
        [bytes(32)], np.arange(4), torch.zeros(1, 3, dtype=torch.uint8), bytes(32)),
     ValueError, "load_cached(): expected 1 keys, uint8 payload [1, "),
    ("add_sequence bad keys", lambda c: c.add_sequence("n", [1, 2, 3, 4, 5], keys=["k"]),
     TypeError, "keys must be a list of 32-byte block keys"),
    ("admit short key", lambda c: c.admit("n", [1, 2, 3, 4, 5], keys=[bytes(8)]),
     TypeError, "keys must be a list of 32-byte block keys"),
]


def _write_call(shape, dtype=torch.float32, layer=0, device=None):
    def call(c):
        batch = _batch(c)
        key = torch.randn(*shape, dtype=dtype, device=device)
        c.write(layer, key, key.clone(), batch)
    return call


# calls that need a fresh batch: the prepare itself commits, so the snapshot is taken after it
BAD_STEP_CALLS = [
    ("write wrong heads", lambda c, b: c.write(0, torch.randn(1, 3, 4), torch.randn(1, 3, 4), b),
     ValueError, "key: expected shape (1, 2, 4), got (1, 3, 4)"),
    ("write wrong tokens", lambda c, b: c.write(0, torch.randn(2, 2, 4), torch.randn(2, 2, 4), b),
     ValueError, "expected shape (1, 2, 4)"),
    ("write wrong dtype", lambda c, b: c.write(0, torch.randn(1, 2, 4).half(),
                                               torch.randn(1, 2, 4).half(), b),
     TypeError, "key: expected dtype torch.float32, got torch.float16"),
    ("write value shape", lambda c, b: c.write(0, torch.randn(1, 2, 4), torch.randn(1, 2, 5), b),
     ValueError, "value: expected shape"),
    ("write not tensor", lambda c, b: c.write(0, [[0.0]], torch.randn(1, 2, 4), b),
     TypeError, "key: expected a torch.Tensor"),
    ("write device", lambda c, b: c.write(0, torch.randn(1, 2, 4, device="meta"),
                                          torch.randn(1, 2, 4, device="meta"), b),
     ValueError, "expected device cpu"),
    ("write layer range", lambda c, b: c.write(2, torch.randn(1, 2, 4), torch.randn(1, 2, 4), b),
     ValueError, "layer 2 out of range [0, 2)"),
    ("write layer type", lambda c, b: c.write(0.0, torch.randn(1, 2, 4), torch.randn(1, 2, 4), b),
     TypeError, "layer must be an int"),
    ("write no batch", lambda c, b: c.write(0, torch.randn(1, 2, 4), torch.randn(1, 2, 4), None),
     TypeError, "StepBatch"),
    ("attention heads", lambda c, b: c.attention(0, torch.randn(1, 3, 4), b),
     ValueError, "multiple of num_kv_heads"),
    ("attention dim", lambda c, b: c.attention(0, torch.randn(1, 4, 8), b),
     ValueError, "query: expected shape (1, *, 4)"),
]


@pytest.mark.parametrize(("call", "error", "pattern"), [pytest.param(*c[1:], id=c[0])
                                                         for c in BAD_CALLS])
def test_bad_call_raises_and_changes_nothing(cache, call, error, pattern):
    before = snapshot(cache)
    with pytest.raises(error, match=re.escape(pattern)):
        call(cache)
    assert_same_snapshot(before, snapshot(cache), pattern)
    cache.check()


@pytest.mark.parametrize(("call", "error", "pattern"), [pytest.param(*c[1:], id=c[0])
                                                         for c in BAD_STEP_CALLS])
def test_bad_step_call_raises_and_changes_nothing(cache, call, error, pattern):
    batch = _batch(cache)
    before = snapshot(cache)
    with pytest.raises(error, match=re.escape(pattern)):
        call(cache, batch)
    assert_same_snapshot(before, snapshot(cache), pattern)


CONFIG_ERRORS = [
    (dict(num_layers=0), "CacheConfig.num_layers: expected >= 1, got 0"),
    (dict(num_kv_heads=-1), "CacheConfig.num_kv_heads"),
    (dict(head_dim=2.5), "CacheConfig.head_dim: expected an int"),
    (dict(block_size=0), "CacheConfig.block_size"),
    (dict(num_blocks=1), "CacheConfig.num_blocks: expected >= 2, got 1"),
    (dict(dtype=torch.int8), "CacheConfig.dtype"),
    (dict(device="warp-drive"), "CacheConfig.device"),
    (dict(enable_prefix_caching=1), "CacheConfig.enable_prefix_caching"),
    (dict(num_host_blocks=-1), "CacheConfig.num_host_blocks"),
    (dict(num_layers=True), "CacheConfig.num_layers: expected an int"),
]


@pytest.mark.parametrize(("overrides", "pattern"), CONFIG_ERRORS)
def test_config_rejects_invalid_fields(overrides, pattern):
    with pytest.raises(ValueError, match=re.escape(pattern)):
        tiny_config(**overrides)


def test_config_is_frozen_and_derives_sizes():
    config = tiny_config()
    with pytest.raises(AttributeError):
        config.num_blocks = 3
    assert config.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert config.bytes_per_block == config.bytes_per_token * config.block_size


def test_for_memory_fits_the_budget():
    config = CacheConfig.for_memory(10_000_000, num_layers=2, num_kv_heads=4, head_dim=64,
                                    dtype=torch.bfloat16)
    assert config.num_blocks * config.bytes_per_block <= 10_000_000
    assert (config.num_blocks + 1) * config.bytes_per_block > 10_000_000
    assert PagedKVCache(config).stats().total_bytes == config.num_blocks * config.bytes_per_block
    with pytest.raises(ValueError, match="budget_bytes"):
        CacheConfig.for_memory(100, num_layers=2, num_kv_heads=4, head_dim=64)


def test_out_of_blocks_is_typed_changes_nothing_and_cache_stays_usable():
    cache = PagedKVCache(tiny_config(num_blocks=6))  # 5 usable blocks of 4 tokens
    cache.add_sequence("a")
    cache.prepare({"a": list(range(12))})  # 3 blocks
    cache.add_sequence("b")
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError) as info:
        cache.prepare({"a": [1], "b": list(range(9))})  # 1 + 3 blocks, 2 obtainable
    assert (info.value.requested, info.value.free) == (4, 2)
    assert "requested 4" in str(info.value) and "only 2" in str(info.value)
    assert "num_blocks" in str(info.value)
    assert_same_snapshot(before, snapshot(cache), "out of blocks")
    assert not cache.can_allocate(3) and cache.can_allocate(2)
    batch = cache.prepare({"a": [1], "b": list(range(4))})  # fits: 2 blocks
    assert batch.num_tokens == 5
    cache.check()


def test_swap_out_without_host_pool_is_a_clear_error():
    cache = PagedKVCache(tiny_config(num_host_blocks=0))
    cache.add_sequence("a")
    cache.prepare({"a": 3})
    with pytest.raises(Exception, match="num_host_blocks"):
        cache.swap_out("a")
    cache.check()
