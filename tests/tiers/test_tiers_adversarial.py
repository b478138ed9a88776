"""The tiers under attack and failure: nothing wrong is ever served, nothing waits unbounded.

On a small TinyLlama with greedy sampling, every output is compared with an engine without
tiers. Store keys forced to collide (``codec.KEY_HEX_CHARS`` = 3) are verification
failures, not wrong K/V; two tenants (salts) never share a block through any tier; another
block size, KV dtype or model's weights on the same disk and Redis never hit; truncated
(down to empty), bit-flipped, extended or foreign (another fingerprint) values are misses,
counted, deleted and rewritten; a Redis killed
and restarted mid-run, flushed mid-run, slowed past the fetch deadline by a proxy, or never
reachable costs recomputation only, within the deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import socket
import threading
import time

import numpy as np
import pytest

from paged_kv.keys import encode_tokens, hash_block, root_hash
from paged_kv.tiers import TierConfig, codec

from .conftest import (
    BLOCK_SIZE,
    chained_keys,
    fingerprint,
    full_block_tokens,
    random_prompts,
    serve_prompts,
    store_keys,
    tier_stats,
    tiers_summary,
    tokens_of,
)

redis = pytest.importorskip("redis")
from paged_kv.tiers import remote  # noqa: E402  (needs the redis client)

pytestmark = pytest.mark.usefixtures("fetch_always")  # hits must not depend on load

HEX_CHARS = 3  # the fewest the disk store accepts: 4096 store keys per namespace
PROMPT_LEN = 70  # 4 full blocks before the last token's block


def deadline_config(**fields) -> TierConfig:
    fields.setdefault("fetch_deadline_s", 5.0)  # the read path under test, not the deadline
    return TierConfig(**fields)


def all_tiers(tmp_path, redis_url: str, disk: str = "disk", **fields) -> TierConfig:
    return deadline_config(host_mib=8, disk_dir=str(tmp_path / disk), disk_mib=8,
                           remote_url=redis_url, **fields)


def hits_of(outputs) -> list[int]:
    return [out.prefix_hit_tokens for out in outputs]


def admin_client(url: str):
    return redis.Redis.from_url(url, socket_timeout=2)


# -- forced key collisions ------------------------------------------------------------------
class CollidingPrompts:
    """Prompts whose full blocks have distinct store keys (truncated to `HEX_CHARS`), except
    for the pairs made to collide on purpose."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.taken: set[str] = set()

    def _block(self) -> list[int]:
        return [self.rng.randrange(256) for _ in range(BLOCK_SIZE)]

    @staticmethod
    def _key(chain: bytes, block: list[int]) -> bytes:
        return hash_block(chain, encode_tokens(np.asarray(block)))

    def extend(self, prompt: list[int], chain: bytes, blocks: int) -> tuple[list[int], bytes]:
        """`prompt` grown by `blocks` blocks whose store keys collide with nothing."""
        for _ in range(blocks):
            while True:
                block = self._block()
                key = self._key(chain, block)
                if key.hex()[:HEX_CHARS] not in self.taken:
                    break
            self.taken.add(key.hex()[:HEX_CHARS])
            prompt, chain = prompt + block, key
        return prompt, chain

    def finish(self, prompt: list[int]) -> list[int]:
        return prompt + self._block()[:PROMPT_LEN - len(prompt)]

    def unique(self) -> list[int]:
        return self.finish(self.extend([], root_hash(None), PROMPT_LEN // BLOCK_SIZE)[0])

    def pair(self, at: int) -> tuple[list[int], list[int]]:
        """Two prompts whose blocks `at` have the same store key (and nothing else does)."""
        a, chain_a = self.extend([], root_hash(None), at)
        b, chain_b = self.extend([], root_hash(None), at)
        seen: tuple[dict, dict] = ({}, {})
        while True:  # a birthday search across the two chains
            for side, chain in enumerate((chain_a, chain_b)):
                block = self._block()
                key = self._key(chain, block)
                short = key.hex()[:HEX_CHARS]
                other = seen[1 - side].get(short)
                if other is not None and short not in self.taken and other[1] != key:
                    self.taken.add(short)
                    a_block, b_block = (block, other[0]) if side == 0 else (other[0], block)
                    a_key, b_key = (key, other[1]) if side == 0 else (other[1], key)
                    rest = PROMPT_LEN // BLOCK_SIZE - at - 1
                    a = self.extend(a + a_block, a_key, rest)[0]
                    b = self.extend(b + b_block, b_key, rest)[0]
                    return self.finish(a), self.finish(b)
                seen[side].setdefault(short, (block, key))


def test_colliding_store_keys_are_verify_failures_never_wrong_tokens(
        request, tmp_path, monkeypatch, tier_engines, reference_tokens):
    monkeypatch.setattr(codec, "KEY_HEX_CHARS", HEX_CHARS)
    maker = CollidingPrompts(seed=7)
    prompts, expected_hits = [], []
    for at in (0, 0, 2, 2, 3):  # the block of the pair's shared store key
        first, second = maker.pair(at)
        prompts += [first, second]  # written in this order: the second's value stays
        expected_hits += [at * BLOCK_SIZE, full_block_tokens(second)]
    for _ in range(6):
        prompts.append(maker.unique())
        expected_hits.append(full_block_tokens(prompts[-1]))
    expected = reference_tokens(prompts)
    engine = tier_engines(all_tiers(tmp_path, request.getfixturevalue("redis_server")))
    keys = [store_keys(engine, p) for p in prompts]
    assert len({k for ks in keys for k in ks}) == sum(map(len, keys)) - 5  # 5 shared keys
    for prompt, tokens in zip(prompts, expected, strict=True):  # one at a time: the
        assert tokens_of(serve_prompts(engine, [prompt])) == [tokens]  # prompts' write order
        assert engine.tiers.flush(timeout=10)
    written = tier_stats(engine)
    assert all(s.blocks == sum(map(len, keys)) - 5 for s in written.values())
    # already while writing: the second of a pair colliding at block 0 was looked up before
    # it was computed, and found the first's value under its store key
    assert written["host"].verify_failures == 2
    assert [s.hit_tokens for s in written.values()] == [0, 0, 0]

    failures = sum(s.verify_failures for s in written.values())
    for round_ in range(2):
        engine.cache.reset_prefix_cache()
        outputs = serve_prompts(engine, prompts)
        assert engine.tiers.flush(timeout=10)
        stats = tier_stats(engine)
        assert tokens_of(outputs) == expected, round_
        hits = hits_of(outputs)
        # a block whose store key another's value holds fails verification and is
        # recomputed (then written over the other's, so a pair's winner can change from
        # round to round); the colliding block is never served, the blocks before it are
        floors = [at * BLOCK_SIZE for at in (0, 0, 2, 2, 3) for _ in range(2)]
        for hit, floor, prompt in zip(hits, floors, prompts, strict=False):
            assert hit % BLOCK_SIZE == 0 and floor <= hit <= full_block_tokens(prompt), round_
        assert hits[10:] == expected_hits[10:], (round_, tiers_summary(engine))  # unique
        now = sum(s.verify_failures for s in stats.values())
        assert now > failures, (round_, tiers_summary(engine))
        failures = now
    engine.check()


# -- tenants --------------------------------------------------------------------------------
def test_two_tenants_never_share_through_any_tier(request, tmp_path, tier_engines,
                                                  reference_tokens):
    [prompt] = random_prompts(1, PROMPT_LEN, seed=11)
    [expected] = reference_tokens([prompt])
    full = full_block_tokens(prompt)
    config = all_tiers(tmp_path, request.getfixturevalue("redis_server"))
    engine = tier_engines(config)
    [out] = serve_prompts(engine, [prompt], salt="alice")
    assert out.outputs[0].token_ids == expected and out.prefix_hit_tokens == 0
    assert engine.tiers.flush(timeout=10)
    assert all(s.blocks == full // BLOCK_SIZE for s in tier_stats(engine).values())

    for salt in ("bob", None):  # another tenant, and no tenant at all
        engine.cache.reset_prefix_cache()
        before = {name: s.hit_tokens for name, s in tier_stats(engine).items()}
        [out] = serve_prompts(engine, [prompt], salt=salt)
        assert out.prefix_hit_tokens == 0, (salt, tiers_summary(engine))
        assert out.outputs[0].token_ids == expected
        assert {name: s.hit_tokens for name, s in tier_stats(engine).items()} == before
    engine.cache.reset_prefix_cache()
    [out] = serve_prompts(engine, [prompt], salt="alice")  # the owner still hits
    assert out.prefix_hit_tokens == full and out.outputs[0].token_ids == expected
    assert engine.tiers.flush(timeout=10)
    engine.close()

    # another replica on the same disk and Redis: the same holds there
    replica = tier_engines(config)
    [carol] = serve_prompts(replica, [prompt], salt="carol")
    assert carol.prefix_hit_tokens == 0 and carol.outputs[0].token_ids == expected
    [alice] = serve_prompts(replica, [[*prompt[:full], 1, 2, 3]], salt="alice")
    assert alice.prefix_hit_tokens == full
    assert tier_stats(replica)["disk"].hit_tokens == full
    replica.check()


# -- fingerprints ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [{"block_size": 32}, {"kv_cache_dtype": "int8"},
                                     {"seed": 1}], ids=["block_size", "kv_dtype", "weights"])
def test_another_fingerprint_on_the_same_stores_never_hits(request, tmp_path, tier_engines,
                                                            reference_tokens, variant):
    prompts = random_prompts(3, PROMPT_LEN, seed=13)
    config = TierConfig(disk_dir=str(tmp_path / "disk"), disk_mib=8, fetch_deadline_s=5.0,
                        remote_url=request.getfixturevalue("redis_server"))
    writer = tier_engines(config)
    serve_prompts(writer, prompts)
    writer.close()

    other = tier_engines(config, **variant)
    outputs = serve_prompts(other, prompts)
    assert hits_of(outputs) == [0] * len(prompts), tiers_summary(other)
    assert tokens_of(outputs) == reference_tokens(prompts, **variant)
    for stats in tier_stats(other).values():
        assert stats.hit_tokens == stats.verify_failures == 0, stats  # never even read
        assert stats.misses > 0, stats  # looked up, in its own namespace
    other.close()

    same = tier_engines(config)  # the control: the writer's fingerprint does hit
    assert hits_of(serve_prompts(same, prompts)) == [full_block_tokens(p) for p in prompts]


# -- torn values ----------------------------------------------------------------------------
def truncated(value: bytes) -> bytes:
    return value[:len(value) // 2]


def payload_bit_flipped(value: bytes) -> bytes:
    at = codec.HEADER.size + 1000
    return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1:]


def key_field_flipped(value: bytes) -> bytes:
    at = 20  # inside the chained key the header repeats
    return value[:at] + bytes([value[at] ^ 0xFF]) + value[at + 1:]


def extended(value: bytes) -> bytes:
    return value + b"\0"


def emptied(value: bytes) -> bytes:
    return b""  # a file created, its data never written: a power cut


def header_cut(value: bytes) -> bytes:
    return value[:codec.HEADER.size // 2]


def foreign_fingerprint(value: bytes) -> bytes:
    """The same block's value as another model's engine would write it: every field and
    the checksum intact, another fingerprint in the header."""
    key, payload = value[8:40], value[codec.HEADER.size:]
    return codec.encode(key, bytes(16), payload)


# (prompt, block, damage): prompt 3 is left intact
DAMAGE = [(0, 0, truncated), (1, 2, payload_bit_flipped), (2, 1, key_field_flipped),
          (4, 3, extended), (5, 0, emptied), (6, 2, header_cut), (7, 1, foreign_fingerprint)]


def value_path(config: TierConfig, name: str) -> str:
    namespace, digest = name.split(":")
    return os.path.join(config.disk_dir, namespace, digest[:2], digest[2:])


def read_value(config: TierConfig, name: str) -> bytes | None:
    """The value of store key `name` in the one tier of `config`, read behind its back."""
    if config.disk_dir is not None:
        with open(value_path(config, name), "rb") as file:
            return file.read()
    with contextlib.closing(admin_client(config.remote_url)) as admin:
        return admin.get("pkv:" + name)


def write_value(config: TierConfig, name: str, value: bytes) -> None:
    if config.disk_dir is not None:
        with open(value_path(config, name), "wb") as file:
            file.write(value)
    else:
        with contextlib.closing(admin_client(config.remote_url)) as admin:
            admin.set("pkv:" + name, value)


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_torn_values_are_counted_deleted_and_rewritten(request, tmp_path, monkeypatch,
                                                       tier_engines, reference_tokens, tier):
    prompts = random_prompts(8, PROMPT_LEN, seed=17)
    expected = reference_tokens(prompts)
    if tier == "disk":
        config = deadline_config(disk_dir=str(tmp_path / "disk"), disk_mib=8)
    else:
        config = deadline_config(remote_url=request.getfixturevalue("redis_server"))
    writer = tier_engines(config)
    serve_prompts(writer, prompts)
    writer.close()

    reader = tier_engines(config)
    [store] = reader.tiers.stores
    deleted: list[str] = []
    delete = store.delete
    monkeypatch.setattr(store, "delete", lambda keys: (deleted.extend(keys), delete(keys)))
    damaged: dict[str, tuple[bytes, bytes]] = {}  # store key: (chained key, damaged value)
    for p, block, damage in DAMAGE:
        name = store_keys(reader, prompts[p])[block]
        value = damage(read_value(config, name))
        write_value(config, name, value)
        damaged[name] = (chained_keys(prompts[p])[block], value)

    outputs = serve_prompts(reader, prompts)
    hits = [full_block_tokens(p) for p in prompts]
    for p, block, _ in DAMAGE:
        hits[p] = block * BLOCK_SIZE  # served up to the damaged block, recomputed from it
    assert hits_of(outputs) == hits, tiers_summary(reader)
    assert tokens_of(outputs) == expected
    stats = tier_stats(reader)[tier]
    assert stats.verify_failures == len(DAMAGE), stats
    assert stats.hit_tokens == sum(hits)
    assert sorted(deleted) == sorted(damaged)  # each value that failed, and nothing else
    reader.check()

    # the blocks recomputed were written again, intact: every block is served next time
    assert reader.tiers.flush(timeout=10)
    digest, nbytes = fingerprint(reader).digest, reader.cache.pool.block_nbytes
    for name, (key, bad) in damaged.items():
        value = read_value(config, name)
        assert value != bad and codec.decode(value, key, digest, nbytes) is not None
    reader.cache.reset_prefix_cache()
    again = serve_prompts(reader, prompts)
    assert hits_of(again) == [full_block_tokens(p) for p in prompts], tiers_summary(reader)
    assert tokens_of(again) == expected
    assert tier_stats(reader)[tier].verify_failures == len(DAMAGE)


# -- Redis failing mid-run ------------------------------------------------------------------
def serve_stepping(engine, prompts, between=None, steps_before: int = 2,
                   timeout_s: float = 30.0) -> list:
    """Like `serve_prompts`, calling `between()` once after `steps_before` steps."""
    from paged_kv.engine import SamplingParams

    from .conftest import MAX_TOKENS

    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    done, steps, deadline = {}, 0, time.monotonic() + timeout_s
    while any(i not in done for i in ids):
        assert time.monotonic() < deadline, f"requests not done in {timeout_s} s"
        if steps == steps_before and between is not None:
            between()
        done.update((out.request_id, out) for out in engine.step())
        steps += 1
    return [done[i] for i in ids]


def test_redis_killed_and_restarted_mid_run(redis_servers, tier_engines, reference_tokens):
    server = redis_servers()
    deadline_s = 0.5
    old, new = random_prompts(4, PROMPT_LEN, seed=19), random_prompts(4, PROMPT_LEN, seed=23)
    expected = reference_tokens(old + new)
    engine = tier_engines(TierConfig(remote_url=server.url, fetch_deadline_s=deadline_s))
    serve_prompts(engine, old)
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()

    began = time.monotonic()
    outputs = serve_stepping(engine, old + new, lambda: server.stop(kill=True))
    assert tokens_of(outputs) == expected
    # no request waited on the dead store past its deadline (plus the steps ahead of it)
    assert max(out.time_to_first_token for out in outputs) < deadline_s + 2.0
    assert time.monotonic() - began < 10
    assert all(hit in (0, full_block_tokens(p)) for hit, p in zip(hits_of(outputs), old + new,
                                                                 strict=True))
    assert tier_stats(engine)["remote"].verify_failures == 0
    # whether the run's own writes reached the store before the kill is a race: one more
    # batch's blocks are written to the dead store for certain
    assert len(serve_prompts(engine, random_prompts(2, PROMPT_LEN, seed=29))) == 2
    assert engine.tiers.flush(timeout=10)
    assert engine.tiers.stores[0].num_errors > 0  # the engine did meet the dead store

    server.start()  # the same port, empty: the store reconnects after its backoff
    admin = admin_client(server.url)
    give_up = time.monotonic() + remote.BACKOFF_MAX_S + 5  # the longest backoff, and more
    for seed in itertools.count(29):  # new blocks until one is written to the new server
        [prompt] = random_prompts(1, PROMPT_LEN, seed=seed)
        serve_prompts(engine, [prompt])
        assert engine.tiers.flush(timeout=10)
        if admin.dbsize() > 0:
            break
        assert time.monotonic() < give_up, "the remote tier took no writes after the restart"
        time.sleep(0.2)
    engine.cache.reset_prefix_cache()
    before = tier_stats(engine)["remote"].hit_tokens
    [out] = serve_prompts(engine, [prompt])
    assert out.prefix_hit_tokens == full_block_tokens(prompt)
    assert out.outputs[0].token_ids == reference_tokens([prompt])[0]
    assert tier_stats(engine)["remote"].hit_tokens - before == full_block_tokens(prompt)
    admin.close()
    engine.check()


def test_flushall_mid_run_is_misses(redis_server, tier_engines, reference_tokens):
    prompts = random_prompts(6, PROMPT_LEN, seed=31)
    expected = reference_tokens(prompts)
    engine = tier_engines(deadline_config(remote_url=redis_server))
    serve_prompts(engine, prompts)
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    admin = admin_client(redis_server)
    assert admin.dbsize() == sum(full_block_tokens(p) for p in prompts) // BLOCK_SIZE

    outputs = serve_stepping(engine, prompts, admin.flushall, steps_before=1)
    assert tokens_of(outputs) == expected
    assert all(hit in (0, full_block_tokens(p)) for hit, p in zip(hits_of(outputs), prompts,
                                                                 strict=True))
    engine.cache.reset_prefix_cache()
    misses = tier_stats(engine)["remote"].misses
    outputs = serve_prompts(engine, prompts)
    assert tokens_of(outputs) == expected
    hits = hits_of(outputs)  # a prompt recomputed after the flush was written down again
    assert all(hit in (0, full_block_tokens(p)) for hit, p in zip(hits, prompts, strict=True))
    assert tier_stats(engine)["remote"].misses - misses >= hits.count(0)
    assert tier_stats(engine)["remote"].verify_failures == 0
    # every block recomputed is written down again: the third round comes from Redis
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    outputs = serve_prompts(engine, prompts)
    assert tokens_of(outputs) == expected
    assert hits_of(outputs) == [full_block_tokens(p) for p in prompts]
    admin.close()
    engine.check()


# -- a slow store ---------------------------------------------------------------------------
class SlowProxy:
    """A loopback TCP proxy to `port` that holds every chunk `delay_s` before forwarding."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.target, self.delay_s = port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.forwarded = 0
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                break
            if not data or self._stop.wait(self.delay_s):
                break
            try:
                dst.sendall(data)
            except OSError:
                break
            self.forwarded += 1
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()


@pytest.fixture
def slow_proxy():
    """``slow_proxy(port, delay_s)``: a `SlowProxy`, closed at teardown."""
    proxies: list[SlowProxy] = []

    def make(port: int, delay_s: float) -> SlowProxy:
        proxies.append(SlowProxy(port, delay_s))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


def test_a_store_slower_than_the_deadline_is_recomputed(redis_servers, slow_proxy,
                                                        tier_engines, reference_tokens):
    server = redis_servers()
    prompts = random_prompts(3, PROMPT_LEN, seed=37)
    expected = reference_tokens(prompts)
    writer = tier_engines(deadline_config(remote_url=server.url))
    serve_prompts(writer, prompts)
    writer.close()

    deadline_s, delay_s = 0.1, 0.3
    proxy = slow_proxy(server.port, delay_s=0.0)  # connects fast (a handshake is 3 trips)
    reader = tier_engines(TierConfig(remote_url=proxy.url, fetch_deadline_s=deadline_s))
    assert proxy.forwarded > 0  # the store's PING went through the proxy
    proxy.delay_s = delay_s  # from now on a round trip takes 0.6 s: 6 deadlines
    outputs = serve_prompts(reader, prompts)
    proxy.delay_s = 0.0  # the queued writes drain fast at teardown
    assert tokens_of(outputs) == expected
    assert hits_of(outputs) == [0] * len(prompts)
    stats = reader.stats().tiers
    assert stats.deadline_fallbacks == len(prompts), stats
    assert stats.loaded_blocks == 0
    # each request recomputed once its fetch's deadline passed, before even the first
    # round trip of its fetch could have come back
    assert max(out.time_to_first_token for out in outputs) < deadline_s + 0.4


def test_a_store_unreachable_at_start_only_costs_misses(tier_engines, reference_tokens,
                                                        caplog):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    prompts = random_prompts(3, PROMPT_LEN, seed=41)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="paged_kv.tiers"):
        engine = tier_engines(TierConfig(remote_url=url))
    assert any("unreachable" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records), caplog.text
    outputs = serve_prompts(engine, prompts)
    assert time.monotonic() - began < 5
    assert tokens_of(outputs) == reference_tokens(prompts)
    assert hits_of(outputs) == [0] * len(prompts)
    stats = tier_stats(engine)["remote"]
    # a store backing off is not even asked: no request waits on a fetch that can only miss
    assert engine.stats().tiers.fetches == 0 and stats.misses == 0
    assert stats.written_blocks == 0
    engine.check()
