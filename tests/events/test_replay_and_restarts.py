"""The replay socket under a flood (a bounded share per client, a bounded reply), and the
subscriber through a one-batch gap and a publisher restart whose first batches it never
received live. A batch "lost on the wire" is numbered and kept for replay by the publisher
but never sent on its PUB socket, as when a subscriber is not connected at that moment."""

from __future__ import annotations

import threading
import time

import zmq

from paged_kv.core.allocator import BlockAllocator
from paged_kv.events import KVEventsConfig, encode_batch, to_wire
from paged_kv.events.publisher import EventPublisher
from paged_kv.events.subscriber import EventSubscriber
from paged_kv.router import PrefixIndex

from .test_kv_events import BLOCK, _follow, _publisher, _store_batch, _until


def _lost_on_the_wire(publisher: EventPublisher, events: list) -> None:
    """Number `events` and keep them for replay, without sending them live (the caller
    waits until what it published before was sent, so the buffer stays in order)."""
    seq = next(publisher._seq)
    payload = encode_batch(time.time(), to_wire(events, block_size=BLOCK))
    publisher._sent.append((seq, payload))


def _ask(dealer: zmq.Socket, start: int, count: int = 1, idle: float = 1.0) -> tuple[int, int]:
    """Send `count` replay requests from `start`; (batches, end markers) in the replies."""
    for _ in range(count):
        dealer.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
    batches = ends = 0
    while dealer.poll(int(idle * 1000)):
        _, seq, _ = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) < 0:
            ends += 1
        else:
            batches += 1
    return batches, ends


def _dealer(endpoint: str) -> zmq.Socket:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    return dealer


def test_a_flooding_client_is_throttled_and_a_normal_one_still_replays_a_gap():
    publisher = _publisher(replay_rate=0.5, replay_burst=3, replay_total_rate=100)
    allocator = BlockAllocator(256)
    subscriber, index = _follow(publisher)
    flood = _dealer(publisher.replay_endpoint)
    try:
        for salt in "abcde":
            publisher.publish(_store_batch(allocator, salt))
        _until(lambda: subscriber.next_seq == 5)
        start = time.monotonic()
        batches, ends = _ask(flood, 0, count=200)
        elapsed = time.monotonic() - start
        assert ends == 200, "every request is answered, a refused one by the end marker"
        answered = 3 + int(elapsed * 0.5) + 1  # the burst, and what refilled meanwhile
        assert batches <= 5 * answered, f"{batches} batches replayed to one client"
        assert publisher.replay_limiter.num_refused >= 200 - answered
        _lost_on_the_wire(publisher, _store_batch(allocator, "f"))  # number 5
        publisher.publish(_store_batch(allocator, "g"))
        _until(lambda: subscriber.next_seq == 7)
        assert subscriber.counts["gaps"] == 1 and subscriber.counts["missed"] == 0
        assert index.num_blocks == 14, "the gap was filled by a replay"
    finally:
        flood.close(0)
        subscriber.close()
        publisher.close()


def test_clients_that_change_identity_share_one_total():
    publisher = _publisher(replay_rate=100, replay_burst=5, replay_total_rate=2)
    allocator = BlockAllocator(64)
    dealers = []
    try:
        publisher.publish(_store_batch(allocator, "a"))
        _until(lambda: publisher.num_published == 1)
        start = time.monotonic()
        dealers = [_dealer(publisher.replay_endpoint) for _ in range(60)]  # 60 identities
        poller = zmq.Poller()
        for dealer in dealers:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            poller.register(dealer, zmq.POLLIN)
        answered = ends = 0
        while ends < 60 and (ready := poller.poll(5000)):
            for dealer, _ in ready:
                seq = int.from_bytes(dealer.recv_multipart()[1], "big", signed=True)
                ends, answered = (ends + 1, answered) if seq < 0 else (ends, answered + 1)
        elapsed = time.monotonic() - start
        assert ends == 60, "each is answered"
        assert elapsed < 10, "the test is meaningful only if the refill stays small"
        assert 5 <= answered <= 5 + 2 * elapsed + 1, "the total's burst, and its refill"
        assert publisher.replay_limiter.num_refused == 60 - answered
    finally:
        for dealer in dealers:
            dealer.close(0)
        publisher.close()


def test_one_reply_is_capped_and_a_late_subscriber_still_gets_the_whole_history():
    publisher = _publisher(replay_max_batches=2)
    allocator = BlockAllocator(256)
    dealer = _dealer(publisher.replay_endpoint)
    try:
        for salt in "abcde":
            publisher.publish(_store_batch(allocator, salt))
        _until(lambda: publisher.num_published == 5)
        assert _ask(dealer, 1) == (2, 1), "numbers 1 and 2, then the end marker"
        late, index = _follow(publisher)
        try:
            _until(lambda: late.next_seq == 5)
            assert late.counts["replayed"] == 5 and late.counts["missed"] == 0
            assert index.num_blocks == 10
        finally:
            late.close()
    finally:
        dealer.close(0)
        publisher.close()


def test_a_gap_of_exactly_one_batch_is_replayed():
    publisher = _publisher()
    allocator = BlockAllocator(64)
    subscriber, index = _follow(publisher)
    try:
        publisher.publish(_store_batch(allocator, "a"))
        _until(lambda: subscriber.next_seq == 1)
        _lost_on_the_wire(publisher, _store_batch(allocator, "b"))
        publisher.publish(_store_batch(allocator, "c"))
        _until(lambda: subscriber.next_seq == 3)
        assert subscriber.counts["gaps"] == 1 and subscriber.counts["replayed"] == 2
        assert subscriber.counts["missed"] == 0
        assert index.num_blocks == 6, "the missing batch's blocks came by replay"
    finally:
        subscriber.close()
        publisher.close()


def test_a_restart_replays_what_the_new_publisher_sent_before_the_reconnect():
    first = _publisher()
    endpoints = (first.endpoint, first.replay_endpoint)
    index, resets = PrefixIndex(), []
    subscriber = EventSubscriber(endpoints[0], replay_endpoint=endpoints[1],
                                 on_batch=lambda stamp, events: index.apply("r", events),
                                 on_reset=lambda: (resets.append(1), index.clear("r")),
                                 replay_timeout=30.0)
    second = None
    try:
        allocator = BlockAllocator(256)
        for i in range(100):  # the restarted one's numbers stay below 100 until it is back
            first.publish(_store_batch(allocator, str(i)))
        _until(lambda: subscriber.next_seq == 100)
        first.close()
        second = EventPublisher(KVEventsConfig(*endpoints), block_size=BLOCK)
        allocator = BlockAllocator(64)  # the restarted engine's empty cache
        for salt in "xyz":  # numbers 0-2, while the subscriber was away
            _lost_on_the_wire(second, _store_batch(allocator, salt))
        published = 0
        while not resets and published < 90:  # until one arrives: the rest come by replay
            second.publish(_store_batch(allocator, f"w{published}"))
            published += 1
            time.sleep(0.05)
        _until(lambda: subscriber.next_seq == 3 + published)
        assert resets == [1]
        assert index.num_blocks == 2 * (3 + published), "nothing lost, nothing stale"
        assert subscriber.counts["missed"] == 0
    finally:
        subscriber.close()
        if second is not None:
            second.close()


def test_a_restart_whose_numbers_passed_ours_before_the_reconnect_is_seen():
    """The restarted publisher sent more batches while the subscriber was away than the
    old one ever had: no number goes back, and its next live batch looks like a gap in
    the old stream. The reconnection itself must be checked."""
    first = _publisher()
    endpoints = (first.endpoint, first.replay_endpoint)
    index, resets = PrefixIndex(), []
    gate, held = threading.Event(), threading.Event()

    def on_batch(stamp, events):
        index.apply("r", events)
        if index.num_blocks == 6:  # the old publisher's third batch: hold the thread
            held.set()
            assert gate.wait(30)

    subscriber = EventSubscriber(endpoints[0], replay_endpoint=endpoints[1],
                                 on_batch=on_batch, replay_timeout=30.0,
                                 on_reset=lambda: (resets.append(1), index.clear("r")))
    second = None
    try:
        time.sleep(0.3)  # subscribed: the batches below go out live
        allocator = BlockAllocator(64)
        for salt in "abc":
            first.publish(_store_batch(allocator, salt))
        assert held.wait(30)
        first.close()  # while the subscriber is held, the publisher restarts...
        second = EventPublisher(KVEventsConfig(*endpoints), block_size=BLOCK)
        allocator = BlockAllocator(64)
        for salt in "vwxyz":  # ... and sends numbers 0-4 before it is followed again
            _lost_on_the_wire(second, _store_batch(allocator, salt))
        gate.set()
        _until(lambda: resets == [1] and subscriber.next_seq == 5, timeout=30)
        second.publish(_store_batch(allocator, "live"))  # number 5
        _until(lambda: subscriber.next_seq == 6)
        assert index.num_blocks == 12, "the new publisher's six batches, none of the old"
        assert subscriber.counts["missed"] == 0
    finally:
        gate.set()
        subscriber.close()
        if second is not None:
            second.close()
