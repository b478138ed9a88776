"""Tenants sharing the pool (`paged_kv.tenants`): quotas, reservations, soft retention, the
ghost list's miss reasons, and the policy's checks. Each test names the fault it catches;
`cache.check()` (which checks the ledger against the allocator) runs after every step."""

from __future__ import annotations

import random
import time

import pytest

from paged_kv import PagedKVCache
from paged_kv.serving.misses import CacheReports
from paged_kv.tenants import GhostList, Miss, TenantLimits, TenantPolicy, TierLimits

from ..conftest import tiny_config

BLOCK = 16


def _cache(policy: TenantPolicy | None, num_blocks: int = 401) -> PagedKVCache:
    return PagedKVCache(tiny_config(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BLOCK,
                                    num_blocks=num_blocks, num_host_blocks=0, tenants=policy))


def _serve(cache: PagedKVCache, seq_id, prompt: list[int], salt: str, **retain) -> int:
    """Admit `prompt` whole (its full blocks indexed), free it; returns its cached tokens."""
    hit, _ = cache.admit(seq_id, prompt, salt=salt)
    cache.free(seq_id, **retain)
    cache.check()
    return hit


def _b_hit_rate(policy: TenantPolicy | None, *, noisy: bool, rounds: int = 8) -> float:
    """Tenant B repeats a 2K-token system prompt (a fresh question after it); tenant A sends
    ten unique 1K-token prompts after each of B's. B's prefix hit rate over the system
    prompt, its first (cold) round left out."""
    rng = random.Random(0)
    cache = _cache(policy)
    system = [rng.randrange(1, 30000) for _ in range(2048)]
    hits = 0
    for r in range(rounds):
        hit = _serve(cache, ("b", r), system + [rng.randrange(1, 30000) for _ in range(16)], "B")
        hits += min(hit, len(system)) if r else 0
        for i in range(10 if noisy else 0):
            _serve(cache, ("a", r, i), [rng.randrange(1, 30000) for _ in range(1024)], "A")
        if policy is not None:  # sampled through the run: no tenant past its quota
            for usage in cache.allocator.tenants.usage():
                assert usage.quota is None or usage.cached <= usage.quota
    return hits / (len(system) * (rounds - 1))


@pytest.mark.parametrize("policy", [
    TenantPolicy({"A": TenantLimits(), "B": TenantLimits(reservation=130)}),
    TenantPolicy({"A": TenantLimits(quota=150), "B": TenantLimits()}),
], ids=["reservation for B", "quota on A"])
def test_a_noisy_neighbour_does_not_evict_the_quiet_tenants_prefix(policy):
    """Fault: a policy that does not change eviction (B's prefix evicted by A's flood)."""
    solo = _b_hit_rate(None, noisy=False)
    unprotected = _b_hit_rate(None, noisy=True)
    protected = _b_hit_rate(policy, noisy=True)
    assert solo == 1.0
    assert unprotected < 0.1 * solo, "without a policy A's flood must evict B (the baseline)"
    assert protected >= 0.9 * solo, f"B kept {protected:.2f} of its solo hit rate"


def test_a_tenant_over_its_quota_loses_its_own_oldest_blocks_at_once():
    """Fault: a quota enforced only under pressure, or by evicting another tenant."""
    cache = _cache(TenantPolicy({"A": TenantLimits(quota=6), "B": TenantLimits()}), 64)
    rng = random.Random(1)
    b_prompt = [rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)]
    _serve(cache, "b", b_prompt, "B")
    first = [rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)]
    _serve(cache, "a0", first, "A")
    _serve(cache, "a1", [rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)], "A")
    usage = {u.tenant: u for u in cache.allocator.tenants.usage()}
    assert usage["A"].cached == 6 and usage["B"].cached == 4
    assert cache.stats().num_free_blocks == 63 - 10, "A's two extra blocks went to free"
    # A's oldest went: the first prompt's tail (released first), its head survives
    assert cache.plan_admission("x", first, salt="A").num_hit == 2 * BLOCK
    assert cache.plan_admission("y", b_prompt, salt="B").num_hit == 4 * BLOCK


def test_a_reservation_holds_against_another_tenant_but_not_its_own_pressure():
    """Fault: reserved blocks evicted by another tenant's allocation, or never released."""
    cache = _cache(TenantPolicy({"A": TenantLimits(), "B": TenantLimits(reservation=4)}), 17)
    rng = random.Random(2)
    b_prompt = [rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)]
    _serve(cache, "b", b_prompt, "B")
    assert cache.allocator.num_obtainable_blocks == 16 - 4, "reserved blocks not obtainable"
    _serve(cache, "a", [rng.randrange(1, 9999) for _ in range(12 * BLOCK)], "A")
    assert cache.plan_admission("x", b_prompt, salt="B").num_hit == 4 * BLOCK
    with pytest.raises(Exception, match="out of KV blocks"):
        cache.admit("a2", [rng.randrange(1, 9999) for _ in range(13 * BLOCK)], salt="A")
    cache.check()
    _serve(cache, "b2", [rng.randrange(1, 9999) for _ in range(16 * BLOCK)], "B")
    assert cache.plan_admission("y", b_prompt, salt="B").num_hit == 0, \
        "B's own pressure may evict B's reserved blocks"


def test_soft_retention_outlives_pressure_until_it_ends_within_the_budget():
    """Fault: retained blocks evicted before ordinary ones, kept past their retention, or
    more retained than the budget."""
    policy = TenantPolicy({"A": TenantLimits(retention_budget=3), "C": TenantLimits()})
    cache = _cache(policy, 17)
    rng = random.Random(3)
    high = [rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)]
    low = [rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)]
    _serve(cache, "high", high, "A", priority=90, retention_seconds=0.5)
    _serve(cache, "low", low, "A", priority=0)
    assert len(cache.allocator.tenants.retained_blocks(1)) == 3, "the budget caps retention"
    # C needs 12 blocks: 8 free, then A's 4 ordinary "low" blocks and 1 unretained "high"
    _serve(cache, "c", [rng.randrange(1, 9999) for _ in range(12 * BLOCK + 1)], "C")
    assert cache.plan_admission("x", high, salt="A").num_hit == 3 * BLOCK
    assert cache.plan_admission("y", low, salt="A").num_hit == 0
    time.sleep(0.6)  # the retention ends: the blocks are ordinary, and the oldest
    _serve(cache, "c2", [rng.randrange(1, 9999) for _ in range(4 * BLOCK)], "C")
    assert cache.plan_admission("z", high, salt="A").num_hit < 3 * BLOCK


def test_an_admin_flush_and_unretain_touch_one_tenant_only():
    """Fault: a flush that drops another tenant's blocks or a tenant's live blocks."""
    cache = _cache(TenantPolicy({"A": TenantLimits(), "B": TenantLimits()}), 64)
    rng = random.Random(4)
    a, b = ([rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)] for _ in range(2))
    _serve(cache, "a", a, "A", priority=50, retention_seconds=60)
    _serve(cache, "b", b, "B")
    cache.admit("live", [rng.randrange(1, 9999) for _ in range(2 * BLOCK)], salt="A")
    assert cache.reset_prefix_cache("A", retention_only=True) == 4
    assert cache.allocator.tenants.retained_blocks(1) == []
    assert cache.reset_prefix_cache("A") == 4
    cache.check()
    assert cache.plan_admission("x", a, salt="A").num_hit == 0
    assert cache.plan_admission("y", b, salt="B").num_hit == 4 * BLOCK
    assert cache.stats().num_live_blocks == 2
    miss = CacheReports(BLOCK, cache.allocator.ghost).explain(
        cache.plan_admission("z", a, salt="A"), 0)
    assert miss == Miss("evicted", 0, "device", "flush")


def _explain(cache: PagedKVCache, prompt: list[int], salt: str) -> Miss | None:
    plan = cache.plan_admission(("why", len(prompt)), prompt, salt=salt)
    return CacheReports(BLOCK, cache.allocator.ghost).explain(plan, plan.num_hit)


def test_each_miss_reason_is_named_exactly():
    """Fault: a miss reported with the wrong cause, block, tier or culprit."""
    policy = TenantPolicy({"A": TenantLimits(quota=2), "B": TenantLimits()})
    cache = _cache(policy, 13)  # 12 usable
    rng = random.Random(5)
    cold = [rng.randrange(1, 9999) for _ in range(4 * BLOCK + 1)]
    assert _explain(cache, cold, "A") == Miss("cold", 0)
    _serve(cache, "a", cold, "A")  # 4 blocks cached, quota 2: the tail's two evicted
    assert _explain(cache, cold, "A") == Miss("evicted", 2, "device", "own_quota")
    diverged = cold[: BLOCK + 3] + [v + 1 for v in cold[BLOCK + 3: 2 * BLOCK]] + cold[2 * BLOCK:]
    assert _explain(cache, diverged, "A") == Miss("diverged", 1)
    b_prompt = [rng.randrange(1, 9999) for _ in range(3 * BLOCK + 1)]
    _serve(cache, "b", b_prompt, "B")
    _serve(cache, "a2", [rng.randrange(1, 9999) for _ in range(12 * BLOCK)], "A")
    assert _explain(cache, b_prompt, "B") == Miss("evicted", 0, "device", "tenant", "A")
    assert _explain(cache, cold, "A") == Miss("evicted", 0, "device", "own")
    again = [rng.randrange(1, 9999) for _ in range(BLOCK + 1)]
    _serve(cache, "again", again, "A")
    assert _explain(cache, again, "A") is None, "its one full block hits: no miss"


def test_the_ghost_list_stays_within_its_bound():
    """Fault: an unbounded ghost list (memory growing with every eviction)."""
    ghost = GhostList(100)
    for i in range(1000):
        ghost.evicted([i.to_bytes(32, "little")], "device", "global")
        ghost.seen([(i + 5000).to_bytes(32, "little")])
        assert len(ghost) <= 200
    assert len(ghost) >= 100, "each map remembers at least the newest half of its bound"
    assert ghost.entry((999).to_bytes(32, "little")) == ("device", "global", None)
    assert ghost.entry((950).to_bytes(32, "little")) is not None
    assert ghost.entry((0).to_bytes(32, "little")) is None


def test_a_key_evicted_again_is_remembered_as_the_newest():
    """Fault: a key evicted a second time is looked up in its first (older) entry, or is
    forgotten with the generation that held its first eviction."""
    ghost = GhostList(8)
    keys = [i.to_bytes(32, "little") for i in range(8)]
    ghost.evicted(keys[:4], "device", "global")
    ghost.evicted(keys[4:], "device", "global")
    ghost.evicted(keys[:1], "host", "own")  # the generation of its first eviction goes
    assert ghost.entry(keys[0]) == ("host", "own", None)
    assert ghost.entry(keys[1]) is None
    assert ghost.entry(keys[5]) == ("device", "global", None)
    ghost.evicted(keys[1:2], "disk", "flush")
    assert ghost.entry(keys[0]) == ("host", "own", None)
    assert ghost.entry(keys[1]) == ("disk", "flush", None)


@pytest.mark.parametrize("policy, field", [
    (TenantPolicy({"A": TenantLimits(quota=-1)}), "tenants.A.quota"),
    (TenantPolicy({"A": TenantLimits(quota=3, reservation=4)}), "tenants.A.reservation"),
    (TenantPolicy({"A": TenantLimits(quota=30), "B": TenantLimits(quota=30)}), "quota"),
    (TenantPolicy({"A": TenantLimits(reservation=40)}), "reservation"),
    (TenantPolicy({"A": TenantLimits(priority=100)}), "tenants.A.priority"),
    (TenantPolicy({"A": TenantLimits(retention_seconds=-1)}), "tenants.A.retention_seconds"),
    (TenantPolicy({"A": TenantLimits(tiers={"ssd": TierLimits()})}), "tenants.A.tiers"),
    (TenantPolicy({"A": TenantLimits(tiers={"host": TierLimits(quota=-2)})}),
     "tenants.A.host.quota"),
])
def test_a_bad_policy_is_refused_naming_the_field(policy, field):
    """Fault: a policy the pool cannot honour accepted, or refused without saying why."""
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _cache(policy, 41)


@pytest.mark.parametrize("kwargs, field", [({"priority": 100}, "priority"),
                                           ({"priority": True}, "priority"),
                                           ({"retention_seconds": float("nan")},
                                            "retention_seconds")])
def test_bad_retention_arguments_change_nothing(kwargs, field):
    """Fault: a free() refused after it released the sequence's blocks."""
    cache = _cache(TenantPolicy({"A": TenantLimits()}), 17)
    cache.admit("a", list(range(1, 40)), salt="A")
    before = cache.allocator.snapshot()
    with pytest.raises(ValueError, match=field):
        cache.free("a", **kwargs)
    assert cache.allocator.snapshot() == before and "a" in cache


def test_a_request_larger_than_the_pool_less_the_reservations_is_refused():
    from types import SimpleNamespace

    from paged_kv.serving import SamplingParams
    from paged_kv.serving.limits import check_request

    model = SimpleNamespace(vocab_size=500, max_position=10_000)
    plain = tiny_config(block_size=4, num_blocks=41, num_host_blocks=0)
    held = tiny_config(block_size=4, num_blocks=41, num_host_blocks=0,
                       tenants=TenantPolicy({"B": TenantLimits(reservation=10)}))
    prompt, params = [1] * 100, SamplingParams(max_tokens=60)  # 40 blocks: the whole pool
    check_request(prompt, params, model, 4, plain)
    with pytest.raises(ValueError, match=r"reservations \(10\)"):
        check_request(prompt, params, model, 4, held)
    check_request(prompt, SamplingParams(max_tokens=20), model, 4, held)  # 30 blocks fit
