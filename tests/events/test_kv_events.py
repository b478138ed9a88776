"""KV events: what a replica publishes, read by a decoder written from vLLM's documented
schema with the ``msgpack`` package (not `paged_kv.events.schema`), and followed in order by
`EventSubscriber` through gaps, restarts and malformed batches."""

from __future__ import annotations

import hashlib
import struct
import time

import msgpack
import numpy as np
import pytest
import zmq

from paged_kv.core.allocator import BlockAllocator
from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.events import KVEventsConfig, decode_batch
from paged_kv.events.publisher import EventPublisher
from paged_kv.events.subscriber import EventSubscriber
from paged_kv.keys import root_hash
from paged_kv.router import PrefixIndex

BLOCK = 4
ANY = "tcp://127.0.0.1:*"


def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def decode(frames: list[bytes]) -> tuple[bytes, int, float, list]:
    """vLLM's frames: topic, 8-byte big-endian sequence number, msgpack ``[ts, events
    (, dp_rank)]``; each event an array tagged with its type name."""
    topic, seq, payload = frames
    assert len(seq) == 8
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) in (2, 3)
    stamp, events = batch[0], batch[1]
    for event in events:
        tag = event[0]
        if tag == "BlockStored":
            hashes, parent, tokens, block_size, _lora, medium = event[1:7]
            assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
            assert parent is None or isinstance(parent, bytes)
            assert isinstance(tokens, list) and isinstance(block_size, int)
            assert medium in ("GPU", "CPU", "DISK")
        elif tag == "BlockRemoved":
            assert all(isinstance(h, bytes) for h in event[1]) and isinstance(event[2], str)
        else:
            assert tag == "AllBlocksCleared" and len(event) == 1
    return topic, struct.unpack(">q", seq)[0], float(stamp), events


def _model() -> TinyLlama:
    return TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
                                     vocab_size=300, num_heads=4, head_dim=16), seed=0)


def _sub(endpoint: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def _drain(socket: zmq.Socket, idle: float = 0.3) -> list[list[bytes]]:
    frames = []
    while socket.poll(int(idle * 1000)):
        frames.append(socket.recv_multipart())
    return frames


@pytest.mark.parametrize("token_ids", [True, False])
def test_every_batch_parses_in_order_and_rebuilds_the_index(token_ids):
    model = _model()
    config = KVEventsConfig(ANY, ANY, topic="kv@replica@tiny", token_ids=token_ids)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=24, block_size=BLOCK),
                                        kv_events=config))
    socket = _sub(engine.events.endpoint)
    try:
        time.sleep(0.3)  # the subscription reaches the publisher before anything is sent
        rng = np.random.default_rng(0)
        shared = rng.integers(0, 300, 13).tolist()
        for _ in range(4):  # a small pool: later rounds evict earlier blocks
            prompts = [shared + rng.integers(0, 300, int(rng.integers(1, 30))).tolist()
                       for _ in range(3)]
            engine.generate(prompts, SamplingParams(max_tokens=3))
        engine.cache.reset_prefix_cache()
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # publishes the clear
        batches = [decode(frames) for frames in _drain(socket)]
    finally:
        socket.close(0)
        engine.close()
    assert [seq for _, seq, _, _ in batches] == list(range(len(batches))), "no gap"
    assert {topic for topic, _, _, _ in batches} == {b"kv@replica@tiny"}
    held: set[bytes] = set()
    for _, _, _, events in batches:
        for event in events:
            if event[0] == "BlockStored":
                hashes, parent, tokens = event[1], event[2], event[3]
                assert event[4] == BLOCK
                if token_ids:
                    assert len(tokens) == BLOCK * len(hashes)
                    for i, key in enumerate(hashes):  # each one chains from the one before
                        piece = np.asarray(tokens[i * BLOCK:(i + 1) * BLOCK], "<i4").tobytes()
                        before = parent if i == 0 else hashes[i - 1]
                        assert before is not None
                        assert hashlib.sha256(before + piece).digest() == key
                else:
                    assert tokens == []
                held.update(hashes)
            elif event[0] == "BlockRemoved":
                assert set(event[1]) <= held
                held.difference_update(event[1])
            else:
                held.clear()
    kinds = [e[0] for _, _, _, events in batches for e in events]
    assert "BlockRemoved" in kinds and kinds[-2:].count("AllBlocksCleared") <= 1
    assert "AllBlocksCleared" in kinds
    allocator = engine.cache.allocator
    indexed = {allocator.block_hash(b) for b in range(allocator.num_blocks)} - {None}
    assert held == indexed, "stored minus removed = the engine's index"


def _publisher(**kwargs) -> EventPublisher:
    return EventPublisher(KVEventsConfig(ANY, ANY, **kwargs), block_size=BLOCK)


def _store_batch(allocator: BlockAllocator, salt: str) -> list:
    ids = allocator.allocate(2).tolist()
    allocator.register_chain(ids, root_hash(salt), np.arange(8, dtype="<i4").tobytes())
    allocator.free(ids)
    return allocator.take_events()


def _follow(publisher: EventPublisher, **kwargs) -> tuple[EventSubscriber, PrefixIndex]:
    # a replay answered late on a loaded machine is a slow test, not a missed history
    kwargs.setdefault("replay_timeout", 30.0)
    index = PrefixIndex()
    subscriber = EventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint,
                                 on_batch=lambda stamp, events: index.apply("r", events),
                                 **kwargs)
    return subscriber, index


def test_a_late_and_a_restarted_subscriber_catch_up_to_a_never_restarted_one():
    publisher = _publisher()
    allocator = BlockAllocator(64)
    steady, steady_index = _follow(publisher)
    try:
        for i in range(5):  # before the late one exists
            publisher.publish(_store_batch(allocator, f"t{i}"))
        late, late_index = _follow(publisher)
        for i in range(5, 8):
            publisher.publish(_store_batch(allocator, f"t{i}"))
        _until(lambda: late.next_seq == 8 and steady.next_seq == 8)
        late.close()  # restarted mid-run: history comes back by replay
        for i in range(8, 12):
            publisher.publish(_store_batch(allocator, f"t{i}"))
        late, late_index = _follow(publisher)
        _until(lambda: late.next_seq == 12 and steady.next_seq == 12)
        assert steady_index.num_blocks == 24
        assert late_index.blocks_of("r") == steady_index.blocks_of("r")
        assert late.counts["missed"] == 0 and late.counts["replayed"] == 12
    finally:
        for subscriber in (steady, late):
            subscriber.close()
        publisher.close()


def test_a_gap_is_replayed_and_what_the_buffer_lost_is_counted_missed():
    publisher = _publisher(buffer_steps=3)
    allocator = BlockAllocator(256)
    subscriber, index = _follow(publisher)
    try:
        publisher.publish(_store_batch(allocator, "a"))
        _until(lambda: subscriber.next_seq == 1)
        for _ in range(6):  # numbers 1-6 are spent but never sent: a gap
            next(publisher._seq)
        for salt in "bcd":
            publisher.publish(_store_batch(allocator, salt))
        _until(lambda: subscriber.next_seq == 10)
        assert subscriber.counts["gaps"] == 1 and subscriber.counts["missed"] == 6
        assert index.num_blocks == 8, "every batch sent was applied once"
    finally:
        subscriber.close()
        publisher.close()


def test_a_full_queue_drops_batches_never_blocks_and_shows_as_a_gap():
    publisher = _publisher(max_queue=1)
    allocator = BlockAllocator(4096)
    try:
        start = time.perf_counter()
        for i in range(500):
            publisher.publish(_store_batch(allocator, str(i)))
        assert time.perf_counter() - start < 5
        _until(lambda: publisher.num_published + publisher.num_dropped == 500)
        assert publisher.num_dropped > 0
        sent = [seq for seq, _ in publisher._sent]
        assert sent == sorted(sent) and len(sent) == publisher.num_published
    finally:
        publisher.close()


def test_malformed_batches_are_counted_and_skipped():
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex()
    subscriber = EventSubscriber(f"tcp://127.0.0.1:{port}",
                                 on_batch=lambda s, e: index.apply("r", e))
    good = msgpack.packb([time.time(), [["BlockStored", [b"k" * 32], None, [], 4, None,
                                         "GPU"]]])
    try:
        time.sleep(0.3)
        for seq, payload in enumerate([b"\xc1not msgpack", msgpack.packb([1.0, [["Nope"]]]),
                                       msgpack.packb({"a": 1}), good]):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        pub.send_multipart([b"", b"short"])
        _until(lambda: subscriber.counts["batches"] == 1)
        _until(lambda: subscriber.counts["malformed"] == 4)
        assert index.blocks_of("r") == {b"k" * 32}
    finally:
        subscriber.close()
        pub.close(0)


def test_a_restarted_publisher_resets_the_subscriber():
    first = _publisher()
    allocator = BlockAllocator(64)
    endpoint = first.endpoint
    resets = []
    index = PrefixIndex()
    subscriber = EventSubscriber(endpoint, on_batch=lambda s, e: index.apply("r", e),
                                 on_reset=lambda: (resets.append(1), index.clear("r")))
    try:
        time.sleep(0.3)
        for salt in "abc":
            first.publish(_store_batch(allocator, salt))
        _until(lambda: subscriber.next_seq == 3)
        first.close()
        second = EventPublisher(KVEventsConfig(endpoint), block_size=BLOCK)
        time.sleep(0.5)  # the subscriber reconnects
        second.publish(_store_batch(BlockAllocator(64), "z"))
        _until(lambda: resets == [1])
        _until(lambda: index.num_blocks == 2)
        second.close()
    finally:
        subscriber.close()


def test_decode_batch_names_what_is_wrong():
    for payload, words in [(b"\xc1", "not msgpack"), (msgpack.packb([1.0]), "expected"),
                           (msgpack.packb([1.0, [["Nope"]]]), "unknown event"),
                           (msgpack.packb([1.0, [["BlockRemoved"]]]), "fields")]:
        with pytest.raises(ValueError, match=words):
            decode_batch(payload)


def test_bad_endpoints_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="endpoint"):
        KVEventsConfig("127.0.0.1:5557")
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig(ANY, buffer_steps=0)
    with pytest.raises(ValueError, match="replay_max_batches: expected at least 1, got 0"):
        KVEventsConfig(ANY, replay_max_batches=0)
    for rate in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="replay_total_rate: expected a rate > 0"):
            KVEventsConfig(ANY, replay_total_rate=rate)
    taken = _publisher()
    try:
        with pytest.raises(ValueError, match=f"cannot bind {taken.endpoint}"):
            EventPublisher(KVEventsConfig(taken.endpoint), block_size=BLOCK)
    finally:
        taken.close()


def test_serve_flags_default_the_replay_port_and_the_topic():
    import argparse

    from paged_kv.engine.process.engine_core import events_config

    args = argparse.Namespace(kv_events="tcp://*:5557", kv_events_replay=None,
                              kv_events_topic=None, kv_events_token_ids=False,
                              host="10.0.0.1", port=8000)
    config = events_config(args, "tiny")
    assert config.replay_endpoint == "tcp://*:5558"
    assert config.topic == "kv@10.0.0.1:8000@tiny" and not config.token_ids
    args.kv_events_replay = "off"
    assert events_config(args, "tiny").replay_endpoint is None
    args.kv_events = None
    assert events_config(args, "tiny") is None
