"""The tenants' limits checked against what they share, and what a tenant sees of the
others: quotas and reservations against the real pool (never a stand-in size), each tier's
reservations against the tier's size, and the name of another tenant left out of a
tenant's own usage (issue 38). Each test names the fault it catches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paged_kv import PagedKVCache
from paged_kv.engine import SamplingParams
from paged_kv.engine.misses import miss_seen_by
from paged_kv.server.http.generation import Generation
from paged_kv.server.tenants_file import parse_tenants_toml
from paged_kv.tenants import TenantLimits, TenantPolicy, TierLimits
from paged_kv.tiers.disk import DiskStore
from paged_kv.tiers.memory import HostStore
from paged_kv.tiers.shares import open_shares

from ..conftest import tiny_config

HUGE = 5 * 10**18  # past 2**62, the stand-in pool the tenants file was checked against


def _cache(policy: TenantPolicy, num_blocks: int) -> PagedKVCache:
    return PagedKVCache(tiny_config(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4,
                                    num_blocks=num_blocks, num_host_blocks=0, tenants=policy))


# -- the pool ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("quota", HUGE, rf"the quotas sum to {HUGE} blocks, past the pool's 127 \(128 blocks"),
    ("reservation", HUGE, r"past half the pool \(63 of its 127: 128 blocks less the null"),
    ("quota", 128, r"the quotas sum to 128 blocks, past the pool's 127 "),
])
def test_a_limit_past_the_pool_is_reported_against_the_real_pool(field, value, message):
    """Fault: the tenants file checks sums against a made-up pool of 2**62 blocks, so a
    huge quota is refused at parse time as past "the pool's 4611686018427387903" rather
    than against the pool the engine sized (issue 38, item 5)."""
    parsed = parse_tenants_toml(f'[tenants.a]\nkeys = ["k"]\n{field} = {value}\n')
    assert parsed.policy.tenants["a"] == TenantLimits(**{field: value})
    with pytest.raises(ValueError, match=message) as info:
        _cache(parsed.policy, 128)
    assert str(2**62 - 1) not in str(info.value)


def test_a_value_out_of_range_is_still_refused_as_the_file_is_read():
    """Fault: with the sums left to the engine, the per-field checks went with them."""
    with pytest.raises(ValueError, match=r"tenants\.a\.reservation: 5 is above its quota 3"):
        parse_tenants_toml('[tenants.a]\nkeys = ["k"]\nquota = 3\nreservation = 5\n')


# -- the tiers --------------------------------------------------------------------------------
VALUE = 1000  # bytes of one stored block: a tier of 40 blocks holds 40_000


def _open(tmp_path, policy: TenantPolicy, tiers: tuple[str, ...] = ("host", "disk")) -> dict:
    """Open `policy`'s shares of a 40-block host tier and a 40-block disk tier, as the tier
    manager does at start-up, for a pool of 64 blocks."""
    stores = {"host": lambda: HostStore(cap_bytes=40 * VALUE),
              "disk": lambda: DiskStore(str(tmp_path), cap_bytes=40 * VALUE)}
    return open_shares([stores[t]() for t in tiers], VALUE, [None, *policy.tenants], policy,
                       num_blocks=64)


@pytest.mark.parametrize("tiers, message", [
    ({"a": {"host": TierLimits(reservation=100_000_000)}},
     r"tenants\.a\.tiers\.host\.reservation: 100000000 blocks take the host tier's "
     r"reservations to 100000000, past half of its 40 blocks \(20\)"),
    ({"a": {"host": TierLimits(reservation=15)}, "b": {"host": TierLimits(reservation=15)}},
     r"tenants\.b\.tiers\.host\.reservation: 15 blocks take .* to 30, past half of its 40"),
    ({"a": {"disk": TierLimits(reservation=21)}},
     r"tenants\.a\.tiers\.disk\.reservation: 21 .* past half of its 40 blocks"),
], ids=["one tenant pins the tier", "two sum past half", "disk"])
def test_a_tier_reservation_past_half_the_tier_is_refused_naming_the_field(tmp_path, tiers,
                                                                           message):
    """Fault: a tier's own reservations never checked against the tier's size, so one
    tenant may pin a whole host tier (``[tenants.a.tiers.host] reservation = 100000000``)."""
    policy = TenantPolicy({name: TenantLimits(tiers=limits) for name, limits in tiers.items()})
    with pytest.raises(ValueError, match=message):
        _open(tmp_path, policy)


def test_tier_reservations_within_half_the_tier_are_accepted(tmp_path):
    """Fault: the tier check counts a reservation twice, refuses the scaled ones, or checks
    a tier whose size is not known (Redis)."""
    # the pool's reservations (10 of 63 usable) scale to 6 of a 40-block tier; 6 + 14 = 20
    policy = TenantPolicy({"a": TenantLimits(reservation=10),
                           "b": TenantLimits(tiers={"host": TierLimits(reservation=14)})})
    shares = _open(tmp_path, policy)
    assert shares["host"].tenant_blocks() == {"": 0, "a": 0, "b": 0}
    assert policy.tier_limits("a", "host", 40, 64).reservation == 6
    unknown = TenantPolicy({"a": TenantLimits(tiers={"remote": TierLimits(reservation=10**9)})})
    redis = SimpleNamespace(name="remote")  # no cap_bytes: a capacity not known here
    assert open_shares([redis], VALUE, [None, "a"], unknown, 64)["remote"].capacity is None


# -- what a tenant sees of the others ---------------------------------------------------------
MISS = {"reason": "evicted", "block": 1, "tier": "device", "pressure": "tenant", "by": "beta"}


def _usage_miss(salt: str | None, miss: dict | None) -> dict | None:
    generation = Generation(None, None, [1, 2, 3], SamplingParams(max_tokens=1), [], salt)
    generation.output = SimpleNamespace(prefix_hit_tokens=0, cached_by_source={}, miss=miss)
    return generation.usage()["prompt_tokens_details"]["miss"]


def test_a_tenant_is_not_told_which_other_tenant_evicted_its_block():
    """Fault: a tenant's usage names another tenant (``miss.by``), telling it who else uses
    the server; an admin's (or a keyless server's) request must still see the name."""
    seen = _usage_miss("acme", MISS)
    assert "by" not in seen and "beta" not in str(seen)
    assert seen == {k: v for k, v in MISS.items() if k != "by"}
    assert _usage_miss(None, MISS) == MISS
    assert _usage_miss("acme", None) is None
    own = {"reason": "evicted", "block": 0, "tier": "host", "pressure": "own"}
    assert miss_seen_by(own, "acme") == own
