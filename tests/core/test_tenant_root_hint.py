"""The salted root a freed sequence's blocks chain from (`BlockAllocator.free(root=...)`,
which the layer groups pass): a tenant policy takes its tenant for all of them instead of
reading each block's tag, and counts exactly what reading the tags counts."""

from __future__ import annotations

import numpy as np

from paged_kv.core.allocator import BlockAllocator
from paged_kv.keys import root_hash
from paged_kv.tenants import TenantLimits, TenantPolicy, eviction_for

POLICY = TenantPolicy({"A": TenantLimits(quota=5), "B": TenantLimits(reservation=2)})


def _allocator() -> BlockAllocator:
    return BlockAllocator(16, eviction=eviction_for(POLICY, 16))


def _serve(allocator: BlockAllocator, parent: bytes, seed: int, root: bytes | None) -> None:
    """Allocate and index 3 blocks chaining from `parent`, then free them (as one sequence
    under salted root `root`, or without saying)."""
    blocks = allocator.allocate(3).tolist()
    tokens = np.arange(seed, seed + 12, dtype=np.int32).tobytes()
    allocator.register_chain(blocks, parent, tokens)
    allocator.free(blocks, unique=True, root=root)
    allocator.check_invariants()


def _cached(allocator: BlockAllocator) -> list[int]:
    return [usage.cached for usage in allocator.tenants.usage()]


def test_the_root_counts_what_the_tags_count():
    """Fault: the root's tenant differs from the tags' (quota evictions, usage)."""
    hinted, read = _allocator(), _allocator()
    for i, name in enumerate(["A", "B", "A", "A", "B"]):
        for allocator, root in ((hinted, root_hash(name)), (read, None)):
            _serve(allocator, root_hash(name), 100 * i, root)
    assert _cached(hinted) == _cached(read) == [0, 5, 6]
    assert hinted.snapshot() == read.snapshot()


def test_a_parent_found_nowhere_makes_the_tags_read_again():
    """Fault: a block tagged unnamed (its parent forgotten) counted as its root's tenant."""
    hinted, read = _allocator(), _allocator()
    for allocator, root in ((hinted, root_hash("A")), (read, None)):
        _serve(allocator, b"\x07" * 32, 0, root)  # neither a root nor indexed nor remembered
    assert _cached(hinted) == _cached(read) == [3, 0, 0]
    assert hinted.snapshot() == read.snapshot()


def test_a_freed_sequence_names_its_salted_root(monkeypatch):
    """Fault: the layer group reads its row's root after removing the row (None: the hint
    is lost and every tag read again)."""
    from paged_kv import PagedKVCache

    from ..conftest import tiny_config

    cache = PagedKVCache(tiny_config(num_layers=1, num_kv_heads=1, head_dim=2, block_size=16,
                                     num_blocks=64, num_host_blocks=0, tenants=POLICY))
    roots = []
    free = cache.allocator.free

    def spy(block_ids, **kwargs):
        roots.append(kwargs.get("root"))
        return free(block_ids, **kwargs)

    monkeypatch.setattr(cache.allocator, "free", spy)
    cache.admit("s", list(range(1, 50)), salt="A")
    cache.free("s")
    cache.check()
    assert roots == [root_hash("A")]
    assert _cached(cache.allocator) == [0, 3, 0]
