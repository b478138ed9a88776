"""BlockAllocator against a simple model: owners per block, and the three states; the
machine runs under the plain LRU and under the tenant ledger (quotas and reservations that
bind, blocks of three tenants), whose evictions the model takes as they come."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv import BlockAllocator, OutOfBlocksError
from paged_kv.keys import hash_block, root_hash
from paged_kv.tenants import TenantLimits, TenantPolicy, eviction_for

NUM_BLOCKS = 12
TENANTS = TenantPolicy({"a": TenantLimits(quota=3, reservation=1),
                        "b": TenantLimits(reservation=2)})


class AllocatorMachine(RuleBasedStateMachine):
    """Owners hold lists of blocks; the model counts owners per block."""

    policy: TenantPolicy | None = None  # the plain LRU
    roots = (root_hash(),)  # the salts blocks are indexed and allocated under

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(NUM_BLOCKS,
                                        eviction=eviction_for(self.policy, NUM_BLOCKS))
        self.owners: dict[int, list[int]] = {}
        self.indexed: dict[int, bytes] = {}   # block -> key, for blocks we registered
        self.next_owner = 0

    def _model_refcount(self) -> np.ndarray:
        counts = np.zeros(NUM_BLOCKS, dtype=np.int64)
        for blocks in self.owners.values():
            np.add.at(counts, blocks, 1)
        return counts

    @rule(n=st.integers(1, 5), data=st.data())
    def allocate(self, n, data):
        root = data.draw(st.sampled_from([None, *self.roots]))
        obtainable = self.allocator.obtainable(root)
        if n > obtainable:
            before = self.allocator.snapshot()
            with pytest.raises(OutOfBlocksError):
                self.allocator.allocate(n, root)
            assert self.allocator.snapshot() == before
            return
        ids = self.allocator.allocate(n, root).tolist()
        assert len(set(ids)) == n and 0 not in ids
        assert all(self._model_refcount()[b] == 0 for b in ids), "handed out an owned block"
        for b in ids:
            if b in self.indexed:  # evicted: the index no longer knows it
                assert self.allocator.block_hash(b) is None
                del self.indexed[b]
        self.owners[self.next_owner] = ids
        self.next_owner += 1

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share(self, data):
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        self.allocator.share(self.owners[owner])
        self.owners[self.next_owner] = list(self.owners[owner])
        self.next_owner += 1

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def register(self, data):
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        block = data.draw(st.sampled_from(self.owners[owner]))
        tokens = np.array([block, 7], dtype="<i4").tobytes()
        root = self.roots[block % len(self.roots)]  # one key a block, as before
        key = hash_block(root, tokens)
        if self.allocator.register(block, key, tokens, root):
            self.indexed[block] = key
            assert self.allocator.lookup(key, tokens) == block
            assert self.allocator.lookup(key, tokens + b"x") is None, "token check on hit"

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data):
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        self.allocator.free(self.owners.pop(owner))
        for block in [b for b in self.indexed if self.allocator.block_hash(b) is None]:
            del self.indexed[block]  # evicted at once: its tenant past its quota

    @precondition(lambda self: self.indexed)
    @rule(data=st.data())
    def hit(self, data):
        block = data.draw(st.sampled_from(sorted(self.indexed)))
        self.allocator.share([block])
        self.owners[self.next_owner] = [block]
        self.next_owner += 1

    @precondition(lambda self: self.indexed)
    @rule(data=st.data())
    def unregister(self, data):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.indexed)), min_size=1))
        free_before = self.allocator.num_free_blocks
        unowned = {b for b in blocks if self._model_refcount()[b] == 0}
        assert self.allocator.unregister(blocks) == len(set(blocks))
        for block in set(blocks):
            assert self.allocator.block_hash(block) is None
            del self.indexed[block]
        assert self.allocator.num_free_blocks == free_before + len(unowned), \
            "a cached block taken out of the index is free"

    @rule()
    def reset(self):
        cached = self.allocator.num_cached_blocks
        assert self.allocator.reset_prefix_cache() == cached
        self.indexed.clear()

    @invariant()
    def matches_model(self):
        self.allocator.check_invariants(self._model_refcount())
        live = int((self._model_refcount() > 0).sum())
        assert self.allocator.num_live_blocks == live
        for block in self.indexed:
            assert self.allocator.block_hash(block) == self.indexed[block]


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=40,
                                         deadline=None)


class TenantAllocatorMachine(AllocatorMachine):
    """The same machine under a tenant policy whose quota and reservations bind."""

    policy = TENANTS
    roots = (root_hash(), root_hash("a"), root_hash("b"))


TestTenantAllocatorMachine = TenantAllocatorMachine.TestCase
TestTenantAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=40,
                                               deadline=None)


def test_batch_allocate_is_one_call_and_lowest_ids_first():
    allocator = BlockAllocator(10)
    assert allocator.allocate(4).tolist() == [1, 2, 3, 4]
    events = allocator.take_events()
    assert [e.kind for e in events] == ["allocated"] and events[0].block_ids == (1, 2, 3, 4)
    assert allocator.take_events() == []


def test_unhashed_blocks_are_reused_before_cached_ones_and_lru_order():
    allocator = BlockAllocator(6)  # 5 usable
    ids = allocator.allocate(5).tolist()
    for b in ids[:3]:
        allocator.register(b, bytes([b]) * 32, bytes([b]))
    allocator.free(ids[:3])   # tail first: 3, 2, 1 become cached in that order
    allocator.free(ids[3:])   # 4, 5 plain free
    assert sorted(allocator.allocate(2).tolist()) == [4, 5], "free blocks before cached"
    assert allocator.allocate(2).tolist() == [3, 2], "cached evicted tail first"
    assert allocator.num_cached_blocks == 1 and allocator.block_hash(3) is None


def test_hash_is_stable_across_processes():
    # a fixed digest: Python's hash() would change per process, sha256 does not
    key = hash_block(root_hash(), np.arange(4, dtype="<i4").tobytes())
    assert key.hex()[:16] == hash_block(root_hash(), bytes(
        np.arange(4, dtype="<i4").tobytes())).hex()[:16]
    assert root_hash("tenant-a") != root_hash("tenant-b") != root_hash()
    assert len(key) == 32


def test_events_are_bounded():
    allocator = BlockAllocator(4, max_events=3)
    for _ in range(5):
        allocator.free(allocator.allocate(1))
    assert len(allocator.take_events()) == 3


def test_index_changes_are_events():
    allocator = BlockAllocator(6)
    ids = allocator.allocate(2).tolist()
    for b in ids:
        allocator.register(b, bytes([b]) * 32, bytes([b]))
    allocator.free(ids)
    assert allocator.unregister([ids[0], ids[0], 5]) == 1, "repeats and unindexed skipped"
    allocator.reset_prefix_cache()
    kinds = [(e.kind, e.block_ids) for e in allocator.take_events()
             if e.kind in ("stored", "removed", "cleared")]
    assert kinds == [("stored", (ids[0],)), ("stored", (ids[1],)), ("removed", (ids[0],)),
                     ("cleared", ())]
    allocator.check_invariants()


def test_index_events_carry_keys_parents_and_tokens_as_they_were():
    """A subscriber in another process rebuilds the index from the events alone, so they
    hold the keys when they happen: a block id is reused, its key is not."""
    allocator = BlockAllocator(4)  # 3 usable blocks
    root = root_hash("tenant")
    tokens = np.arange(8, dtype="<i4").tobytes()  # two blocks of 4 tokens
    ids = allocator.allocate(2).tolist()
    keys = allocator.register_chain(ids, root, tokens)
    assert keys == [hash_block(root, tokens[:16]), hash_block(keys[0], tokens[16:])]
    allocator.free(ids)
    allocator.allocate(3)  # two evictions: both keys leave the index
    events = {e.kind: e for e in allocator.take_events()}
    stored, evicted = events["stored"], events["evicted"]
    assert stored.block_ids == tuple(ids) and stored.keys == tuple(keys)
    assert stored.parents == (root, keys[0]) and stored.token_ids == tokens
    assert sorted(evicted.keys) == sorted(keys) and allocator.block_hash(ids[0]) is None
    allocator.check_invariants()


def test_removed_and_batch_stored_events_carry_their_keys():
    allocator = BlockAllocator(6)
    ids = allocator.allocate(2).tolist()
    parents = [b"p" * 32, b"q" * 32]
    tokens = np.arange(4, dtype="<i4").tobytes()
    keys = allocator.register_blocks(ids, parents, tokens)
    allocator.unregister([ids[1]])
    stored, removed = [e for e in allocator.take_events() if e.kind in ("stored", "removed")]
    assert stored.parents == tuple(parents) and stored.keys == tuple(keys)
    assert removed.block_ids == (ids[1],) and removed.keys == (keys[1],)
