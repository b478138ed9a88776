"""The state bench's counterfactual policy (`RecencyPolicy`): least recently used first
whatever a checkpoint's tier, beside the cache's own policy on the same calls."""

from __future__ import annotations

import pytest

from paged_kv.bench.workloads.state_cache import RecencyPolicy
from paged_kv.core.groups.checkpoints import DENSE, LATEST, SHARED, CheckpointPolicy


@pytest.mark.parametrize("kind", [RecencyPolicy, CheckpointPolicy])
def test_recency_ignores_tiers(kind):
    policy = kind()
    policy.add_all([0, 1, 2], [SHARED, DENSE, LATEST])
    # the cache's policy takes the lowest tier first; the counterfactual, the oldest
    assert policy.victim() == (0 if kind is RecencyPolicy else 1)
    policy.retier(1, SHARED)  # 1 now ranks with 0 in the cache's policy (and is newer)
    policy.touch(0)  # 0 is now the most recently used
    assert policy.victim() == (1 if kind is RecencyPolicy else 2)
    policy.add(3, DENSE)
    assert policy.victim() == (1 if kind is RecencyPolicy else 3)
    tiers = {slot: policy.tier_of(slot) for slot in range(4)}
    if kind is RecencyPolicy:
        assert set(tiers.values()) == {DENSE}
    else:
        assert tiers == {0: SHARED, 1: SHARED, 2: LATEST, 3: DENSE}


def test_recency_admits_any_tier():
    recency, ranked = RecencyPolicy(), CheckpointPolicy()
    for policy in (recency, ranked):
        policy.add_all([0], [SHARED])
    assert recency.admits(DENSE, 0)
    assert not ranked.admits(DENSE, 0)
