"""KV events of the tiers: host RAM and disk report what they hold and drop, and a router's
index keeps a replica's blocks per tier."""

from __future__ import annotations

import time

import pytest

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.events import KVEventsConfig
from paged_kv.events.subscriber import EventSubscriber
from paged_kv.router import PrefixIndex, prompt_keys
from paged_kv.tiers import TierConfig
from paged_kv.tiers.memory import HostStore

BLOCK = 4


def _engine(tiers: TierConfig) -> Engine:
    model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
                                      vocab_size=300, num_heads=4, head_dim=16), seed=0)
    return Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=64, block_size=BLOCK), kv_tiers=tiers,
        kv_events=KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")))


def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_block_in_a_tier_stays_routable_after_the_pool_drops_it(tier, tmp_path):
    tiers = (TierConfig(host_mib=1) if tier == "host"
             else TierConfig(disk_dir=str(tmp_path / "disk"), disk_mib=1))
    medium = {"host": "CPU", "disk": "DISK"}[tier]
    index, batches = PrefixIndex(), []

    def on_batch(stamp, events):
        batches.append(events)
        index.apply("r", events)

    with _engine(tiers) as engine:
        subscriber = EventSubscriber(engine.events.endpoint,
                                     replay_endpoint=engine.events.replay_endpoint,
                                     on_batch=on_batch)
        try:
            prompt = list(range(1, 30))  # 7 full blocks
            keys = prompt_keys(prompt, BLOCK, None)
            engine.generate([prompt], SamplingParams(max_tokens=2))
            assert engine.tiers.flush(10)
            _until(lambda: index.match(keys, ["r"])["r"] == len(keys))  # in the pool: 1.0
            _until(lambda: any(e[0] == "BlockStored" and e[6] == medium
                               for batch in batches for e in batch))
            engine.cache.reset_prefix_cache()
            engine.generate([[7, 8]], SamplingParams(max_tokens=1))  # a step publishes it
            _until(lambda: any(e[0] == "AllBlocksCleared" for b in batches for e in b))
            weight = {"CPU": 0.8, "DISK": 0.6}[medium]
            _until(lambda: index.match(keys, ["r"])["r"] == pytest.approx(weight * len(keys)))
        finally:
            subscriber.close()


def test_tier_evictions_are_published_as_removed():
    index, batches = PrefixIndex(), []
    with _engine(TierConfig(host_mib=1)) as engine:
        store = engine.tiers.stores[0]
        assert isinstance(store, HostStore)
        subscriber = EventSubscriber(engine.events.endpoint,
                                     replay_endpoint=engine.events.replay_endpoint,
                                     on_batch=lambda s, e: (batches.append(e),
                                                            index.apply("r", e)))
        try:
            block_bytes = engine.cache.pool.block_nbytes
            store.cap_bytes = 3 * (block_bytes + 200)  # room for about three blocks
            engine.generate([list(range(1, 30))], SamplingParams(max_tokens=1))
            assert engine.tiers.flush(10)
            _until(lambda: any(e[0] == "BlockRemoved" and e[2] == "CPU"
                               for b in batches for e in b))
            held, _ = store.usage()
            cpu = {k for b in batches for e in b if e[0] == "BlockStored" and e[6] == "CPU"
                   for k in e[1]}
            gone = {k for b in batches for e in b if e[0] == "BlockRemoved" and e[2] == "CPU"
                    for k in e[1]}
            assert len(cpu - gone) == held, "published CPU blocks = blocks the store holds"
        finally:
            subscriber.close()
