"""The decode side's `Channel`: one socket per prefill engine, reused across gets, and
replaced after a call that timed out, so that a late answer is never taken for the next
call's."""

from __future__ import annotations

import threading

import zmq

from paged_kv.handoff.lease import LeaseTable
from paged_kv.handoff.server import Channel, HandoffServer


def test_a_channel_reuses_its_socket_and_receives_values_in_place():
    table = LeaseTable(60, 1 << 30)
    values = {bytes([i]) * 32: bytes([i]) * 70_000 for i in range(3)}  # over zmq's copy limit
    lease = table.create(values, None)
    server = HandoffServer(table, "127.0.0.1", 0, "s")
    context = zmq.Context()
    channel = Channel(context)
    try:
        for _ in range(3):
            answer = channel.call(server.endpoint, [b"get", b"s", lease.encode(), *values], 5.0)
            assert answer[0] == b"ok"
            assert [bytes(v) for v in answer[1:]] == list(values.values())
            assert all(isinstance(v, memoryview) for v in answer[1:])
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
