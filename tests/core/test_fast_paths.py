"""The fast paths equal the general ones: the array decode step (`rows_of` + `prepare_decode`)
equals `prepare({seq: [token]})`, `admit` equals `add_sequence` + `prepare`.

Caches run the same random program, through the mapping API and through the array API
(with the numpy page-table path and, where numba is installed, the compiled one); after
every step their batches and their whole state (tables, allocator, index, pool) must be
identical.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from paged_kv import OutOfBlocksError, PagedKVCache
from paged_kv.core.allocator import BlockAllocator
from paged_kv.core.cache import snapshot
from paged_kv.core.decode_rows import numba
from paged_kv.core.step.parse import parse_step, tokens_to_array
from paged_kv.keys import hash_block, hash_chain, root_hash

from ..conftest import assert_same_snapshot, tiny_config


def _same_batch(a, b) -> None:
    assert a.seq_ids == b.seq_ids
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                 "kv_indptr", "kv_indices", "kv_last_page_len"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.num_tokens, a.max_seq_len, a.max_query_len) == \
        (b.num_tokens, b.max_seq_len, b.max_query_len)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_decode_arrays_equal_mapping(block_size, caching, seed):
    rng = np.random.default_rng(seed)
    apis = ["mapping", "arrays"] + (["arrays"] if numba is not None else [])
    caches = [PagedKVCache(tiny_config(block_size=block_size, num_blocks=64,
                                       enable_prefix_caching=caching), compiled=i == 2)
              for i in range(len(apis))]
    live: list[str] = []
    for step in range(60):
        action = rng.random()
        if action < 0.15 or not live:  # admit, often behind a shared prefix
            seq_id = f"s{step}"
            prompt = [1, 2, 3, 4, 5, 6, 7][: rng.integers(1, 8)] + \
                rng.integers(0, 9, rng.integers(0, 12)).tolist()
            for cache in caches:
                hit = cache.add_sequence(seq_id, prompt)
                try:
                    cache.prepare({seq_id: prompt[hit:]})
                except OutOfBlocksError:
                    cache.free(seq_id)
                    continue
            if seq_id in caches[0]:
                live.append(seq_id)
        elif action < 0.25:  # fork: the next decode must copy a shared last block
            parent = live[rng.integers(len(live))]
            for cache in caches:
                cache.fork(parent, f"{parent}.{step}")
            live.append(f"{parent}.{step}")
        elif action < 0.32 and len(live) > 1:
            seq_id = live.pop(rng.integers(len(live)))
            for cache in caches:
                cache.free(seq_id)
        else:
            chosen = [live[i] for i in rng.permutation(len(live))[: rng.integers(1, 9)]]
            tokens = rng.integers(0, 9, len(chosen))
            unknown = rng.random() < 0.2  # ids unknown: a count of 1 / token_ids=None
            results = []
            for api, cache in zip(apis, caches, strict=True):
                before = snapshot(cache)
                try:
                    if api == "mapping":
                        results.append(cache.prepare(
                            {s: 1 if unknown else [int(t)]
                             for s, t in zip(chosen, tokens, strict=True)}))
                    else:
                        results.append(cache.prepare_decode(cache.rows_of(chosen),
                                                            None if unknown else tokens))
                except OutOfBlocksError:
                    assert_same_snapshot(before, snapshot(cache), f"{api} out of blocks")
                    results.append(None)
            assert len({result is None for result in results}) == 1
            if results[0] is not None:
                for other in results[1:]:
                    _same_batch(results[0], other)
                for layer in range(2):  # same K/V in both pools
                    k = torch.randn(len(chosen), 2, 4)
                    for cache, batch in zip(caches, results, strict=True):
                        cache.write(layer, k, -k, batch)
        for cache in caches:
            cache.check()
        for other in caches[1:]:
            assert_same_snapshot(snapshot(caches[0]), snapshot(other), f"step {step}")


def test_rows_of_handle_is_reused_until_the_set_changes():
    cache = PagedKVCache(tiny_config())
    for seq_id in ("a", "b"):
        cache.add_sequence(seq_id, [1, 2, 3])
        cache.prepare({seq_id: [1, 2, 3]})
    rows = cache.rows_of(["a", "b"])
    assert rows is cache.rows_of(["a", "b"]) and not rows.flags.writeable
    cache.prepare_decode(rows, np.array([4, 5]))
    cache.add_sequence("c")
    assert cache.rows_of(["a", "b"]) is not rows
    cache.free("a")
    with pytest.raises(ValueError, match="not resident"):
        cache.prepare_decode(rows, np.array([6, 7]))  # a stale handle is caught
    assert cache.tables.num_tokens_of("b") == 4


def test_decode_accepts_a_token_tensor_and_plain_lists():
    cache = PagedKVCache(tiny_config())
    cache.add_sequence("a", [1, 2])
    cache.prepare({"a": [1, 2]})
    batch = cache.prepare_decode([cache.tables.row_of["a"]], torch.tensor([9]))
    assert batch.seq_ids == ("a",) and batch.seq_lens.tolist() == [3]
    assert cache.tables.token_ids[cache.tables.row_of["a"], :3].tolist() == [1, 2, 9]


@pytest.mark.parametrize("new_tokens", [[5, 6], 2, [5]])
def test_single_sequence_step_copies_a_shared_last_block(new_tokens):
    """fork, then the parent alone grows by a chunk, by a count, or by one token: the
    child's half-filled block must keep the child's K/V."""
    cache = PagedKVCache(tiny_config(block_size=4))
    cache.add_sequence("p", [1, 2, 3, 4, 5, 6])
    batch = cache.prepare({"p": [1, 2, 3, 4, 5, 6]})
    k = torch.randn(6, 2, 4)
    for layer in range(2):
        cache.write(layer, k, -k, batch)
    cache.fork("p", "c")
    batch = cache.prepare({"p": new_tokens})
    for layer in range(2):
        cache.write(layer, torch.full((batch.num_tokens, 2, 4), 9.0),
                    torch.full((batch.num_tokens, 2, 4), 9.0), batch)
    batch = cache.prepare({"c": [7]})
    for layer in range(2):
        cache.write(layer, torch.ones(1, 2, 4), -torch.ones(1, 2, 4), batch)
    keys, _ = cache.gather(0, ["p", "c"])
    assert torch.equal(keys[1, :6], k) and torch.equal(keys[1, 6], torch.ones(2, 4))
    assert torch.equal(keys[0, :6], k) and (keys[0, 6:cache.tables.num_tokens_of("p")] == 9).all()
    cache.check()


def test_single_sequence_step_copies_an_indexed_block_after_truncate():
    cache = PagedKVCache(tiny_config(block_size=4))
    cache.add_sequence("a", list(range(8)))
    batch = cache.prepare({"a": [*range(9)]})
    k = torch.randn(9, 2, 4)
    for layer in range(2):
        cache.write(layer, k, -k, batch)
    cache.truncate("a", 6)  # block 1 (tokens 4-7) stays indexed but is now partial
    batch = cache.prepare({"a": [50, 51]})
    for layer in range(2):
        cache.write(layer, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), batch)
    cache.add_sequence("b", [*range(8), 9])  # hits both indexed blocks
    keys, _ = cache.gather(0, ["b"])
    assert torch.equal(keys[0, :8], k[:8]), "the cached prefix block was overwritten"


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("max_tokens", [None, 1, 5])
def test_admit_equals_add_sequence_then_prepare(caching, max_tokens):
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50, 11).tolist()
    caches = [PagedKVCache(tiny_config(num_blocks=64, enable_prefix_caching=caching))
              for _ in range(2)]
    for i in range(12):
        prompt = (system if i % 2 else []) + rng.integers(0, 50, rng.integers(1, 14)).tolist()
        hit = caches[0].add_sequence(i, prompt, salt="t")
        count = len(prompt) - hit if max_tokens is None else min(max_tokens, len(prompt) - hit)
        expected = caches[0].prepare({i: prompt[hit: hit + count]})
        got_hit, got = caches[1].admit(i, prompt, max_tokens=max_tokens, salt="t")
        assert got_hit == hit
        _same_batch(expected, got)
        k = torch.randn(got.num_tokens, 2, 4)
        for cache, batch in zip(caches, (expected, got), strict=True):
            for layer in range(2):
                cache.write(layer, k, -k, batch)
        if i % 3 == 2:
            for cache in caches:
                cache.free(i - 1)
        caches[1].check()
        assert_same_snapshot(snapshot(caches[0]), snapshot(caches[1]), f"request {i}")


@pytest.mark.parametrize("admit", [True, False])
def test_an_admission_takes_its_cached_hits_before_it_allocates(admit):
    """With no free block left, the blocks an admission allocates come from evicting cached
    ones: its own prefix hits must be taken first, or the least recently freed (here a
    hit) is evicted and handed out twice."""
    cache = PagedKVCache(tiny_config(num_blocks=9, block_size=4))  # 8 usable blocks
    a, c = list(range(8)), list(range(50, 58))
    for seq_id, prompt in (("a", a), ("c", c)):
        cache.admit(seq_id, prompt)  # 2 full blocks, indexed
    a_blocks = cache.tables.blocks("a").tolist()
    cache.free("a")  # cached first: evicted first
    cache.free("c")
    cache.add_sequence("x")
    cache.prepare({"x": 16})  # the 4 free blocks: only cached ones are left
    if admit:
        hit, _ = cache.admit("b", [*a, 9])
    else:
        hit = cache.add_sequence("b", [*a, 9])
        cache.prepare({"b": [9]})
    cache.check()
    blocks = cache.tables.blocks("b").tolist()
    assert hit == 8 and blocks[:2] == a_blocks and blocks[2] not in a_blocks
    assert cache.stats().num_cached_blocks == 1, "one of c's blocks was evicted"


def test_admit_out_of_blocks_adds_nothing():
    cache = PagedKVCache(tiny_config(num_blocks=6, block_size=4))
    cache.admit("a", list(range(12)))  # 3 blocks, indexed
    cache.free("a")                    # ... now cached: evictable
    cache.admit("b", [9, 9, 9, 9, 9])  # 2 blocks; 3 cached + 0 free left
    before = snapshot(cache)
    # hits 2 cached blocks (they stop being evictable), then needs 3 more: only 1 is left
    with pytest.raises(OutOfBlocksError) as info:
        cache.admit("c", list(range(8)) + [7] * 9)
    assert info.value.requested == 3 and info.value.free == 1
    assert "c" not in cache
    assert_same_snapshot(before, snapshot(cache), "admit() out of blocks")
    cache.check()


@pytest.mark.parametrize(("call", "error", "pattern"), [
    (lambda c: c.admit("a", [1]), ValueError, "already exists"),
    (lambda c: c.admit("n", []), ValueError, "empty prompt"),
    (lambda c: c.admit("n", [1.5]), TypeError, "ints"),
    (lambda c: c.admit("n", [1], max_tokens=0), ValueError, "max_tokens"),
    (lambda c: c.admit("n", [1], salt=3), TypeError, "salt"),
])
def test_admit_rejects_bad_input_unchanged(call, error, pattern):
    cache = PagedKVCache(tiny_config())
    cache.admit("a", [1, 2, 3])
    before = snapshot(cache)
    with pytest.raises(error, match=pattern):
        call(cache)
    assert_same_snapshot(before, snapshot(cache), "rejected admit()")


_TOKEN = st.one_of(st.integers(-2, 40), st.integers(2**31 - 2, 2**31 + 1), st.booleans(),
                   st.floats(-1, 3), st.integers(2**63, 2**64), st.just(np.int64(7)))


def _outcome(function, *args):
    try:
        array = function(*args)
    except (TypeError, ValueError) as exc:
        return type(exc)
    return array.dtype, array.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(_TOKEN, max_size=6))
def test_token_list_fast_path_equals_numpy(values):
    """A list takes the `array` fast path; a tuple of the same values numpy's: same
    array, or the same kind of error."""
    assert _outcome(tokens_to_array, "t", values) == _outcome(tokens_to_array, "t",
                                                              tuple(values))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_TOKEN, min_size=1, max_size=4), min_size=1, max_size=3))
def test_step_tokens_fast_path_equals_numpy(values):
    """`prepare`'s parse of lists (fast path) against the same tokens as tuples."""
    cache = PagedKVCache(tiny_config())
    for i in range(len(values)):
        cache.add_sequence(i)

    def parse(rows):
        step = parse_step(dict(enumerate(rows)), cache.tables)
        return step.token_ids if step.has_ids.all() else np.array(["counts"])

    assert _outcome(parse, values) == _outcome(parse, [tuple(v) for v in values])


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=8 * 12).map(lambda b: b[: len(b) // 8 * 8]),
       st.sampled_from([None, "tenant"]))
def test_hash_chain_equals_hash_block_one_by_one(token_ids, salt):
    num_blocks = len(token_ids) // 8
    keys, key = [], root_hash(salt)
    for i in range(num_blocks):
        key = hash_block(key, token_ids[8 * i: 8 * i + 8])
        keys.append(key)
    assert hash_chain(root_hash(salt), token_ids, num_blocks) == (
        keys, [token_ids[8 * i: 8 * i + 8] for i in range(num_blocks)])


def test_match_hashes_only_to_the_first_miss_and_uses_the_keys_given():
    allocator = BlockAllocator(8)
    data = np.arange(12, dtype="<i4").tobytes()  # 3 blocks of 4 tokens
    keys, pieces = hash_chain(root_hash(), data, 3)
    ids = allocator.allocate(2).tolist()
    allocator.register_chain(ids, root_hash(), data[:32])
    assert allocator.match(data, 3, [], root_hash()) == (ids, keys)
    assert allocator.match(data[:32], 2, [], root_hash()) == (ids, keys[:2])
    assert allocator.match(data, 3, keys[:1], b"unused") == (ids, keys), "hashed from keys[0]"
    assert allocator.match(data[:16], 1, keys, b"unused") == (ids[:1], keys), "keys kept"
    other = data[:16] + bytes(16)
    assert allocator.match(other, 2, [], root_hash()) == (
        ids[:1], [keys[0], hash_block(keys[0], bytes(16))]), "stops at the first miss"
    assert allocator.match(other, 2, keys[:2], root_hash()) == (ids[:1], keys[:2]), \
        "a key found with other tokens is a miss"
    assert pieces[0] == data[:16]
    assert allocator.match(b"", 0, [], root_hash()) == ([], [])


def test_decode_batch_seq_ids_survive_the_callers_array_and_later_frees():
    """A decode batch's ids are looked up when first read: from the rows of that step, even
    after the caller reused its rows array and a row changed owner."""
    cache = PagedKVCache(tiny_config(block_size=4, num_blocks=32))
    for seq_id in ("a", "b", "c"):
        cache.admit(seq_id, [1, 2, 3])
    rows = np.array([cache.tables.row_of["c"], cache.tables.row_of["a"]])
    batch = cache.prepare_decode(rows, np.array([4, 5], dtype=np.int32))
    rows[:] = cache.tables.row_of["b"]  # the caller reuses its array
    cache.free("c")
    cache.admit("d", [9, 9])  # takes c's row
    assert batch.seq_ids == ("c", "a") and batch.batch_size == 2


@pytest.mark.parametrize("seed", range(6))
def test_free_equals_one_owner_at_a_time(seed):
    """`free` (unique or with repeats, shared and indexed blocks) leaves the same state and
    events as dropping each owner in its own call, tail first."""
    rng = np.random.default_rng(seed)

    def build() -> tuple[BlockAllocator, list[int]]:
        allocator = BlockAllocator(24)
        ids = allocator.allocate(12).tolist()
        allocator.register_chain(ids[:4], root_hash(None), np.arange(16, dtype="<i4").tobytes())
        allocator.share(ids[2:7])
        allocator.take_events()
        return allocator, ids

    fast, ids = build()
    slow, _ = build()
    picked = rng.choice(ids, rng.integers(1, 12), replace=False).tolist()
    if seed % 2:
        picked += rng.choice(ids[2:7], 2, replace=False).tolist()  # repeats of shared ones
    fast.free(picked, unique=not seed % 2)
    for block_id in dict.fromkeys(reversed(picked)):  # tail first, each block once
        slow.free([block_id] * picked.count(block_id))
    fast.check_invariants()
    assert fast.snapshot()[:3] == slow.snapshot()[:3]
    released = [b for e in fast.take_events() for b in e.block_ids]
    assert sorted(released) == sorted(b for e in slow.take_events() for b in e.block_ids)


@pytest.mark.parametrize("num_known", [0, 1, 3])
def test_register_chain_with_known_keys_equals_hashing_all(num_known):
    data = np.arange(12, dtype="<i4").tobytes()
    plain, known = BlockAllocator(8), BlockAllocator(8)
    keys = plain.register_chain([1, 2, 3], root_hash("t"), data)
    assert known.register_chain([1, 2, 3], root_hash("t"), data, keys[:num_known]) == keys
    assert plain.snapshot() == known.snapshot()
