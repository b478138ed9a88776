"""An admission is planned once and that plan committed: the scheduler's `plan_admission`
is what `commit_admission` adds (one prefix lookup, no second hashing), planned again only
when the cache changed in between; a request's block keys are made once as it arrives and
the hand-off roles read them (the prompt is hashed once per engine)."""

from __future__ import annotations

import collections
import hashlib
import time

import numpy as np
import pytest

from paged_kv import CacheConfig, OutOfBlocksError, PagedKVCache
from paged_kv.core.cache import snapshot
from paged_kv.core.step import plan as plan_module
from paged_kv.keys import KEY_BYTES, TOKEN_BYTES

BLOCK = 4


def cache(num_blocks: int = 32, **kwargs) -> PagedKVCache:
    return PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
                                    block_size=BLOCK, num_blocks=num_blocks, **kwargs))


@pytest.fixture
def lookups(monkeypatch) -> list[int]:
    """Every prefix lookup the planner runs (`find_prefix`), by prompt length."""
    real, seen = plan_module.find_prefix, []

    def counting(allocator, tokens, *args, **kwargs):
        seen.append(len(tokens))
        return real(allocator, tokens, *args, **kwargs)

    monkeypatch.setattr(plan_module, "find_prefix", counting)
    return seen


def fill(c: PagedKVCache, seq_id: str, prompt: list[int]) -> None:
    c.add_sequence(seq_id, prompt)
    c.prepare({seq_id: prompt})


def test_a_fresh_plan_is_committed_without_a_second_lookup(lookups):
    c = cache()
    prompt = list(range(14))
    fill(c, "a", prompt)
    c.free("a")
    lookups.clear()
    plan = c.plan_admission("b", [*prompt, 99], max_tokens=8)
    assert c.commit_admission(plan) == plan.num_hit == 12
    assert lookups == [15], "one lookup: the plan's; the commit looked up again"
    assert c.tables.blocks("b").tolist() == plan.hits
    c.check()


def test_a_stale_plan_is_planned_again_and_matches_a_fresh_one(lookups):
    """A mutation between plan and commit (the scheduler admitted another, a tier
    loaded blocks) makes the plan stale: the commit plans again, and adds what
    `add_sequence` would add now."""
    c, twin = cache(), cache()
    prompt = list(range(14))
    for each in (c, twin):
        fill(each, "a", prompt)
    plan = c.plan_admission("b", [*prompt, 99])
    assert (plan.num_hit, plan.revived) == (12, 0)  # live blocks of "a": nothing to revive
    for each in (c, twin):
        each.free("a")  # now the hits are cached: reviving them takes obtainable blocks
    lookups.clear()
    hit = c.commit_admission(plan)
    assert lookups == [15], "the stale plan was committed as it was"
    assert hit == twin.add_sequence("b", [*prompt, 99]) == 12
    assert c.tables.blocks("b").tolist() == twin.tables.blocks("b").tolist()
    c.check()


def test_a_plan_whose_hits_were_evicted_since_is_planned_again():
    c = cache(num_blocks=5)  # 4 usable blocks
    prompt = list(range(13))
    fill(c, "a", prompt)
    c.free("a")  # 3 full blocks cached, one free
    plan = c.plan_admission("b", [*prompt, 1], max_tokens=8)
    assert plan.num_hit == 12
    c.add_sequence("x")
    c.prepare({"x": 4 * BLOCK})  # takes every block: the cached ones evicted
    assert c.commit_admission(plan) == 0  # planned again: nothing is cached any more
    assert c.tables.blocks("b").size == 0
    c.check()
    with pytest.raises(TypeError, match="commit_admission"):
        c.commit_admission(("b", None))


def test_commit_admission_refuses_a_known_sequence_and_changes_nothing():
    c = cache()
    plan = c.plan_admission("a", [1, 2, 3])
    c.add_sequence("a")
    before = snapshot(c)
    with pytest.raises(ValueError, match="commit_admission"):
        c.commit_admission(plan)
    after = snapshot(c)
    assert (after[0], after[1], after[4]) == (before[0], before[1], before[4])


def test_an_admission_that_fits_the_plan_but_not_the_pool_raises_out_of_blocks():
    c = cache(num_blocks=3)
    plan = c.plan_admission("a", list(range(9)), max_tokens=9)
    assert plan.requested == 3
    # the commit adds the row only (its step takes the blocks): it always fits
    assert c.commit_admission(plan) == 0
    with pytest.raises(OutOfBlocksError):
        c.prepare({"a": list(range(9))})


# -- the engine: one lookup per admission, the prompt hashed once per engine -------------
@pytest.fixture
def block_hashes(monkeypatch) -> collections.Counter:
    """Every sha256 over one block's input (a parent key and `BLOCK` int32 tokens)."""
    real, counts = hashlib.sha256, collections.Counter()

    def counting(data=b"", *args, **kwargs):
        if len(data) == KEY_BYTES + BLOCK * TOKEN_BYTES:
            counts[bytes(data[KEY_BYTES:])] += 1
        return real(data, *args, **kwargs)

    monkeypatch.setattr(hashlib, "sha256", counting)
    return counts


def _model():
    from paged_kv.engine import TinyLlama, TinyLlamaConfig

    return TinyLlama(TinyLlamaConfig(num_layers=2, hidden_size=64, intermediate_size=64,
                                     vocab_size=100, num_heads=4, head_dim=16), seed=1)


def _run(engine, request_id: int):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == request_id:
                return out
    raise AssertionError("the request did not finish in 60 s")


def test_each_admission_runs_one_prefix_lookup(lookups):
    from paged_kv.engine import Engine, SamplingParams
    from paged_kv.engine.config import EngineConfig

    model = _model()
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64,
                                                                 block_size=BLOCK)))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[(3 * i + j) % 100 for i in range(10 + j)] for j in range(4)]
    for prompt in prompts:
        _run(engine, engine.add_request(prompt, params))
    assert lookups == [len(p) for p in prompts]
    engine.close()


def test_a_hand_off_hashes_the_prompt_once_in_each_engine(block_hashes):
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from paged_kv.engine import Engine, SamplingParams
    from paged_kv.engine.config import EngineConfig
    from paged_kv.handoff import HandoffConfig
    from paged_kv.handoff.params import parse_params

    def engine(role: str) -> Engine:
        model = _model()
        return Engine(model, EngineConfig(
            cache=model.cache_config(num_blocks=64, block_size=BLOCK),
            handoff=HandoffConfig(role, secret="s")))

    pre, dec = engine("prefill"), engine("decode")
    try:
        prompt = [(7 * i + 3) % 100 for i in range(22)]  # 5 full blocks
        rid = pre.add_request(prompt, SamplingParams(max_tokens=1, temperature=0),
                              handoff=parse_params({"do_remote_decode": True}))
        params = _run(pre, rid).kv_transfer_params
        blocks = [np.asarray(prompt[i:i + BLOCK], dtype=np.int32).tobytes()
                  for i in range(0, 20, BLOCK)]
        assert [block_hashes[b] for b in blocks] == [1] * 5, "the prefill engine hashed twice"
        out = _run(dec, dec.add_request(prompt, SamplingParams(max_tokens=4, temperature=0),
                                        handoff=parse_params({
                                            **params, "do_remote_prefill": True})))
        assert out.cached_by_source.get("peer", 0) == 20
        assert [block_hashes[b] for b in blocks] == [2] * 5, \
            "the decode engine hashed a block of the prompt more than once"
    finally:
        pre.close()
        dec.close()
