"""Tenants sharing the pool (`paged_kv.tenants`): quotas, reservations, soft retention, the
ghost list's miss reasons, and the policy's checks. Each test names the fault it catches;
`cache.check()` (which checks the ledger against the allocator) runs after every step."""

from __future__ import annotations

import random
import time

import pytest

from paged_kv import PagedKVCache
from paged_kv.engine.misses import CacheReports
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


def test_past_256_tenants_each_blocks_tenant_is_kept_whole():
    """Fault: the tags keep a byte per block past 256 tenants (tenant 300 read back as 44),
    so a tenant's blocks are counted as another's and its quota misses them."""
    limits = {f"t{i}": TenantLimits(quota=3 if i in (43, 299) else None) for i in range(300)}
    cache = _cache(TenantPolicy(limits), 64)
    rng = random.Random(2)
    for salt in ("t299", "t43", "t299"):
        _serve(cache, salt + str(rng.random()), [rng.randrange(1, 9999)
                                                 for _ in range(4 * BLOCK + 1)], salt)
    usage = {u.tenant: u.cached for u in cache.allocator.tenants.usage()}
    assert usage["t299"] == 3 and usage["t43"] == 3, "each at its quota, its own blocks"
    assert sum(usage.values()) == 6


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


def test_an_evicted_keys_owner_rides_in_its_entry_and_stays_out_of_the_reason():
    """Fault: the owner a tenant policy stores with an evicted key leaks into the miss
    reason's fields, or a key without one (a pool without tenants, a tier) claims an
    owner."""
    ghost = GhostList(8)
    keys = [i.to_bytes(32, "little") for i in range(3)]
    ghost.evicted_each({keys[0]: ("device", "tenant", "B", 1), keys[1]: ("device", "own",
                                                                        None, 2)})
    ghost.evicted(keys[2:], "host", "global")
    assert ghost.entry(keys[0]) == ("device", "tenant", "B")
    assert ghost.miss(keys[1], b"", 3) == Miss("evicted", 3, "device", "own")
    assert [ghost.owner(key) for key in keys] == [1, 2, None]
    assert ghost.owner(b"\xff" * 32) is None


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

    from paged_kv.engine import SamplingParams
    from paged_kv.engine.limits import check_request

    model = SimpleNamespace(vocab_size=500, max_position=10_000)
    plain = tiny_config(block_size=4, num_blocks=41, num_host_blocks=0)
    held = tiny_config(block_size=4, num_blocks=41, num_host_blocks=0,
                       tenants=TenantPolicy({"B": TenantLimits(reservation=10)}))
    prompt, params = [1] * 100, SamplingParams(max_tokens=60)  # 40 blocks: the whole pool
    check_request(prompt, params, model, 4, plain)
    with pytest.raises(ValueError, match=r"reservations \(10\)"):
        check_request(prompt, params, model, 4, held)
    check_request(prompt, SamplingParams(max_tokens=20), model, 4, held)  # 30 blocks fit


# -- the ledger's reservations, blame and tags --------------------------------------------------
def _usage(cache: PagedKVCache) -> dict[str | None, int]:
    return {u.tenant: u.cached for u in cache.allocator.tenants.usage()}


def test_another_tenants_pressure_stops_at_the_reservation_inside_one_run():
    """Fault: one eviction that takes two of a tenant's blocks in a run takes it below its
    reservation (the run's length not capped at its cached blocks less its reservation)."""
    cache = _cache(TenantPolicy({"A": TenantLimits(), "B": TenantLimits(reservation=2)}), 17)
    rng = random.Random(6)
    b_prompt = [rng.randrange(1, 9999) for _ in range(3 * BLOCK + 1)]
    _serve(cache, "b", b_prompt, "B")  # B: 3 cached blocks, the pool's oldest; 2 reserved
    _serve(cache, "a", [rng.randrange(1, 9999) for _ in range(2 * BLOCK + 1)], "A")
    assert cache.stats().num_free_blocks == 11
    # A needs 13: 11 free, then 2 evictions; B's blocks are oldest, but only 1 may go
    cache.admit("a2", [rng.randrange(1, 9999) for _ in range(13 * BLOCK)], salt="A")
    cache.check()
    assert _usage(cache)["B"] == 2, "B was taken below its reservation"
    assert cache.plan_admission("x", b_prompt, salt="B").num_hit == 2 * BLOCK


def test_a_device_eviction_by_another_tenant_names_the_evicting_tenant():
    """Fault: an eviction that takes only other tenants' blocks names the victim's tenant
    as `by` (or its pressure as ``own``) rather than the tenant whose allocation it was."""
    cache = _cache(TenantPolicy({"A": TenantLimits(), "B": TenantLimits()}), 13)
    rng = random.Random(7)
    b_prompt = [rng.randrange(1, 9999) for _ in range(3 * BLOCK + 1)]
    _serve(cache, "b", b_prompt, "B")
    # A holds nothing cached: its 12 blocks are the 9 free and B's 3, all B's
    _serve(cache, "a", [rng.randrange(1, 9999) for _ in range(12 * BLOCK)], "A")
    assert _usage(cache)["B"] == 0
    assert _explain(cache, b_prompt, "B") == Miss("evicted", 0, "device", "tenant", "A")


@pytest.mark.parametrize("with_other", [False, True],
                         ids=["alone", "in a step with another tenant's block"])
def test_a_block_whose_parent_was_evicted_stays_its_tenants(with_other):
    """Fault: a block chaining from a key whose block was evicted (its sequence holds a
    copy that was not indexed: another sequence indexed that key first) is counted as the
    unnamed tenant's, so it escapes its own tenant's quota."""
    cache = _cache(TenantPolicy({"A": TenantLimits(), "B": TenantLimits()}), 17)
    rng = random.Random(8)
    prompt = [rng.randrange(1, 9999) for _ in range(BLOCK + 1)]
    cache.admit("s", prompt, salt="A")
    cache.admit("t", prompt, salt="A")  # shares block 0; its block 1 is its own
    same = [rng.randrange(1, 9999) for _ in range(BLOCK - 1)]
    cache.prepare({"s": same})  # s's block 1 is indexed under K1
    cache.prepare({"t": same})  # t's block 1 holds the same tokens: K1 is taken
    cache.free("s")  # s's block 1 (K1) is cached
    _serve(cache, "b", [rng.randrange(1, 9999) for _ in range(14 * BLOCK)], "B")
    assert _usage(cache)["A"] == 0, "K1's block was evicted"
    grow = {"t": [rng.randrange(1, 9999) for _ in range(BLOCK)]}  # t's block 2: from K1
    if with_other:
        cache.admit("c", [rng.randrange(1, 9999) for _ in range(BLOCK - 1)], salt="B")
        grow["c"] = [rng.randrange(1, 9999)]
    cache.prepare(grow)
    cache.free("t")
    cache.check()
    assert _usage(cache)[None] == 0, "A's block counted as the unnamed tenant's"
    assert _usage(cache)["A"] == 2  # t's block 0 and block 2 (its block 1 was not indexed)


def test_a_miss_on_a_prompts_first_block_is_cold_not_diverged():
    """Fault: a first block that misses reads ``diverged`` because its parent, the tenant's
    root, is the parent of every block 0 the tenant indexed before."""
    cache = _cache(TenantPolicy({"A": TenantLimits()}), 17)
    rng = random.Random(9)
    _serve(cache, "a", [rng.randrange(1, 9999) for _ in range(2 * BLOCK + 1)], "A")
    other = [rng.randrange(1, 9999) for _ in range(2 * BLOCK + 1)]
    assert _explain(cache, other, "A") == Miss("cold", 0)


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 3])
def test_a_full_hit_on_a_prompt_of_whole_blocks_is_no_miss(num_blocks_in_prompt):
    """Fault: a prompt of an exact number of blocks that hits every block it can (all but
    the one holding its last token, which is always computed) reports a miss."""
    cache = _cache(TenantPolicy({"A": TenantLimits()}), 17)
    rng = random.Random(10)
    prompt = [rng.randrange(1, 9999) for _ in range(num_blocks_in_prompt * BLOCK)]
    _serve(cache, "a", prompt, "A")
    plan = cache.plan_admission("x", prompt, salt="A")
    assert plan.num_hit == (num_blocks_in_prompt - 1) * BLOCK
    assert _explain(cache, prompt, "A") is None


def test_tier_limits_scale_by_the_pools_usable_blocks():
    """Fault: a tier's default limits scaled by a pool size that counts the null block."""
    policy = TenantPolicy({"A": TenantLimits(quota=5, reservation=2)})
    # 10 usable blocks (11 with the null block), a tier of 20: twice the pool
    assert policy.tier_limits("A", "host", 20, 11) == TierLimits(quota=10, reservation=4)
    assert policy.tier_limits("B", "host", 20, 11) == TierLimits(quota=None, reservation=0)


def test_a_swapped_in_sequences_blocks_stay_its_tenants():
    """Swap-in indexes a sequence's blocks again chaining from its salted root when their
    cached copies were evicted meanwhile (it chained from an empty parent before: the
    stored event named no parent, and a tenant policy counted the blocks as nobody's)."""
    from paged_kv.keys import root_hash

    policy = TenantPolicy({"A": TenantLimits(quota=6), "B": TenantLimits()})
    cache = PagedKVCache(tiny_config(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4,
                                     num_blocks=8, num_host_blocks=16, tenants=policy))
    cache.admit("a", list(range(12)), salt="A")
    cache.swap_out("a")
    cache.admit("x", list(range(100, 128)))  # 7 blocks: evicts a's cached copies
    cache.free("x")
    cache.take_events()
    cache.swap_in("a")
    stored = [e for e in cache.take_events() if e.kind == "stored"]
    assert stored and stored[0].parents[0] == root_hash("A")
    cache.free("a")
    usage = {u.tenant: u.cached for u in cache.allocator.tenants.usage()}
    assert usage == {None: 4, "A": 3, "B": 0}
    cache.check()
