"""`RedisStore` beyond the contract, against a real ``redis-server``: one round trip per
call, the server's own eviction, and a store that dies, hangs, flushes or never was."""

from __future__ import annotations

import contextlib
import logging
import signal
import time

import pytest

from .test_stores import key

redis = pytest.importorskip("redis")
from paged_kv.tiers import remote  # noqa: E402  (needs the redis client)
from paged_kv.tiers.remote import RedisStore  # noqa: E402

TIMEOUT_S = 0.3


@pytest.fixture
def round_trips(monkeypatch):
    """Counts of the client's network writes (one per round trip) and connects."""
    counts = {"sends": 0, "connects": 0}
    send, connect = redis.connection.Connection.send_packed_command, \
        redis.connection.Connection.connect

    def counting_send(self, *args, **kwargs):
        counts["sends"] += 1
        return send(self, *args, **kwargs)

    def counting_connect(self, *args, **kwargs):
        counts["connects"] += 0 if self._sock else 1
        return connect(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting_send)
    monkeypatch.setattr(redis.connection.Connection, "connect", counting_connect)
    return counts


def command_calls(client, command: str) -> int:
    return client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def test_one_round_trip_per_call(redis_server, round_trips):
    store = RedisStore(redis_server)
    admin = redis.Redis.from_url(redis_server)
    keys = [key(i) for i in range(64)]
    calls = [("put", lambda: store.put([(k, k.encode()) for k in keys]), "set", 64),
             ("contains", lambda: store.contains(keys), "exists", 64),
             ("get", lambda: store.get(keys), "mget", 1),
             ("delete", lambda: store.delete(keys[:32]), "del", 1)]
    for name, call, command, expected_calls in calls:
        before, round_trips["sends"] = command_calls(admin, command), 0
        call()
        assert round_trips["sends"] == 1, f"{name}: {round_trips['sends']} round trips"
        assert command_calls(admin, command) - before == expected_calls, name
    assert admin.get("pkv:" + keys[40]) == keys[40].encode()  # the documented key prefix
    admin.close()
    store.close()


def test_killed_server_misses_fast_then_reconnects(redis_servers):
    server = redis_servers()
    store = RedisStore(server.url, timeout_s=TIMEOUT_S)
    assert store.put([(key(0), b"before")]) == 1
    server.stop(kill=True)
    for name, call in [("get", lambda: store.get([key(0)]) == [None]),
                       ("contains", lambda: store.contains([key(0)]) == [False]),
                       ("put", lambda: store.put([(key(1), b"x")]) == 0),
                       ("delete", lambda: store.delete([key(1)]) is None),
                       ("usage", lambda: store.usage()[0] <= 1)]:
        started = time.monotonic()
        assert call(), name
        assert time.monotonic() - started < 2 * TIMEOUT_S, f"{name} blocked on a dead store"
    assert store.num_errors == 1  # the first call failed; the rest were in backoff

    server.start()  # same port; --save '' so the data is gone
    deadline = time.monotonic() + 5 * remote.BACKOFF_FIRST_S
    while store.put([(key(2), b"after")]) == 0:
        assert time.monotonic() < deadline, "the store did not reconnect after its backoff"
        time.sleep(0.05)
    assert store.get([key(0), key(2)]) == [None, b"after"]
    store.close()


def test_backoff_spares_the_network(redis_servers, round_trips):
    server = redis_servers()
    store = RedisStore(server.url, timeout_s=TIMEOUT_S)
    server.stop()
    assert store.get([key(0)]) == [None]  # fails: backoff starts
    errors, round_trips["sends"], round_trips["connects"] = store.num_errors, 0, 0
    for _ in range(100):
        store.get([key(0)])
        store.put([(key(0), b"x")])
    assert (round_trips["sends"], round_trips["connects"], store.num_errors) == (0, 0, errors)
    store.close()


def test_silent_server_bounded_by_timeout(redis_servers):
    server = redis_servers()
    store = RedisStore(server.url, timeout_s=TIMEOUT_S)
    assert store.put([(key(0), b"x")]) == 1
    server.process.send_signal(signal.SIGSTOP)  # accepts nothing, answers nothing
    try:
        started = time.monotonic()
        assert store.get([key(0)]) == [None]
        assert time.monotonic() - started < 2 * TIMEOUT_S
        assert store.num_errors == 1
    finally:
        server.process.send_signal(signal.SIGCONT)
    store.close()


def test_unreachable_at_construction_warns_once(redis_servers, caplog):
    server = redis_servers()
    server.stop()
    with caplog.at_level(logging.DEBUG, logger=remote.__name__):
        store = RedisStore(server.url, timeout_s=TIMEOUT_S)
        assert store.get([key(0)]) == [None]
        time.sleep(remote.BACKOFF_FIRST_S + 0.05)
        assert store.contains([key(0)]) == [False]  # tries again, fails again: no warning
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"127.0.0.1:{server.port}/0" in warnings[0].getMessage()
    assert store.num_errors == 2
    store.close()


def test_flushall_mid_way(redis_server):
    store = RedisStore(redis_server)
    keys = [key(i) for i in range(8)]
    assert store.put([(k, b"v" * 100) for k in keys]) == 8
    assert store.usage() == (8, 800)
    with contextlib.closing(redis.Redis.from_url(redis_server)) as admin:
        admin.flushall()
    assert store.contains(keys[:4]) == [False] * 4
    assert store.get(keys) == [None] * 8
    assert store.usage() == (0, 0)  # seen vanishing
    store.close()


def test_server_eviction_is_a_miss(redis_servers):
    server = redis_servers(maxmemory="4mb")
    store = RedisStore(server.url)
    keys = [key(i) for i in range(256)]
    for i in range(0, 256, 16):  # 16 MiB into a 4 MiB server
        assert store.put([(k, bytes(65536)) for k in keys[i:i + 16]]) == 16
    hits = [value is not None for value in store.get(keys)]
    assert sum(hits) < 128, "the server evicted nothing"  # its LRU is approximate: no order
    assert hits[-1], "the newest value was evicted"
    assert store.usage() == (sum(hits), 65536 * sum(hits))  # the misses were seen vanishing
    assert store.num_errors == 0
    store.close()


def test_refused_writes_counted(redis_servers):
    server = redis_servers(maxmemory="2mb", policy="noeviction")
    store = RedisStore(server.url)
    written = sum(store.put([(key((i, j)), bytes(65536)) for j in range(8)]) for i in range(8))
    assert 0 < written < 64
    assert store.num_errors == 64 - written
    assert store.get([key((0, 0))]) == [bytes(65536)]  # up all along: no backoff
    store.close()


def test_closed_store_misses_without_network(redis_server, round_trips):
    store = RedisStore(redis_server)
    store.put([(key(0), b"x")])
    store.close()
    round_trips["sends"] = 0
    assert store.get([key(0)]) == [None] and store.put([(key(1), b"y")]) == 0
    assert round_trips["sends"] == 0


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379/0", "redis://127.0.0.1:port/0",
                                 "redis://127.0.0.1:6379/db", "redis:///0", "127.0.0.1:6379"])
def test_bad_url(url):
    with pytest.raises(ValueError, match="url: expected redis://HOST:PORT/DB"):
        RedisStore(url)


def test_bad_url_message_hides_the_password():
    with pytest.raises(ValueError) as raised:
        RedisStore("http://user:hunter2@127.0.0.1:6379/0")
    assert "hunter2" not in str(raised.value) and "user:***@" in str(raised.value)


def test_values_over_a_part_are_split_and_read_in_one_round_trip(redis_server, round_trips):
    """A 64 KiB block and its header in one Redis string take an 80 KiB allocation; stored
    in parts they take about their size. Every part comes back in the one MGET, and a value
    missing any part is a miss (never a shorter value)."""
    size = 65536 + 80
    store = RedisStore(redis_server, value_bytes=size)
    admin = redis.Redis.from_url(redis_server)
    values = {key(i): bytes([i]) * size for i in range(8)}
    assert store.put(list(values.items())) == 8
    round_trips["sends"] = 0
    assert store.get(list(values)) == list(values.values())
    assert round_trips["sends"] == 1
    used = admin.info("memory")["used_memory"]
    assert store.put([(key(100 + i), bytes([i]) * size) for i in range(32)]) == 32
    per_byte = (admin.info("memory")["used_memory"] - used) / (32 * 65536)
    assert per_byte < 1.02, f"{per_byte:.3f} bytes of Redis memory per payload byte"
    admin.delete(f"pkv:{key(3)}|1")  # the tail of one value evicted
    assert store.contains([key(2), key(3)]) == [True, False]
    assert store.get([key(3)]) == [None]
    assert store.put([(key(9), b"short")]) == 1 and store.get([key(9)]) == [None], \
        "a value of another length is stored whole and read as a miss"
    admin.close()
    store.close()
