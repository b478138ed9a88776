"""The eviction policies the allocator calls (`paged_kv.core.eviction.EvictionPolicy`).

One suite runs against each implementation: the plain LRU, and the tenant ledger riding on
one order or kept in its per-tenant lists, under a policy that binds nothing (so all three
must evict alike). A differential state machine then drives two tenant ledgers, one riding
and switching as it must, one always in its lists, through admissions with prefix hits,
decode growth, frees with retention, flushes and the clock, under quotas, reservations and
retention that bind: every eviction, event, count and miss reason must be the same. Each
test names the fault it catches.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv import BlockAllocator, OutOfBlocksError
from paged_kv.core.eviction import EvictionPolicy, LruEviction
from paged_kv.keys import root_hash
from paged_kv.tenants import TenantEviction, TenantLimits, TenantPolicy

OPEN = TenantPolicy({"a": TenantLimits(), "b": TenantLimits()})  # tenants; nothing binds
POLICIES = {
    "lru": lambda n: LruEviction(n),
    "tenants riding": lambda n: TenantEviction(OPEN, n),
    "tenants split": lambda n: TenantEviction(OPEN, n, ride=False),
}
ROOTS = [root_hash("a"), root_hash("b"), root_hash()]


def _tokens(*values: int) -> bytes:
    return np.array(values, dtype="<i4").tobytes()


def _cached_chain(allocator: BlockAllocator, root: bytes, first: int, length: int,
                  ) -> tuple[list[int], list[bytes]]:
    """A sequence of `length` full one-token blocks under `root` (tokens `first`, ...),
    indexed and freed: its blocks are cached, tail first."""
    ids = allocator.allocate(length, root).tolist()
    keys = allocator.register_chain(ids, root, _tokens(*range(first, first + length)))
    allocator.free(ids)
    return ids, keys


@pytest.fixture(params=sorted(POLICIES))
def make(request):
    return POLICIES[request.param]


def test_every_policy_meets_the_protocol(make):
    """Fault: a policy missing an operation the allocator calls (the tenant ledger lives
    below the core and meets the protocol without inheriting it)."""
    assert isinstance(make(8), EvictionPolicy)


def test_the_least_recently_cached_sequence_goes_first_and_its_tail_before_its_head(make):
    """Fault: a policy that evicts the newest cached blocks, or a sequence's head before
    its tail."""
    allocator = BlockAllocator(9, eviction=make(9))  # 8 usable
    first, _ = _cached_chain(allocator, ROOTS[0], 100, 3)
    second, _ = _cached_chain(allocator, ROOTS[1], 200, 3)
    allocator.allocate(2, None)  # the 2 free blocks
    taken = allocator.allocate(4, None).tolist()
    assert taken == [first[2], first[1], first[0], second[2]]
    allocator.check_invariants()


def test_a_revived_block_is_never_a_victim(make):
    """Fault: a cached block revived by a prefix hit stays in the eviction order, so an
    allocation hands out a block a sequence owns."""
    allocator = BlockAllocator(5, eviction=make(5))  # 4 usable
    ids, _ = _cached_chain(allocator, ROOTS[0], 100, 3)
    allocator.share([ids[0]])  # a hit on the head
    taken = allocator.allocate(3, ROOTS[1]).tolist()
    assert ids[0] not in taken and allocator.refcount[ids[0]] == 1
    allocator.check_invariants()


def test_without_reservations_nothing_is_held(make):
    """Fault: obtainable blocks under-counted by a policy that reserves nothing."""
    allocator = BlockAllocator(9, eviction=make(9))
    _cached_chain(allocator, ROOTS[0], 100, 4)
    assert [allocator.obtainable(root) for root in [None, *ROOTS]] == [8] * 4


def test_an_eviction_names_its_cause_in_the_ghost_list(make):
    """Fault: a policy that evicts without remembering the key (every miss reads cold)."""
    allocator = BlockAllocator(4, eviction=make(4))  # 3 usable
    _, keys = _cached_chain(allocator, ROOTS[0], 100, 3)
    allocator.allocate(1, None)
    assert allocator.ghost.entry(keys[2]) == ("device", "global", None)
    assert allocator.ghost.entry(keys[0]) is None


def test_a_reset_forgets_every_cached_block(make):
    """Fault: cached blocks left in the policy after the prefix cache was reset (counted
    twice, or handed out while free)."""
    allocator = BlockAllocator(9, eviction=make(9))
    _cached_chain(allocator, ROOTS[0], 100, 3)
    _cached_chain(allocator, ROOTS[1], 200, 2)
    assert allocator.reset_prefix_cache() == 5
    assert allocator.num_cached_blocks == 0 and allocator.num_free_blocks == 8
    allocator.check_invariants()
    assert allocator.allocate(8, None).size == 8


def test_a_rejected_allocation_changes_nothing(make):
    """Fault: a policy that gives up victims for an allocation then refused."""
    allocator = BlockAllocator(5, eviction=make(5))
    _cached_chain(allocator, ROOTS[0], 100, 2)
    before = allocator.snapshot()
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(5, ROOTS[1])
    assert allocator.snapshot() == before


@pytest.mark.parametrize("name", ["tenants riding", "tenants split"])
def test_a_policy_that_binds_nothing_evicts_as_the_plain_lru(name):
    """Fault: the tenant ledger changing which blocks go when no quota, reservation or
    retention is set (riding or not)."""
    rng = np.random.default_rng(0)
    allocators = [BlockAllocator(33, eviction=LruEviction(33)),
                  BlockAllocator(33, eviction=POLICIES[name](33))]
    live: list[list[int]] = [[], []]
    for step in range(300):
        size, root = int(rng.integers(1, 6)), ROOTS[int(rng.integers(0, 3))]
        if live[0] and (rng.random() < 0.5 or allocators[0].num_free_blocks < size):
            which = int(rng.integers(0, len(live[0])))
            for allocator, held in zip(allocators, live, strict=True):
                allocator.free(held.pop(which))
            continue
        taken = [allocator.allocate(size, root).tolist() for allocator in allocators]
        assert taken[0] == taken[1], f"step {step}: different victims"
        tokens = _tokens(*rng.integers(0, 4, size))  # few values: keys repeat, blocks hit
        for allocator, held in zip(allocators, live, strict=True):
            allocator.register_chain(taken[0], root, tokens)
            held.append(taken[0])
    assert [e.block_ids for e in allocators[0].take_events()] == \
        [e.block_ids for e in allocators[1].take_events()]
    allocators[1].check_invariants()


# -- riding on one order evicts exactly as the per-tenant lists --------------------------------
BINDING = TenantPolicy({"a": TenantLimits(quota=7, reservation=2),
                        "b": TenantLimits(reservation=3, retention_budget=3),
                        "c": TenantLimits(quota=5)})
TENANTS = ("a", "b", "c", None)
POOL = 33  # 32 usable


class RidingMachine(RuleBasedStateMachine):
    """Two allocators, one riding (and switching often: a margin of no block), one always
    in the ledger's lists; the same calls must give the same everything."""

    def __init__(self) -> None:
        super().__init__()
        self.now = [0.0]
        clock = lambda: self.now[0]  # noqa: E731
        self.riding = BlockAllocator(POOL, eviction=TenantEviction(BINDING, POOL, clock,
                                                                   margin=0))
        self.split = BlockAllocator(POOL, eviction=TenantEviction(BINDING, POOL, clock,
                                                                  ride=False))
        self.live: dict[int, tuple[bytes, list[int], list[bytes]]] = {}  # seq: root, ids, keys
        self.next_seq = 0
        self.rode = self.switched = False

    def _both(self, call):
        """`call(allocator)` on both; the same result or the same refusal."""
        results = []
        for allocator in (self.riding, self.split):
            try:
                results.append(call(allocator))
            except OutOfBlocksError:
                results.append("refused")
        assert repr(results[0]) == repr(results[1]), f"{results[0]!r} != {results[1]!r}"
        return results[0]

    @rule(tenant=st.sampled_from(TENANTS), head=st.integers(0, 1), size=st.integers(1, 5))
    def admit(self, tenant, head, size):
        root = root_hash(tenant)
        data = _tokens(*([head] * 2), *range(self.next_seq * 10, self.next_seq * 10 + size))
        blocks = len(data) // 4

        def go(allocator):
            hits, keys = allocator.match(data, blocks, [], root)
            need = blocks - len(hits)
            if need + allocator.count_cached(hits) > allocator.obtainable(root):
                raise OutOfBlocksError(need, allocator.obtainable(root), "admit")
            allocator.share(hits)  # revived first, as an admission does: then allocated
            ids = allocator.allocate(need, root).tolist()
            parent = keys[len(hits) - 1] if hits else root
            keys = keys[:len(hits)] + allocator.register_chain(
                ids, parent, data[len(hits) * 4:])
            return hits + ids, keys
        taken = self._both(go)
        if taken != "refused":
            self.live[self.next_seq] = (root, *taken)
        self.next_seq += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        root, ids, keys = self.live[seq]
        token = _tokens(len(ids) + 1000 * seq)

        def go(allocator):
            new = allocator.allocate(1, None).tolist()  # a decode step mixes tenants
            return new, allocator.register_blocks(new, [keys[-1]], token)
        taken = self._both(go)
        if taken != "refused":
            self.live[seq] = (root, ids + taken[0], keys + taken[1])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), priority=st.sampled_from([None, 0, 50]),
          seconds=st.sampled_from([None, 0.0, 5.0]))
    def free(self, data, priority, seconds):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        _, ids, _ = self.live.pop(seq)
        self._both(lambda a: a.free(ids, priority=priority, retention_seconds=seconds))

    @rule(tenant=st.sampled_from(TENANTS), retention_only=st.booleans(),
          often=st.integers(0, 3))
    def flush(self, tenant, retention_only, often):
        if often:  # an admin's flush is rare: mostly nothing
            return
        self._both(lambda a: a.flush_tenant(root_hash(tenant), retention_only=retention_only))

    @rule(seconds=st.sampled_from([1.0, 6.0]))
    def tick(self, seconds):
        self.now[0] += seconds

    @invariant()
    def the_same(self):
        riding, split = self.riding.tenants, self.split.tenants
        self.rode |= riding.riding
        self.switched |= not riding.riding
        assert self.riding.take_events() == self.split.take_events()
        assert riding.usage() == split.usage()
        assert riding.snapshot() == split.snapshot()
        assert [self.riding.obtainable(r) for r in [None, *map(root_hash, TENANTS)]] == \
            [self.split.obtainable(r) for r in [None, *map(root_hash, TENANTS)]]
        for _, _, keys in self.live.values():
            assert [riding.ghost.entry(k) for k in keys] == [split.ghost.entry(k) for k in keys]
        self.riding.check_invariants()
        self.split.check_invariants()


TestRidingMachine = RidingMachine.TestCase
TestRidingMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_the_ledger_rides_until_a_quota_binds_far_from_the_front_then_rides_again():
    """Fault: a ledger that never rides (the cost riding saves), rides on through a quota
    whose blocks it cannot find near the front (blocks past the quota kept), or never
    rides again once nothing binds."""
    policy = TenantEviction(TenantPolicy({"a": TenantLimits(quota=4), "b": TenantLimits()}),
                            513, margin=2)
    allocator = BlockAllocator(513, eviction=policy)
    _cached_chain(allocator, ROOTS[0], 100, 3)
    _cached_chain(allocator, ROOTS[0], 200, 3)  # past a's quota: its 2 oldest go at once
    assert policy.riding, "a's oldest blocks are at the front: found without a split"
    assert _usage(policy) == {None: 0, "a": 4, "b": 0}
    allocator.reset_prefix_cache()
    _cached_chain(allocator, ROOTS[1], 300, 150)  # b's blocks first in the order
    _cached_chain(allocator, ROOTS[0], 500, 2)
    _cached_chain(allocator, ROOTS[0], 600, 3)  # a past its quota behind 150 of b's
    assert not policy.riding, "a's oldest are past the scan: split to find them"
    assert _usage(policy) == {None: 0, "a": 4, "b": 150}
    allocator.flush_tenant(ROOTS[0])  # a far from its quota again
    for i in range(20):  # split work as large as the cached blocks, and calm
        _cached_chain(allocator, ROOTS[1], 1000 + 10 * i, 9)
    assert policy.riding, "calm again: back to one order"
    assert _usage(policy) == {None: 0, "a": 0, "b": 330}
    allocator.check_invariants()


def _usage(policy: TenantEviction) -> dict[str | None, int]:
    return {u.tenant: u.cached for u in policy.usage()}



@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "indexed", "evicted", "nowhere"]),
                          st.integers(1, 4)), min_size=1, max_size=6))
def test_a_chain_is_tagged_as_its_blocks_one_by_one(chains):
    """Fault: `tag_chain` (the allocator's call for one sequence's consecutive blocks, which
    skips `tag`'s check that they chain) tags another tenant than `tag` would, or counts
    a parent found nowhere differently, for a chain starting at a root, at an indexed
    block, at an evicted key the ghost list remembers, or at a key found nowhere."""
    policy = TenantPolicy({"a": TenantLimits(), "b": TenantLimits()})
    each, chained = TenantEviction(policy, 64), TenantEviction(policy, 64)
    index: dict[bytes, int] = {}
    for ledger in (each, chained):  # a key of b's evicted: its owner is remembered
        ledger.ghost.evicted_each({b"gone": ("device", "global", None, 2)})
    starts = {"a": root_hash("a"), "b": root_hash("b"), "evicted": b"gone",
              "nowhere": b"\x07" * 32}
    block = 1
    for n, (start, length) in enumerate(chains):
        parent = next(iter(index), root_hash("b")) if start == "indexed" else starts[start]
        keys = [bytes([n, i]) * 16 for i in range(length)]
        ids = np.arange(block, block + length, dtype=np.int64)
        parents = [parent, *keys[:-1]]
        each.tag(ids, keys, parents, index)
        chained.tag_chain(ids, keys, parents, index)
        assert chained.tenants_of(ids.tolist()) == each.tenants_of(ids.tolist())
        assert chained._tags.misses == each._tags.misses
        index.update(zip(keys, ids.tolist(), strict=True))
        block += length
