"""`CheckpointPolicy.evict_retier` (a decode step's offer: evict, then lower the row's
newest checkpoint, in one call) against `evict_below` then `retier_written`: the same
victim, ranks and heap (entry for entry, stale ones included), on random policies with
stale entries, re-tiered, touched and removed checkpoints, and a `previous` that is none,
the victim itself, a written checkpoint or a slot the policy does not hold."""

from __future__ import annotations

import copy

import hypothesis.strategies as st
from hypothesis import given, settings

from paged_kv.core.groups.checkpoints import DENSE, INTERVAL, LATEST, SHARED, CheckpointPolicy

SLOTS = 8
TIERS = [DENSE, INTERVAL, LATEST, SHARED]

_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, SLOTS - 1), st.sampled_from(TIERS)),
    st.tuples(st.just("retier"), st.integers(0, SLOTS - 1), st.sampled_from(TIERS)),
    st.tuples(st.just("touch"), st.integers(0, SLOTS - 1), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, SLOTS - 1), st.just(0)),
    st.tuples(st.just("evict"), st.sampled_from(TIERS), st.integers(-2, SLOTS - 1),
              st.sampled_from([DENSE, INTERVAL])),
)


def _apply(policy: CheckpointPolicy, op: tuple, combined: bool) -> object:
    kind, slot, tier, *rest = op
    if kind == "add":
        if slot not in policy:
            policy.add(slot, tier)
    elif kind == "retier":
        policy.retier_written(slot, tier)
    elif kind in ("touch", "remove"):
        if slot in policy:
            getattr(policy, kind)(slot)
    else:  # evict below `slot` (a tier here); `tier` is the previous slot, -2: the victim
        below, previous, lower = slot, tier, rest[0]
        if previous == -2:  # the row's newest is the victim itself
            previous = policy.victim() if len(policy) else -1
            previous = -1 if previous is None else previous
        if combined:
            return policy.evict_retier(below, previous, lower)
        victim = policy.evict_below(below)
        if victim is not None and previous >= 0 and previous != victim:
            policy.retier_written(previous, lower)
        return victim
    return None


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=40))
def test_evict_retier_matches_evict_below_then_retier(ops):
    pair = [CheckpointPolicy() for _ in range(2)]
    for op in ops:
        results = [_apply(policy, op, combined) for combined, policy in enumerate(pair)]
        assert results[0] == results[1]
        assert pair[0].entries() == pair[1].entries() and pair[0].ranks() == pair[1].ranks()
    # and they evict alike from here on
    orders = []
    for policy in pair:
        policy, order = copy.deepcopy(policy), []
        while (slot := policy.evict_below(SHARED)) is not None:
            order.append(slot)
        orders.append(order)
    assert orders[0] == orders[1]
