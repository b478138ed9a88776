"""`BlockAllocator.register_keyed` (one index update for many blocks) against `register`
called on each block in order: the same index, flags, eviction state and stored blocks,
under the plain LRU and under the tenant ledger, with keys repeated in the batch, keys
indexed before it, and parents inside the batch."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from paged_kv import BlockAllocator
from paged_kv.tenants import TenantLimits, TenantPolicy, eviction_for

NUM_BLOCKS = 24
TENANTS = TenantPolicy({"a": TenantLimits(quota=6, reservation=2)})
KEYS = [bytes([k]) * 32 for k in range(1, 9)]


def _stored(allocator: BlockAllocator) -> list[tuple]:
    """Every stored block as ``(block, key, parent, tokens)``, in order, events flattened."""
    out = []
    for event in allocator.take_events():
        if event.kind == "stored":
            width = len(event.token_ids) // len(event.block_ids)
            out += [(b, k, p, event.token_ids[i * width:(i + 1) * width])
                    for i, (b, k, p) in enumerate(zip(event.block_ids, event.keys,
                                                      event.parents, strict=True))]
    return out


@settings(max_examples=150, deadline=None)
@given(tenants=st.booleans(), before=st.lists(st.sampled_from(KEYS), max_size=3),
       batch=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from([b"", *KEYS]),
                                st.integers(0, 255)), min_size=1, max_size=12),
       freed=st.integers(0, 3))
def test_register_keyed_matches_register_in_order(tenants, before, batch, freed):
    pair = []
    for _ in range(2):
        allocator = BlockAllocator(NUM_BLOCKS, eviction=eviction_for(
            TENANTS if tenants else None, NUM_BLOCKS))
        blocks = allocator.allocate(len(before) + len(batch)).tolist()
        for block, key in zip(blocks, before, strict=False):
            allocator.register(block, key, bytes([block]) * 4)
        allocator.free(blocks[:min(freed, len(before))])  # some indexed ones cached
        allocator.take_events()
        pair.append((allocator, blocks[len(before):]))
    (bulk, ids), (single, same) = pair
    pieces = [bytes([token]) * 4 for _, _, token in batch]
    bulk.register_keyed(ids, [k for k, _, _ in batch], pieces, [p for _, p, _ in batch])
    for block, (key, parent, _), piece in zip(same, batch, pieces, strict=True):
        single.register(block, key, piece, parent)
    assert bulk.snapshot() == single.snapshot()
    assert _stored(bulk) == _stored(single)
    assert (bulk.indexed == single.indexed).all()
    assert (bulk.protected == single.protected).all()
    bulk.check_invariants()
    bulk.free(ids)
    single.free(same)
    assert bulk.snapshot() == single.snapshot()


def test_register_keyed_without_prefix_caching_indexes_nothing():
    allocator = BlockAllocator(8, enable_prefix_caching=False)
    blocks = allocator.allocate(2).tolist()
    allocator.register_keyed(blocks, KEYS[:2], [b"ab", b"cd"], [b"", KEYS[0]])
    assert not allocator.indexed.any()
