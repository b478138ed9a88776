"""`CheckpointPolicy` (ranks and a heap in int64 arrays, its loops compiled where numba is
installed) against a plain model: a dict of each ranked slot's (tier, last use), whose
victim is the minimum by (tier, use, slot). Random adds, touches, re-tiers (of ranked and
unranked slots), removals, victims with an excluded slot or a tenant's filter, and
decode-step evictions that lower another checkpoint, from a fresh clock and from one just
below the bits a use has (the ranks are then renumbered in place): the same victims, tiers,
membership and size after every call, and the same order when drained. The compiled loops
and the same loops in Python (``PAGED_KV_NUMBA=0``) leave the same slots, events and ranks
after the same random offers, confirms, hits and departures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

from paged_kv.config import MAX_STATE_SLOTS, CacheConfig, LayerKind, StateSpec
from paged_kv.core.groups import slot_loops
from paged_kv.core.groups.checkpoints import (
    CLOCK,
    DENSE,
    INTERVAL,
    LATEST,
    SHARED,
    USE_LIMIT,
    CheckpointPolicy,
)

SLOTS = 10
TIERS = [DENSE, INTERVAL, LATEST, SHARED]


class Model:
    """The policy's contract, plainly: ``{slot: (tier, use)}``, a use clock."""

    def __init__(self, clock: int) -> None:
        self.ranked: dict[int, tuple[int, int]] = {}
        self.clock = clock

    def add(self, slot: int, tier: int) -> None:
        self.ranked[slot] = (tier, self.clock)
        self.clock += 1

    def retier(self, slot: int, tier: int) -> None:
        if slot in self.ranked:
            self.ranked[slot] = (tier, self.ranked[slot][1])

    def victim(self, exclude: int = -1, allowed=None) -> int | None:
        candidates = [(tier, use, slot) for slot, (tier, use) in self.ranked.items()
                      if slot != exclude and (allowed is None or allowed(slot))]
        return min(candidates)[2] if candidates else None

    def evict_retier(self, tier: int, previous: int, lower: int) -> int | None:
        found = self.victim()
        if found is None or self.ranked[found][0] > tier:
            return None
        del self.ranked[found]
        self.retier(previous, lower)
        return found


_slot = st.integers(0, SLOTS - 1)
_op = st.one_of(
    st.tuples(st.just("add"), _slot, st.sampled_from(TIERS)),
    st.tuples(st.just("add_all"), st.lists(_slot, unique=True, max_size=4), st.sampled_from(TIERS)),
    st.tuples(st.just("touch"), _slot, st.just(0)),
    st.tuples(st.just("retier"), st.integers(-1, SLOTS + 2), st.sampled_from(TIERS)),
    st.tuples(st.just("remove"), _slot, st.just(0)),
    st.tuples(st.just("victim"), st.integers(-1, SLOTS - 1), st.just(0)),
    st.tuples(st.just("allowed"), st.integers(-1, SLOTS - 1), st.integers(0, 3)),
    st.tuples(st.just("evict"), st.sampled_from(TIERS),
              st.tuples(st.integers(-1, SLOTS - 1), st.sampled_from([DENSE, INTERVAL]))),
)


def _apply(policy: CheckpointPolicy, model: Model, op: tuple) -> tuple:
    kind, a, b = op
    if kind == "add":
        if a not in model.ranked:
            policy.add(a, b)
            model.add(a, b)
        return ()
    if kind == "add_all":
        fresh = [slot for slot in a if slot not in model.ranked]
        policy.add_all(fresh, [b] * len(fresh))
        for slot in fresh:
            model.add(slot, b)
        return ()
    if kind == "touch":
        if a in model.ranked:
            policy.touch(a)
            model.add(a, model.ranked[a][0])
        return ()
    if kind == "retier":
        policy.retier_written(a, b)
        model.retier(a, b)
        return ()
    if kind == "remove":
        if a in model.ranked:
            policy.remove(a)
            del model.ranked[a]
        return ()
    if kind == "victim":
        return policy.victim(None if a < 0 else a), model.victim(a)
    if kind == "allowed":  # a tenant's filter: slots of one residue
        allowed = lambda slot: slot % 4 == b  # noqa: E731
        return policy.victim(a, allowed), model.victim(a, allowed)
    previous, lower = b
    return policy.evict_retier(a, previous, lower), model.evict_retier(a, previous, lower)


def _drained(policy: CheckpointPolicy) -> list[int]:
    order = []
    while (slot := policy.evict_below(SHARED)) is not None:
        order.append(slot)
    return order


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(_op, max_size=60), near_limit=st.booleans())
# renumbered after checkpoints of two tiers were added: the uses keep their order across
# the tiers (a later re-tier keeps a use), not the ranks'
@example(ops=[("add_all", [0, 2, 5], INTERVAL), ("add_all", [1, 3, 4], DENSE),
              ("retier", 0, DENSE)], near_limit=True)
def test_policy_matches_the_model(ops, near_limit):
    policy = CheckpointPolicy()
    start = USE_LIMIT - 7 if near_limit else 0  # renumbered a few calls in
    policy.meta[CLOCK] = start
    model = Model(start)
    for op in ops:
        found, expected = (_apply(policy, model, op) or (None, None))
        assert found == expected, op
        assert len(policy) == len(model.ranked)
        assert all((slot in policy) == (slot in model.ranked) for slot in range(-1, SLOTS + 2))
        assert {slot: policy.tier_of(slot) for slot in model.ranked} == \
            {slot: tier for slot, (tier, _) in model.ranked.items()}
        assert policy.meta[CLOCK] < USE_LIMIT
    expected = sorted(model.ranked, key=lambda slot: (*model.ranked[slot], slot))
    assert _drained(policy) == expected


def test_a_long_run_compacts_the_heap_and_keeps_the_order():
    """Re-tiers push an entry each (the old ones go stale): the heap is compacted, grown
    where it must be, and still evicts by rank."""
    policy, model = CheckpointPolicy(), Model(0)
    for slot in range(200):
        policy.add(slot, LATEST)
        model.add(slot, LATEST)
    for step in range(5000):
        slot, tier = (step * 37) % 200, TIERS[step % 4]
        policy.retier_written(slot, tier)
        model.retier(slot, tier)
        if step % 50 == 0:
            policy.touch(slot)
            model.add(slot, tier)
    assert policy.meta[0] <= len(policy.heap)
    assert _drained(policy) == sorted(model.ranked, key=lambda s: (*model.ranked[s], s))


def test_a_policy_refuses_more_slots_than_a_rank_holds():
    with pytest.raises(ValueError, match="at most"):
        CheckpointPolicy().reserve(slot_loops.MAX_SLOTS + 1, 0)
    # and a config asking for more is refused by name, before any cache is built
    assert MAX_STATE_SLOTS == slot_loops.MAX_SLOTS
    kinds = (LayerKind(), LayerKind.recurrent((StateSpec("ssm", (1,), torch.float32),)))
    fields = dict(num_layers=2, num_kv_heads=1, head_dim=1, block_size=16, num_blocks=8,
                  layer_kinds=kinds)
    CacheConfig(**fields, num_state_slots=MAX_STATE_SLOTS)
    with pytest.raises(ValueError, match="num_state_slots: at most"):
        CacheConfig(**fields, num_state_slots=MAX_STATE_SLOTS + 1)


_SCRIPT = textwrap.dedent("""
    import hashlib, random
    import numpy as np
    from paged_kv.core.groups import slot_loops
    from paged_kv.core.groups.state import StateSlots
    rng, slots, rows = random.Random(7), StateSlots(40, interval=64), 12
    for row in range(rows):
        slots.take_live(row)
    positions = [0] * rows
    for step in range(300):
        slots.confirm(list(slots._live))
        live = sorted(slots._live)
        taking = rng.sample(live, min(len(live), rng.randint(0, 6)))
        offers = {}  # key -> (end, row): distinct keys, some indexed before
        for row in taking:
            positions[row] += 16
            key = hashlib.sha256(bytes([row, positions[row] % 7])).digest()
            offers.setdefault(key, (positions[row], row))
        keys = list(offers)
        ends = np.array([end for end, _ in offers.values()], dtype=np.int64)
        taking = np.array([row for _, row in offers.values()], dtype=np.int64)
        slots.offer_arrays(keys, ends, taking,
                           np.array([rng.random() < 0.1 for _ in keys], dtype=bool))
        if rng.random() < 0.2 and keys:
            found = slots.find(keys[0])
            if found is not None:
                slots.served(found)
        if rng.random() < 0.1 and live:
            row = rng.choice(live)
            slots.confirm([row])
            slots.release_live(row)
            positions[row] = 0
        for row in range(rows):
            if row not in slots._live and slots.obtainable() and rng.random() < 0.5:
                slots.take_live(row)
        slots.check(list(slots._live))
    state = repr((slots.snapshot(), tuple(slots.events), sorted(slots.policy.ranks().items())))
    print(slot_loops.COMPILED, hashlib.sha256(state.encode()).hexdigest())
""")


@pytest.mark.skipif(not slot_loops.COMPILED, reason="numba is not installed")
def test_compiled_and_python_loops_agree():
    results = []
    for switch in ("1", "0"):
        env = dict(os.environ, PAGED_KV_NUMBA=switch, PYTHONHASHSEED="0")
        done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                              text=True, timeout=300, check=True)
        results.append(done.stdout.split())
    assert [compiled for compiled, _ in results] == ["True", "False"]
    assert results[0][1] == results[1][1]
