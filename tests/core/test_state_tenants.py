"""Tenants' shares of the state slab's checkpoints (`CheckpointShares`): a tenant's quota
and reservation are the same fraction of the checkpoints as of the pool; a tenant at its
quota replaces its own checkpoints, another's checkpoints within its reservation are never
evicted for a new checkpoint, and a tenant never starts from another's checkpoint.
`cache.check()` (the shares counted against the checkpoints) after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_kv import CacheConfig, PagedKVCache
from paged_kv.config import LayerKind, StateSpec
from paged_kv.tenants import TenantLimits, TenantPolicy

BS = 4
KINDS = (LayerKind.recurrent((StateSpec("ssm", (2, 3), torch.float32),)), LayerKind())
NUM_BLOCKS, SLOTS = 65, 32  # limits scale by 32 / 64: half the pool's


def _cache(policy: TenantPolicy) -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BS,
                                    num_blocks=NUM_BLOCKS, dtype=torch.float32,
                                    layer_kinds=KINDS, num_state_slots=SLOTS,
                                    tenants=policy))


def _serve(cache: PagedKVCache, seq_id: str, prompt: list[int], salt: str | None) -> int:
    """Admit, write the states the batch asks for, free; returns the hit."""
    hit = cache.add_sequence(seq_id, prompt, salt=salt)
    batch = cache.prepare({seq_id: prompt[hit:]})
    states = batch.groups[-1]
    spec = KINDS[0].states[0]
    cache.write_states(0, batch, (torch.rand(states.batch_size, *spec.shape),),
                       (torch.rand(states.num_emitted, *spec.shape),))
    cache.free(seq_id)
    cache.check()
    return hit


def _held(cache: PagedKVCache) -> dict[str | None, int]:
    shares = cache.state_group.slots.shares
    return dict(zip(shares.names, shares.held, strict=True))


def _prompt(seed: int, blocks: int = 4) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, blocks * BS + 1).tolist()


def test_a_tenant_at_its_quota_replaces_its_own_checkpoints():
    cache = _cache(TenantPolicy({"a": TenantLimits(quota=8), "b": TenantLimits()}))
    shares = cache.state_group.slots.shares
    assert shares.quota[shares.names.index("a")] == 4  # 8 blocks of 64: 4 of 32 slots
    for i in range(6):
        _serve(cache, f"a{i}", _prompt(i), "a")
        assert _held(cache)["a"] <= 4
    assert _held(cache)["a"] == 4
    assert cache.stats().num_checkpoints == 4  # free slots stayed free: the quota binds
    for i in range(3):
        _serve(cache, f"b{i}", _prompt(100 + i), "b")
    assert _held(cache)["b"] == 12


def test_a_reservation_keeps_a_tenants_checkpoints_from_anothers_pressure():
    cache = _cache(TenantPolicy({"a": TenantLimits(reservation=8), "b": TenantLimits()}))
    for i in range(2):
        _serve(cache, f"a{i}", _prompt(i), "a")  # 8 checkpoints: a's reservation is 4
    for i in range(12):  # b fills the slab and keeps evicting
        _serve(cache, f"b{i}", _prompt(100 + i), "b")
    assert _held(cache)["a"] == 4
    assert _held(cache)["b"] >= SLOTS - 4 - 1  # the rest (one was the last live state's)
    # a's newest prompt still starts from its checkpoint
    assert _serve(cache, "again", _prompt(1), "a") > 0


@pytest.mark.parametrize("salts", [("a", "b"), ("a", None)])
def test_a_tenant_never_starts_from_anothers_checkpoint(salts):
    cache = _cache(TenantPolicy({"a": TenantLimits(), "b": TenantLimits()}))
    first, other = salts
    assert _serve(cache, "x", _prompt(7), first) == 0
    assert _serve(cache, "y", _prompt(7), other) == 0
    assert _serve(cache, "z", _prompt(7), first) == 4 * BS
