"""Tenants share the tiers as they share the device pool (issue 29).

With a `TenantPolicy` in the cache's config every tier keeps its blocks by tenant: a tenant
never holds more than its tier quota (plus one block) in the host, disk or Redis tier,
sampled through a run and counted in the store itself; a quiet tenant's reservation in the
host tier keeps its system prompt there while a noisy one floods (without a policy its hit
rate collapses, measured in the same test); the tiers remember which tier evicted a block
and under whose pressure (`TierManager.evicted_entry`); a fetch reports the blocks it
loaded per tier and why it stopped short (``fetch.loaded``, ``fetch.failure``), and a
request's `RequestOutput.miss` / ``cached_by_source`` say the same.
"""

from __future__ import annotations

import time

import pytest

from paged_kv.engine import Engine
from paged_kv.engine.config import EngineConfig
from paged_kv.tenants import TenantLimits, TenantPolicy, TierLimits
from paged_kv.tiers import TierConfig, codec
from paged_kv.tiers.shares import TierGhosts, TierShares, tenant_prefix

from .conftest import (
    BLOCK_SIZE,
    chained_keys,
    full_block_tokens,
    random_prompts,
    serve_prompts,
    store_keys,
    tier_stats,
)

MIB = 1 << 20
PROMPT_LEN = 72  # 4 full blocks before the block of the last token
pytestmark = pytest.mark.usefixtures("fetch_always")  # hits must not depend on load


@pytest.fixture
def engines(tier_model):
    """``engines(tiers, policy=None, num_blocks=64)``: `Engine`s closed at teardown."""
    made: list[Engine] = []

    def make(tiers: TierConfig, policy: TenantPolicy | None = None, num_blocks: int = 64):
        model = tier_model(0)
        config = model.cache_config(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                    tenants=policy)
        made.append(Engine(model, EngineConfig(cache=config, kv_tiers=tiers)))
        return made[-1]

    yield make
    for engine in reversed(made):
        engine.close()


def host_mib_for(blocks: int, nbytes: int) -> float:
    """A host tier cap of `blocks` values of blocks of `nbytes` (and half a value)."""
    return (blocks + 0.5) * (codec.HEADER.size + nbytes) / MIB


def block_nbytes(tier_model) -> int:
    """Bytes of one block of `tier_model(0)`'s pool."""
    model = tier_model(0)
    cache = model.cache_config(num_blocks=8, block_size=BLOCK_SIZE)
    with Engine(model, EngineConfig(cache=cache)) as probe:
        return probe.cache.pool.block_nbytes


# -- the accounting alone -------------------------------------------------------------------
def test_shares_evict_own_over_quota_and_never_below_a_reservation():
    policy = TenantPolicy({"a": TenantLimits(tiers={"host": TierLimits(quota=3)}),
                           "b": TenantLimits(tiers={"host": TierLimits(reservation=2)})})
    shares = TierShares("host", 6, [None, "a", "b"], policy, num_blocks=64)
    keys = [bytes([i]) * 32 for i in range(20)]
    keep, victims = shares.admit(keys[:2], [2, 2], held=0)  # b: 2 blocks, reserved
    assert keep == [0, 1] and victims == []
    keep, victims = shares.admit(keys[2:6], [1] * 4, held=2)  # a: the 4th is past quota
    assert keep == [1, 2, 3] and victims == [(keys[2], "own", None, 1)]  # 1st not written
    keep, victims = shares.admit(keys[6:9], [0] * 3, held=5)  # unnamed: tier full at 6
    assert keep == [0, 1, 2]
    # b's two are older than everything, but at its reservation: a's oldest go instead
    assert victims == [(keys[3], "tenant", None, 1), (keys[4], "tenant", None, 1)]
    assert shares.tenant_blocks() == {"": 3, "a": 1, "b": 2}
    _, victims = shares.admit(keys[9:10], [2], held=6)  # b past its reservation: its own
    assert victims == [(keys[0], "own", None, 2)]  # oldest goes
    assert shares.tenant_blocks()["b"] == 2 and shares.forget(keys[:2]) == [keys[1]]


def test_a_block_that_needs_a_reserved_victim_is_not_written():
    policy = TenantPolicy({"b": TenantLimits(tiers={"host": TierLimits(reservation=2)})})
    shares = TierShares("host", 2, [None, "b"], policy, num_blocks=64)
    keys = [bytes([i]) * 32 for i in range(3)]
    assert shares.admit(keys[:2], [1, 1], held=0) == ([0, 1], [])
    assert shares.admit(keys[2:], [0], held=2) == ([], [])  # nothing may go: not written
    assert shares.tenant_blocks() == {"": 0, "b": 2}


def test_blocks_an_earlier_run_left_go_first_by_the_stores_own_lru():
    policy = TenantPolicy({"b": TenantLimits(tiers={"disk": TierLimits(reservation=1)})})
    shares = TierShares("disk", 3, [None, "b"], policy, num_blocks=64)
    keys = [bytes([i]) * 32 for i in range(4)]
    # the store holds 2 blocks the accounting never saw: room is made from those first
    assert shares.admit(keys[:1], [1], held=2) == ([0], [])
    assert shares.admit(keys[1:3], [0, 0], held=3) == ([0, 1], [])
    # now everything is known: the unnamed tenant's own oldest goes (b is at reservation)
    assert shares.admit(keys[3:], [0], held=3) == ([0], [(keys[1], "own", None, 0)])


def test_ghosts_name_the_deepest_tier_and_stay_bounded():
    ghosts = TierGhosts({"host": 4, "disk": None})
    key = b"k" * 32
    ghosts.evicted("host", [(key, "tenant", "a", 1)])
    assert ghosts.entry(key) == ("host", "tenant", "a")
    ghosts.evicted("disk", [(key, "own", None, 0)])
    assert ghosts.entry(key) == ("disk", "own", None)
    ghosts.evicted("host", [(bytes([i]) * 32, "global", None, 0) for i in range(100)])
    assert len(ghosts) <= 16 + 1  # host: 4 x its 4 blocks; disk: the one key


# -- quotas in every tier, sampled through a run --------------------------------------------
@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_a_tenant_never_exceeds_its_tier_quota(request, tmp_path, engines, tier):
    quota = 4
    policy = TenantPolicy({"a": TenantLimits(tiers={tier: TierLimits(quota=quota)}),
                           "b": TenantLimits()})
    if tier == "host":
        fields = dict(host_mib=8)
    elif tier == "disk":
        fields = dict(disk_dir=str(tmp_path / "disk"), disk_mib=8)
    else:
        fields = dict(remote_url=request.getfixturevalue("redis_server"))
    engine = engines(TierConfig(fetch_deadline_s=5.0, **fields), policy)
    [store] = engine.tiers.stores

    def names(prompts: list[list[int]], tenant: str) -> list[str]:
        """The store's names of `tenant`'s blocks: Redis' carry the tenant's prefix."""
        prefix = tenant_prefix(tenant) if tier == "remote" else ""
        return [prefix + k for p in prompts for k in store_keys(engine, p, tenant)]

    prompts = random_prompts(12, PROMPT_LEN, seed=91)
    b_prompts = random_prompts(2, PROMPT_LEN, seed=92)
    serve_prompts(engine, b_prompts, salt="b")
    peak = 0
    for start in range(0, len(prompts), 2):
        serve_prompts(engine, prompts[start:start + 2], salt="a")
        assert engine.tiers.flush(timeout=10)
        held = store.contains(names(prompts, "a"))
        counted = tier_stats(engine)[tier].tenant_blocks
        assert sum(held) <= quota + 1 and counted["a"] <= quota + 1, (held, counted)
        assert counted["a"] == sum(held)  # the accounting is what the store holds
        peak = max(peak, sum(held))
    assert peak == quota  # it got there: the bound is the quota, not an empty tier
    # b has no quota: its blocks all stayed
    assert all(store.contains(names(b_prompts, "b")))
    assert tier_stats(engine)[tier].tenant_blocks["b"] == 8
    own = engine.tiers.evicted_entry(chained_keys(prompts[0], "a")[0])
    assert own == (tier, "own", None)
    # what the tier holds comes back: device dropped, a's last prompt fetched from the tier
    engine.cache.reset_prefix_cache()
    [out] = serve_prompts(engine, [prompts[-1]], salt="a")
    assert out.cached_by_source == {"device": 0, tier: full_block_tokens(prompts[-1])}
    engine.check()


def test_redis_keys_carry_their_tenants_prefix(redis_server, engines):
    policy = TenantPolicy({"acme": TenantLimits()})
    engine = engines(TierConfig(remote_url=redis_server, fetch_deadline_s=5.0), policy)
    [store] = engine.tiers.stores
    [named], [unnamed] = random_prompts(1, PROMPT_LEN, seed=61), random_prompts(
        1, PROMPT_LEN, seed=62)
    serve_prompts(engine, [named], salt="acme")
    serve_prompts(engine, [unnamed], salt="other")  # not named by the policy: no prefix
    assert engine.tiers.flush(timeout=10)
    acme, other = store_keys(engine, named, "acme"), store_keys(engine, unnamed, "other")
    assert all(store.contains(["acme/" + k for k in acme])) and not any(store.contains(acme))
    assert all(store.contains(other))
    engine.cache.reset_prefix_cache()  # both come back from Redis under their names
    outs = serve_prompts(engine, [named], salt="acme") + serve_prompts(engine, [unnamed],
                                                                       salt="other")
    assert [o.cached_by_source for o in outs] == [{"device": 0, "remote": 64}] * 2


# -- a noisy neighbour through the host tier ------------------------------------------------
def quiet_hit_rate(engine: Engine, rounds: int, noisy: bool) -> tuple[float, int]:
    """Tenant b repeats its system prompt (a new tail each time) once a round, tenant a
    floods 10 unique prompts a round after it; b's prefix hit rate over rounds 1.. (round 0
    is cold) and the tokens of it that came from the host tier."""
    system = random_prompts(1, 64, seed=5)[0]
    tails = random_prompts(rounds, PROMPT_LEN - 64, seed=6)
    floods = random_prompts(10 * rounds, PROMPT_LEN, seed=7)
    hits = from_host = 0
    for r in range(rounds):
        [out] = serve_prompts(engine, [system + tails[r]], salt="b")
        if r:
            hits += out.prefix_hit_tokens
            from_host += (out.cached_by_source or {}).get("host", 0)
        assert engine.tiers.flush(timeout=10)
        if noisy:
            serve_prompts(engine, floods[10 * r:10 * r + 10], salt="a")
            assert engine.tiers.flush(timeout=10)
    return hits / ((rounds - 1) * full_block_tokens(system + tails[0])), from_host


def test_a_reservation_in_the_host_tier_keeps_a_quiet_tenants_hits(tier_model, engines):
    rounds, device, host = 8, 24, 24  # a's round: 40 blocks, flushes the pool and the tier
    mib = host_mib_for(host, block_nbytes(tier_model))
    config = TierConfig(host_mib=mib, fetch_deadline_s=5.0)
    reserved = TenantPolicy({"a": TenantLimits(),
                             "b": TenantLimits(tiers={"host": TierLimits(reservation=4)})})
    solo, _ = quiet_hit_rate(engines(config, None, device), rounds, noisy=False)
    shared, _ = quiet_hit_rate(engines(config, None, device), rounds, noisy=True)
    engine = engines(config, reserved, device)
    kept, from_host = quiet_hit_rate(engine, rounds, noisy=True)
    assert solo == 1.0
    assert shared < 0.5 * solo, shared  # without a policy the flood evicts b everywhere
    assert kept >= 0.9 * solo, (kept, tier_stats(engine))
    assert from_host >= 0.9 * (rounds - 1) * 64  # the device lost it: the tier kept it
    assert tier_stats(engine)["host"].tenant_blocks["b"] >= 4
    # /metrics shows the same split (a scrape observes the tiers first)
    text = engine.metrics_text()
    for tenant, blocks in tier_stats(engine)["host"].tenant_blocks.items():
        assert (f'paged_kv_tier_tenant_blocks{{tenant="{tenant}",tier="host"}} '
                f'{float(blocks)}') in text
    engine.check()


# -- why a request missed -------------------------------------------------------------------
def test_evicted_entry_names_tier_and_pressure(tier_model, engines):
    nbytes = block_nbytes(tier_model)
    config = TierConfig(host_mib=host_mib_for(8, nbytes), fetch_deadline_s=5.0)
    victim, *flood = random_prompts(5, PROMPT_LEN, seed=31)

    plain = engines(config)  # no policy: the store's own LRU, "global"
    serve_prompts(plain, [victim], salt="b")
    assert plain.tiers.flush(timeout=10)
    key = chained_keys(victim, "b")[0]
    assert plain.tiers.evicted_entry(key) is None  # held: not a ghost
    serve_prompts(plain, flood, salt="a")
    assert plain.tiers.flush(timeout=10)
    assert plain.tiers.evicted_entry(key) == ("host", "global", None)

    policy = TenantPolicy({"a": TenantLimits(), "b": TenantLimits()})
    shared = engines(config, policy)
    serve_prompts(shared, [victim], salt="b")
    assert shared.tiers.flush(timeout=10)
    serve_prompts(shared, flood, salt="a")
    assert shared.tiers.flush(timeout=10)
    assert shared.tiers.evicted_entry(key) == ("host", "tenant", "a")
    # the request that comes back for it is told so
    shared.cache.reset_prefix_cache()
    [out] = serve_prompts(shared, [victim], salt="b")
    assert out.prefix_hit_tokens == 0
    assert out.miss == {"reason": "evicted", "block": 0, "tier": "host", "pressure": "tenant",
                        "by": "a"}
    assert out.cached_by_source == {"device": 0}


def only_in_the_tier(engine: Engine, seed: int):
    """A prompt served under salt "t", written to the engine's one tier and dropped from the
    device; returns it and the tier's store."""
    [prompt] = random_prompts(1, PROMPT_LEN, seed=seed)
    serve_prompts(engine, [prompt], salt="t")
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    [store] = engine.tiers.stores
    return prompt, store


def test_a_timeout_is_reported_on_the_fetch_and_the_request(engines, monkeypatch):
    engine = engines(TierConfig(host_mib=8, fetch_deadline_s=0.05))
    prompt, store = only_in_the_tier(engine, seed=41)
    get = store.get
    monkeypatch.setattr(store, "get", lambda keys: (time.sleep(0.5), get(keys))[1])
    fetches = recorded(engine, monkeypatch)
    [out] = serve_prompts(engine, [prompt], salt="t")
    [fetch] = fetches
    assert fetch.failure == ("tier_timeout", "host") and fetch.loaded == {}
    assert out.prefix_hit_tokens == 0
    assert out.miss == {"reason": "tier_timeout", "block": 0, "tier": "host"}
    assert engine.stats().tiers.deadline_fallbacks == 1


def test_a_verify_failure_is_reported_on_the_fetch_and_the_request(engines, monkeypatch):
    engine = engines(TierConfig(host_mib=8, fetch_deadline_s=5.0))
    prompt, store = only_in_the_tier(engine, seed=42)
    name = store_keys(engine, prompt, "t")[1]
    [value] = store.get([name])
    store.put([(name, value[:-1] + bytes([value[-1] ^ 1]))])  # one bit of block 1 torn
    fetches = recorded(engine, monkeypatch)
    [out] = serve_prompts(engine, [prompt], salt="t")
    [fetch] = fetches
    assert fetch.failure == ("verify_failed", "host") and fetch.loaded == {"host": 1}
    assert out.prefix_hit_tokens == BLOCK_SIZE  # block 0 came back, block 1 recomputed
    assert out.miss == {"reason": "verify_failed", "block": 1, "tier": "host"}
    assert out.cached_by_source == {"device": 0, "host": BLOCK_SIZE}
    assert tier_stats(engine)["host"].verify_failures == 1


def test_a_full_fetch_reports_its_blocks_and_no_failure(engines, monkeypatch):
    engine = engines(TierConfig(host_mib=8, fetch_deadline_s=5.0))
    [prompt] = random_prompts(1, PROMPT_LEN, seed=43)
    serve_prompts(engine, [prompt])
    assert engine.tiers.flush(timeout=10)
    engine.cache.reset_prefix_cache()
    fetches = recorded(engine, monkeypatch)
    [out] = serve_prompts(engine, [prompt])
    [fetch] = fetches
    assert fetch.loaded == {"host": 4} and fetch.failure is None
    assert out.cached_by_source == {"device": 0, "host": 64} and out.miss is None


def recorded(engine: Engine, monkeypatch) -> list:
    """The fetches `engine`'s tiers start from now on."""
    fetches: list = []
    start = engine.tiers.start_fetch

    def record(*args, **kwargs):
        fetch = start(*args, **kwargs)
        if fetch is not None:
            fetches.append(fetch)
        return fetch
    monkeypatch.setattr(engine.tiers, "start_fetch", record)
    return fetches
