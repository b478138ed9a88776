"""A cached prefix through truncation and rollback (issue 28: faults planted in the core that
no test caught; each is named in its test's docstring). A truncated row's kept last block
may still be indexed, so it must be copied before it is written again, in every step shape;
its chain goes on from the last kept full block; and a failed step's planned blocks leave
the index from the first block it wrote into, partly filled ones included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

try:
    import numba
except ImportError:  # the compiled page-table path is then not there to test
    numba = None

from paged_kv import PagedKVCache
from paged_kv.core.step.prefix import match_prefix
from paged_kv.keys import block_keys, root_hash

from ..conftest import tiny_config

BLOCK = 4


def _cache(compiled: bool | None = None) -> PagedKVCache:
    return PagedKVCache(tiny_config(block_size=BLOCK, num_blocks=24), compiled=compiled)


def _kv(cache: PagedKVCache, tokens: list[int]) -> torch.Tensor:
    """K of each token: its id and position, so an overwritten slot shows."""
    config = cache.config
    base = torch.tensor(tokens, dtype=config.dtype)[:, None, None]
    return base.expand(len(tokens), config.num_kv_heads, config.head_dim).clone()


def _step(cache: PagedKVCache, new: dict[str, list[int]]) -> None:
    """Prepare `new` and write every layer's K/V (V = -K) for it, in the mapping's order."""
    batch = cache.prepare(new)
    key = torch.cat([_kv(cache, tokens) for tokens in new.values()])
    for layer in range(cache.config.num_layers):
        cache.write(layer, key, -key, batch)


def _cached_k(cache: PagedKVCache, prompt: list[int]) -> torch.Tensor:
    """K of `prompt`'s cached full blocks, read through a new sequence that hits them."""
    hit = cache.add_sequence("reader", prompt)
    k, _ = cache.gather(0, ["reader"])
    cache.free("reader")
    return k[0, :hit, 0, 0]


@pytest.mark.parametrize("compiled", [False, True] if numba is not None else [False])
@pytest.mark.parametrize("rows", [2, 1])
@pytest.mark.parametrize("count", [1, 2])
def test_a_truncated_rows_indexed_block_is_copied_before_it_is_written(count, rows, compiled):
    """Fault: a multi-row step's copy-on-write plan keeps an indexed block for in-place
    writes when the row is its only owner (a truncated row then overwrites the cached
    prefix). Next to it: the one-row plan and the decode plan (`count` 1, numpy and
    compiled), which must send such a step to the copying plan."""
    cache = _cache(compiled)
    prompt = list(range(10, 18))  # two full blocks, both indexed
    cache.add_sequence("a")
    cache.add_sequence("b")
    _step(cache, {"a": prompt, "b": [1, 2, 3]})
    cache.truncate("a", 6)  # its last kept block is the indexed [14..17], partly used now
    before = cache.tables.blocks("a").copy()
    new = {"a": [90 + i for i in range(count)], "b": [4] * count}
    _step(cache, dict(list(new.items())[:rows]))
    assert cache.tables.blocks("a")[1] != before[1], "the indexed block was written in place"
    assert _cached_k(cache, [*prompt, 0]).tolist() == prompt, "the cached prefix changed"
    assert cache.gather(0, ["a"])[0][0, :6 + count, 0, 0].tolist() == \
        prompt[:6] + [90 + i for i in range(count)]
    cache.check()


def test_a_shared_indexed_block_is_copied_when_all_its_owners_write():
    """The same hole next to it: both owners of an indexed block write in one step; the
    first may keep a shared block only when it is not indexed."""
    cache = _cache()
    prompt = list(range(10, 18))
    cache.add_sequence("a")
    _step(cache, {"a": prompt})
    cache.truncate("a", 6)
    cache.fork("a", "c")
    _step(cache, {"a": [91], "c": [92]})
    assert _cached_k(cache, [*prompt, 0]).tolist() == prompt
    assert cache.gather(0, ["a", "c"])[0][:, 6, 0, 0].tolist() == [91, 92]
    cache.check()


@pytest.mark.parametrize("keep", [0, 2, 4, 6, 8, 10])
def test_a_truncated_sequence_chains_on_from_its_last_kept_full_block(keep):
    """Fault: truncating to exactly one full block restarts the chain at the root, so the
    next block filled is keyed as a prompt's first block (a false prefix hit later)."""
    cache = _cache()
    tokens = list(range(10, 22))  # three full blocks
    cache.add_sequence("a")
    _step(cache, {"a": tokens})
    cache.truncate("a", keep)
    fill = [70 + i for i in range(BLOCK - keep % BLOCK)]  # completes the next block
    _step(cache, {"a": fill})
    now = tokens[:keep] + fill
    assert match_prefix(cache.allocator, [*now, 0], BLOCK) == len(now), "its own prefix"
    if keep >= BLOCK:  # the new block must not pass for a prompt's first block
        assert match_prefix(cache.allocator, [*now[-BLOCK:], 0], BLOCK) == 0
    cache.check()


@pytest.mark.parametrize("written", [4, 5, 6, 7])
def test_a_rolled_back_step_unindexes_the_partly_written_block_it_completed(written):
    """Fault: rolling back a failed step keeps the block it completed indexed when the
    step started inside it (its first slots written before, the rest never); the engine's
    step-failure tests only failed steps starting at a block boundary."""
    cache = _cache()
    tokens = list(range(10, 22))
    cache.add_sequence("a")
    _step(cache, {"a": tokens[:written]})
    cache.prepare({"a": tokens[written:]})  # planned and indexed, then the model fails
    assert match_prefix(cache.allocator, [*tokens, 0], BLOCK) == 12
    cache.truncate("a", written, unwritten=True)
    assert match_prefix(cache.allocator, [*tokens, 0], BLOCK) == written // BLOCK * BLOCK
    cache.free("a")
    assert cache.stats().num_cached_blocks == written // BLOCK
    assert np.all(_cached_k(cache, [*tokens, 0]).numpy() == tokens[:written // BLOCK * BLOCK])
    cache.check()


@pytest.mark.parametrize("compiled", [False, True] if numba is not None else [False])
def test_a_rewritten_row_leaves_the_keys_it_was_admitted_with(compiled):
    """Fault: a row's later blocks are indexed under the keys it was admitted with whenever
    their tokens match the prompt's, without checking the chain they continue. Truncated
    and rewritten from its second block, the row then fills its third with the prompt's
    tokens again, after other ones: under the prompt's third key it would give a later
    prompt a hit on K/V computed after the wrong second block."""
    cache = _cache(compiled)
    prompt = list(range(10, 23))  # blocks A B C, and one token
    keys = block_keys(np.array(prompt), BLOCK, root_hash(None))
    cache.add_sequence("a", prompt, keys=keys)  # the request's keys: the row keeps them
    _step(cache, {"a": prompt[:8]})  # a prefill chunk: A and B indexed
    cache.truncate("a", BLOCK)
    _step(cache, {"a": [90, 91, 92, 93]})  # B's place: other tokens
    _step(cache, {"a": prompt[8:12]})  # C's tokens, after them
    assert match_prefix(cache.allocator, prompt, BLOCK) == 8, "C's key: a wrong chain"
    assert _cached_k(cache, prompt).tolist() == prompt[:8]
    rewritten = [*prompt[:4], 90, 91, 92, 93, *prompt[8:12], 0]
    assert match_prefix(cache.allocator, rewritten, BLOCK) == 12, "its own chain"
    cache.check()
