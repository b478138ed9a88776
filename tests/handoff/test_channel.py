"""The decode side's `Channel`: one socket per prefill engine, reused across gets, and
replaced after a call that timed out, so that a late answer is never taken for the next
call's; an endpoint ZMQ cannot connect to fails that call alone."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from paged_kv.handoff.lease import LeaseTable
from paged_kv.handoff.server import Channel, HandoffServer
from paged_kv.handoff.trust import HandoffTrust

TRUST = HandoffTrust("s")


def get(lease: str, keys) -> list[bytes]:
    return [b"get", TRUST.request_mac(b"get", lease.encode(), list(keys)), lease.encode(),
            *keys]


def test_a_channel_reuses_its_socket_and_receives_values_in_place():
    table = LeaseTable(60, 1 << 30)
    values = {bytes([i]) * 32: bytes([i]) * 70_000 for i in range(3)}  # over zmq's copy limit
    lease = table.create(values, None)
    server = HandoffServer(table, "127.0.0.1", 0, TRUST)
    context = zmq.Context()
    channel = Channel(context)
    try:
        for _ in range(3):
            answer = channel.call(server.endpoint, get(lease, values), 5.0)
            assert answer[0] == b"ok"
            assert [bytes(v) for v in answer[2:]] == list(values.values())
            assert all(isinstance(v, memoryview) for v in answer[2:])
            assert TRUST.values_ok(answer[1], lease.encode(), list(values), answer[2:]) \
                == [True] * 3
        assert channel.open_sockets == 1
        assert channel.call(server.endpoint, [b"get", b"bad", lease.encode()], 5.0) == [
            b"refused"]
    finally:
        channel.close()
        server.close()
        context.term()


def test_a_late_answer_is_not_taken_for_the_next_calls():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    first_seen = threading.Event()

    def serve() -> None:  # answers the first request late, then each at once
        frames = router.recv_multipart()
        first_seen.set()
        late = [frames[0], b"late"]
        frames = router.recv_multipart()
        router.send_multipart(late)  # to the first (timed-out, now closed) socket
        router.send_multipart([frames[0], b"second"])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    channel = Channel(context)
    try:
        assert channel.call(endpoint, [b"first"], 0.2) is None
        assert channel.open_sockets == 0  # the timed-out socket is gone
        assert first_seen.is_set()
        assert channel.call(endpoint, [b"second"], 5.0) == [b"second"]
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        channel.close()
        router.close()
        context.term()


@pytest.mark.parametrize("endpoint", ["tcp://junkA", "tcp://host:x", "junk"])
def test_an_endpoint_zmq_refuses_fails_its_call_alone_and_wedges_nothing(endpoint):
    """Two calls to a malformed endpoint each fail at once (no socket kept half-made to
    block the next send); a good endpoint on the same channel is served after them."""
    table = LeaseTable(60, 1 << 20)
    lease = table.create({b"k" * 32: b"v" * 100}, None)
    server = HandoffServer(table, "127.0.0.1", 0, TRUST)
    context = zmq.Context()
    channel = Channel(context)
    try:
        start = time.monotonic()
        for _ in range(2):
            assert channel.call(endpoint, get(lease, [b"k" * 32]), 5.0) is None
        assert time.monotonic() - start < 2.0
        assert channel.open_sockets == 0
        answer = channel.call(server.endpoint, get(lease, [b"k" * 32]), 5.0)
        assert answer[0] == b"ok" and bytes(answer[2]) == b"v" * 100
    finally:
        channel.close()
        server.close()
        context.term()


def test_a_call_to_nobody_times_out_and_the_next_is_served():
    """An endpoint nobody listens on: the call gives up after its timeout (None), never
    blocks; the socket is dropped."""
    context = zmq.Context()
    channel = Channel(context)
    try:
        start = time.monotonic()
        assert channel.call("tcp://127.0.0.1:9", [b"x"], 0.3) is None
        assert channel.call("tcp://127.0.0.1:9", [b"x"], 0.3) is None
        assert time.monotonic() - start < 3.0
        assert channel.open_sockets == 0
    finally:
        channel.close()
        context.term()
