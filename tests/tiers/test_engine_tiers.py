"""An `Engine` with cache tiers serves exactly what an engine without them serves.

On a small TinyLlama with greedy sampling: a prompt whose blocks come back from each tier
(host, disk, Redis, all three) gives the no-tier engine's tokens for every KV cache dtype,
with the prompt's full blocks counted as prefix hits and as hit tokens of the tier that held
them; each tier serves what the faster ones lack; the disk tier across a restart; the host
and disk byte caps under many prompts (stats and the files on disk); the tier hit metric;
tensor parallelism with tiers refused before any worker starts.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from paged_kv.config import KV_CACHE_DTYPES
from paged_kv.engine import Engine
from paged_kv.engine import engine as engine_module
from paged_kv.engine.config import EngineConfig
from paged_kv.tiers import TierConfig, codec
from paged_kv.tiers.fetcher import TierFetcher

from ..conftest import prometheus_value
from .conftest import (
    full_block_tokens,
    random_prompts,
    serve_prompts,
    tier_stats,
    tokens_of,
)

MIB = 1 << 20

pytestmark = pytest.mark.usefixtures("fetch_always")  # hits must not depend on load
DTYPES = ["auto", "int8", pytest.param(
    "fp8_e4m3", marks=pytest.mark.skipif(not hasattr(torch, KV_CACHE_DTYPES["fp8_e4m3"]),
                                         reason="this torch has no float8_e4m3fn"))]
# lengths with 2, 4 and 6 full blocks before the block of the last token
PROMPT_LENGTHS = (40, 70, 100)


def prompts_of(seed: int) -> list[list[int]]:
    return [random_prompts(1, length, seed=seed * 100 + length)[0]
            for length in PROMPT_LENGTHS]


def tier_config(kinds: str, tmp_path, request, disk: str = "disk", **fields) -> TierConfig:
    """Tiers `kinds` ("host", "disk", "remote", or several joined by '+'); a generous fetch
    deadline unless given: these tests check the read path, not the deadline."""
    fields.setdefault("fetch_deadline_s", 5.0)
    if "host" in kinds:
        fields.setdefault("host_mib", 8)
    if "disk" in kinds:
        fields.setdefault("disk_dir", str(tmp_path / disk))
        fields.setdefault("disk_mib", 8)
    if "remote" in kinds:
        fields.setdefault("remote_url", request.getfixturevalue("redis_server"))
    return TierConfig(**fields)


def assert_served_from(reader, before: dict, tier: str, prompts, outputs, expected) -> None:
    """`outputs` hit every full block of their prompts, all from `tier`, and carry the
    reference tokens `expected`."""
    hits = [full_block_tokens(p) for p in prompts]
    stats = reader.stats().tiers
    assert [o.prefix_hit_tokens for o in outputs] == hits, stats
    assert tokens_of(outputs) == expected
    after = tier_stats(reader)
    grew = {name: after[name].hit_tokens - (before[name].hit_tokens if name in before else 0)
            for name in after}
    assert grew == {name: sum(hits) if name == tier else 0 for name in after}, stats
    assert all(s.verify_failures == 0 for s in after.values()), stats


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
@pytest.mark.parametrize("kinds", ["host", "disk", "remote", "host+disk+remote"])
def test_prompts_from_a_tier_give_the_no_tier_tokens(request, tmp_path, tier_engines,
                                                     reference_tokens, kinds, kv_cache_dtype):
    prompts = prompts_of(seed=1)
    expected = reference_tokens(prompts, kv_cache_dtype=kv_cache_dtype)
    config = tier_config(kinds, tmp_path, request)
    writer = tier_engines(config, kv_cache_dtype=kv_cache_dtype)
    first = serve_prompts(writer, prompts)
    assert tokens_of(first) == expected
    assert [o.prefix_hit_tokens for o in first] == [0] * len(prompts)
    assert writer.tiers.flush(timeout=10)
    written = sum(full_block_tokens(p) for p in prompts) // 16
    assert all(s.written_blocks >= written for s in tier_stats(writer).values())
    if kinds == "remote":  # shared by replicas: a second engine reads what the first wrote
        reader = tier_engines(config, kv_cache_dtype=kv_cache_dtype)
    else:  # per-engine host tier: drop the device's copies and read them back
        writer.cache.reset_prefix_cache()
        reader = writer
    before = tier_stats(reader)
    second = serve_prompts(reader, prompts)
    assert_served_from(reader, before, kinds.split("+")[0], prompts, second, expected)
    assert reader.stats().tiers.loaded_blocks == sum(full_block_tokens(p) for p in prompts) // 16
    reader.check()


def test_each_tier_serves_what_the_faster_tiers_lack(request, tmp_path, tier_engines,
                                                     reference_tokens):
    prompts = prompts_of(seed=2)
    expected = reference_tokens(prompts)
    config = tier_config("host+disk+remote", tmp_path, request)
    writer = tier_engines(config)
    serve_prompts(writer, prompts)
    writer.close()  # flushes its writes; the disk directory is one store's at a time
    # a new engine: its host tier is empty, the disk has the blocks
    from_disk = tier_engines(config)
    assert_served_from(from_disk, {}, "disk", prompts, serve_prompts(from_disk, prompts),
                       expected)
    from_disk.check()
    from_disk.close()
    # another disk directory: only Redis has them
    other = tier_config("host+disk+remote", tmp_path, request, disk="other-disk",
                        remote_url=config.remote_url)
    from_remote = tier_engines(other)
    assert_served_from(from_remote, {}, "remote", prompts, serve_prompts(from_remote, prompts),
                       expected)
    from_remote.check()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_disk_tier_serves_after_a_restart(request, tmp_path, tier_engines, reference_tokens,
                                          kv_cache_dtype):
    prompts = prompts_of(seed=3)
    expected = reference_tokens(prompts, kv_cache_dtype=kv_cache_dtype)
    config = tier_config("host+disk", tmp_path, request)
    first = tier_engines(config, kv_cache_dtype=kv_cache_dtype)
    assert tokens_of(serve_prompts(first, prompts)) == expected
    first.close()  # a clean stop: queued writes reach the disk
    restarted = tier_engines(config, kv_cache_dtype=kv_cache_dtype)
    blocks = sum(full_block_tokens(p) for p in prompts) // 16
    assert tier_stats(restarted)["disk"].blocks >= blocks  # the index rebuilt from the files
    assert_served_from(restarted, {}, "disk", prompts, serve_prompts(restarted, prompts),
                       expected)
    restarted.check()


def test_a_fetch_slower_than_recomputing_is_skipped(request, tmp_path, monkeypatch,
                                                    tier_engines, reference_tokens):
    prompts = prompts_of(seed=5)
    expected = reference_tokens(prompts)
    engine = tier_engines(tier_config("host", tmp_path, request))
    serve_prompts(engine, prompts)
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    monkeypatch.setattr(TierFetcher, "recompute_seconds", lambda self, num_tokens: 0.0)
    outputs = serve_prompts(engine, prompts)
    assert [o.prefix_hit_tokens for o in outputs] == [0] * len(prompts)
    assert tokens_of(outputs) == expected
    stats = engine.stats().tiers
    assert stats.skipped_fetches == len(prompts) and stats.loaded_blocks == 0, stats
    assert tier_stats(engine)["host"].hit_tokens == 0
    engine.check()


def disk_bytes(directory: str) -> int:
    """Bytes of every file under `directory` (temp files too); files that vanish while
    listed are skipped."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.path.getsize(os.path.join(root, name))
    return total


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_tier_caps_hold_under_many_prompts(request, tmp_path, tier_engines, kind):
    cap_mib = 0.05  # six encoded blocks of this model
    config = tier_config(kind, tmp_path, request, **{f"{kind}_mib": cap_mib})
    engine = tier_engines(config)
    encoded = engine.cache.pool.block_nbytes + codec.HEADER.size
    cap = int(cap_mib * MIB)
    assert cap // encoded == 6

    def held() -> int:
        if kind == "disk":
            return max(disk_bytes(config.disk_dir), tier_stats(engine)["disk"].bytes)
        return tier_stats(engine)["host"].bytes

    peak, stop = [0], threading.Event()

    def watch() -> None:  # the cap holds while the writer writes, not only after
        while not stop.is_set():
            peak[0] = max(peak[0], held())
            stop.wait(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for batch in range(6):
            serve_prompts(engine, random_prompts(4, 70, seed=1000 + batch))
            assert held() <= cap + encoded
        assert engine.tiers.flush(timeout=10)
    finally:
        stop.set()
        watcher.join(timeout=5)
    stats = tier_stats(engine)[kind]
    assert peak[0] <= cap + encoded, f"{kind} held {peak[0]} bytes, cap {cap}"
    assert stats.written_blocks == 24 * 4  # every block was written, most evicted since
    assert stats.blocks == cap // encoded  # full, and no further
    assert stats.bytes == stats.blocks * encoded <= cap
    if kind == "disk":
        assert disk_bytes(config.disk_dir) == stats.bytes
        engine.close()  # a restart with a lower cap evicts down to it at start
        smaller = tier_config(kind, tmp_path, request, disk_mib=0.02)
        restarted = tier_engines(smaller)
        assert disk_bytes(smaller.disk_dir) <= int(0.02 * MIB)
        assert tier_stats(restarted)["disk"].blocks == int(0.02 * MIB) // encoded


def test_host_hits_reach_the_metrics(request, tmp_path, tier_engines):
    prompts = prompts_of(seed=4)
    engine = tier_engines(tier_config("host", tmp_path, request))
    serve_prompts(engine, prompts)
    text = engine.metrics_text()
    assert prometheus_value(text, "paged_kv_tier_hit_tokens_total", '{tier="host"}') == 0
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    serve_prompts(engine, prompts)
    text = engine.metrics_text()
    hits = sum(full_block_tokens(p) for p in prompts)
    assert prometheus_value(text, "paged_kv_tier_hit_tokens_total", '{tier="host"}') == hits
    assert prometheus_value(text, "paged_kv_tier_blocks", '{tier="host"}') > 0
    assert prometheus_value(text, "paged_kv_tier_written_blocks_total", '{tier="host"}') > 0


@pytest.mark.parametrize("tiers", [TierConfig(host_mib=1),
                                   TierConfig(remote_url="redis://127.0.0.1:1/0")],
                         ids=["host", "remote"])
def test_tensor_parallel_with_tiers_is_refused_before_workers_start(tier_model, monkeypatch,
                                                                    tiers):
    started = []

    def start(*args, **kwargs):
        started.append(args)
        raise RuntimeError("tensor-parallel workers started")

    monkeypatch.setattr(engine_module.TensorParallelRunner, "start", staticmethod(start))
    model = tier_model()
    with pytest.raises(ValueError, match="kv_tiers"):
        Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64), tensor_parallel_size=2,
                                   kv_tiers=tiers))
    assert started == []


def test_a_block_evicted_from_a_tier_is_written_again_once_recomputed(request, tmp_path,
                                                                      tier_engines):
    engine = tier_engines(tier_config("host", tmp_path, request, host_mib=0.05))  # 6 blocks
    [prompt, *others] = random_prompts(3, 70, seed=6)  # 4 full blocks each

    def hit() -> int:
        assert engine.tiers.flush(timeout=10)
        engine.cache.reset_prefix_cache()
        return serve_prompts(engine, [prompt])[0].prefix_hit_tokens

    serve_prompts(engine, [prompt])
    assert hit() == 64
    serve_prompts(engine, others)  # 8 more blocks: the prompt's are evicted from the host
    assert hit() == 0  # recomputed: its blocks are stored on the device again ...
    assert hit() == 64, tier_stats(engine)["host"]  # ... so the tier should have them back
