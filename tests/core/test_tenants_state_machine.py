"""Property test of the tenant ledger in a real cache: random admissions, growth, frees
with and without retention, flushes and unretains by three tenants. After every step the
cache's invariants (the ledger against the allocator, every tenant within its quota) and
the reservation rule: an allocation never takes another tenant below its reservation (none
of the blocks of one at or below it, and no more than its excess of one above it).

A fault that loops for ever (a victim run of no block) fails the test after
`TIME_LIMIT_S` rather than hanging it: hypothesis catches a timeout plugin's failure and
shrinks by running the hanging example again, so the limit raises an exception it does not
catch (`Hung`, a BaseException)."""

from __future__ import annotations

import random
import signal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv import OutOfBlocksError, PagedKVCache
from paged_kv.tenants import TenantLimits, TenantPolicy

from ..conftest import tiny_config

TENANTS = ("A", "B", "C")
POLICY = TenantPolicy({"A": TenantLimits(quota=10),
                       "B": TenantLimits(quota=5, reservation=5, retention_budget=4),
                       "C": TenantLimits(quota=8, reservation=3)})
BLOCK = 4
TIME_LIMIT_S = 60  # the run takes 4-12 s here; a loaded 2-core machine, several times that


class Hung(BaseException):
    """The state machine ran past `TIME_LIMIT_S` (not an Exception: hypothesis would catch
    it, shrink, and hang again on the same example)."""


@pytest.fixture(autouse=True)
def _time_limit():
    if not hasattr(signal, "SIGALRM"):  # no timer signal (Windows): unbounded, as before
        yield
        return

    def fire(signum, frame):
        raise Hung(f"the tenant state machine ran past {TIME_LIMIT_S} s: a loop that "
                   "never ends (a victim run of no block?)")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _cached_by_tenant(cache: PagedKVCache) -> dict[int, set[int]]:
    ledger = cache.allocator.tenants
    return {t: set(ledger.cached_blocks(t)) for t in range(len(ledger.names))}


class TenantMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(tiny_config(block_size=BLOCK, num_blocks=25,
                                              num_host_blocks=0, tenants=POLICY))
        self.live: dict[int, str] = {}
        self.next_id = 0
        self.rng = random.Random(0)
        # a few shared prompt heads per tenant, so prefixes hit and revive cached blocks
        self.heads = {t: [[self.rng.randrange(1, 500) for _ in range(2 * BLOCK)]
                          for _ in range(2)] for t in TENANTS}

    def _guarded(self, tenant: str | None, action) -> None:
        """Run `action`; it may not take a tenant other than `tenant` below its reservation:
        no block of one at or below it, at most the excess of one above it."""
        ledger, allocator = self.cache.allocator.tenants, self.cache.allocator
        before = _cached_by_tenant(self.cache)
        keys = {b: allocator.block_hash(b) for held in before.values() for b in held}
        usage = ledger.usage()
        asking = ledger.names.index(tenant) if tenant in ledger.names else None
        try:
            action()
        except OutOfBlocksError:
            return
        after = _cached_by_tenant(self.cache)
        for t, held in before.items():
            if t != asking:
                lost = held - after[t]
                # a block leaves the cached set by eviction or by being revived by a hit; a
                # revived block is live and still indexed under its key, an evicted one is
                # unindexed (and maybe live again, reused for the allocation itself)
                revived = {b for b in lost if allocator.refcount[b] > 0
                           and allocator.block_hash(b) == keys[b]}
                excess = max(usage[t].cached - usage[t].reservation, 0)
                assert len(lost - revived) <= excess, \
                    f"tenant {t}'s reserved blocks were evicted: {lost - revived}"

    @rule(tenant=st.sampled_from(TENANTS), head=st.integers(0, 1), extra=st.integers(1, 30))
    def admit(self, tenant, head, extra):
        prompt = self.heads[tenant][head] + [self.rng.randrange(1, 500) for _ in range(extra)]
        seq_id = self.next_id
        self.next_id += 1

        def go():
            self.cache.admit(seq_id, prompt, salt=tenant)
            self.live[seq_id] = tenant
        self._guarded(tenant, go)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 6))
    def grow(self, data, count):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        tokens = [self.rng.randrange(1, 500) for _ in range(count)]
        self._guarded(None, lambda: self.cache.prepare({seq_id: tokens}))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), priority=st.sampled_from([None, 0, 40, 90]),
          seconds=st.sampled_from([None, 0.0, 30.0]))
    def free(self, data, priority, seconds):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[seq_id]
        self.cache.free(seq_id, priority=priority, retention_seconds=seconds)

    @rule(tenant=st.sampled_from(TENANTS), retention_only=st.booleans())
    def flush(self, tenant, retention_only):
        ledger = self.cache.allocator.tenants
        t = ledger.names.index(tenant)
        before = {u.tenant: u.cached for u in ledger.usage()}
        self.cache.reset_prefix_cache(tenant, retention_only=retention_only)
        after = {u.tenant: u.cached for u in ledger.usage()}
        assert all(after[n] == before[n] for n in after if n != tenant), "flush leaked"
        if retention_only:
            assert ledger.retained_blocks(t) == []
        else:
            assert after[tenant] == 0

    @invariant()
    def consistent(self):
        self.cache.check()
        ledger = self.cache.allocator.tenants
        for usage in ledger.usage():
            assert usage.quota is None or usage.cached <= usage.quota
            assert usage.retained <= (4 if usage.tenant == "B" else 6)


TestTenantMachine = TenantMachine.TestCase
TestTenantMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
