"""The `Store` contract, checked on every tier: round trips, LRU order and the byte cap."""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from paged_kv.tiers.disk import DiskStore
from paged_kv.tiers.memory import HostStore

KINDS = ["host", "disk", "remote"]
CAPPED_KINDS = ["host", "disk"]  # the remote tier's cap is the server's maxmemory


def key(i: object, namespace: str = "0" * 32) -> str:
    """A store key shaped like `codec.store_key`'s."""
    return f"{namespace}:{hashlib.sha256(str(i).encode()).hexdigest()}"


@pytest.fixture
def make_store(request, tmp_path):
    """``make_store(kind, cap_bytes)``: a fresh store of that tier, closed at teardown."""
    stores = []

    def make(kind: str, cap_bytes: int = 1 << 20):
        if kind == "host":
            store = HostStore(cap_bytes)
        elif kind == "disk":
            store = DiskStore(str(tmp_path / "disk"), cap_bytes)
        else:
            from paged_kv.tiers.remote import RedisStore

            store = RedisStore(request.getfixturevalue("redis_server"), timeout_s=1.0)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def held_bytes(store) -> int:
    """Bytes the store holds: for the disk, every file under its directory (os.walk)."""
    if isinstance(store, DiskStore):
        return sum(os.path.getsize(os.path.join(root, name))
                   for root, _, names in os.walk(store.directory) for name in names)
    return store.usage()[1]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(make_store, kind):
    store = make_store(kind)
    rng = random.Random(0)
    items = [(key(i), rng.randbytes(rng.randint(0, 5000))) for i in range(32)]
    keys, values = [k for k, _ in items], [v for _, v in items]
    assert store.put(items) == 32, kind
    assert store.contains([*keys, key("absent")]) == [True] * 32 + [False], kind
    assert store.get([*keys, key("absent")]) == [*values, None], kind
    assert store.usage() == (32, sum(map(len, values))), kind

    store.delete(keys[:10])
    assert store.contains(keys) == [False] * 10 + [True] * 22, kind
    assert store.get(keys) == [None] * 10 + values[10:], kind
    assert store.usage() == (22, sum(map(len, values[10:]))), kind

    assert store.put([(keys[10], b"new value")]) == 1, kind  # replaces, counted once
    assert store.get([keys[10]]) == [b"new value"], kind
    assert store.usage() == (22, sum(map(len, values[11:])) + 9), kind
    assert (store.get([]), store.contains([]), store.put([]), store.delete([])) == (
        [], [], 0, None), kind


@pytest.mark.parametrize("kind", CAPPED_KINDS)
def test_lru_order(make_store, kind):
    store = make_store(kind, cap_bytes=400)
    keys = [key(i) for i in range(6)]
    assert store.put([(k, bytes([i]) * 100) for i, k in enumerate(keys[:4])]) == 4
    assert store.get([keys[0]]) == [b"\x00" * 100]  # keys[0] is now the most recent
    assert store.put([(keys[4], b"4" * 100)]) == 1
    assert store.contains(keys[:5]) == [True, False, True, True, True], kind
    assert store.put([(keys[5], b"5" * 150)]) == 1  # needs two evictions: 2, then 3
    assert store.contains(keys) == [True, False, False, False, True, True], kind
    assert store.usage() == (3, 350), kind


@pytest.mark.parametrize("kind", CAPPED_KINDS)
def test_cap_holds(make_store, kind):
    cap = 5000
    store = make_store(kind, cap_bytes=cap)
    rng = random.Random(1)
    for batch in range(60):
        items = [(key((batch, i)), rng.randbytes(rng.randint(1, 1500)))
                 for i in range(rng.randint(1, 4))]
        assert store.put(items) == len(items), f"{kind} batch {batch}"
        held = held_bytes(store)
        assert held <= cap, f"{kind} batch {batch}: {held} bytes held, cap {cap}"
        assert held == store.usage()[1], f"{kind} batch {batch}: usage disagrees with disk"
        assert store.get([k for k, _ in items]) == [v for _, v in items], f"{kind} {batch}"


@pytest.mark.parametrize("kind", CAPPED_KINDS)
def test_value_larger_than_cap_not_stored(make_store, kind):
    store = make_store(kind, cap_bytes=1000)
    assert store.put([(key(0), b"x" * 600)]) == 1
    assert store.put([(key(1), b"y" * 1001), (key(2), b"z" * 100)]) == 1, kind
    assert store.contains([key(0), key(1), key(2)]) == [True, False, True], kind
    assert held_bytes(store) == 700, kind


@pytest.mark.parametrize("kind", CAPPED_KINDS)
def test_a_value_exactly_the_cap_is_stored(make_store, kind):
    store = make_store(kind, cap_bytes=1000)
    assert store.put([(key(0), b"x" * 600)]) == 1
    assert store.put([(key(1), b"y" * 1000)]) == 1, kind  # evicts everything else
    assert store.contains([key(0), key(1)]) == [False, True], kind
    assert store.usage() == (1, 1000) and held_bytes(store) == 1000, kind
    assert store.get([key(1)]) == [b"y" * 1000], kind
    assert store.put([(key(2), b"z" * 400), (key(3), b"w" * 600)]) == 2, kind  # fills it
    assert store.contains([key(1), key(2), key(3)]) == [False, True, True], kind
    assert held_bytes(store) == 1000, kind
