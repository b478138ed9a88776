"""The router's parts without processes: the index against a plain model, the policy, and
the keys it computes against the ones an engine indexes."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import given, settings

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.router import PrefixIndex, choose, prompt_keys
from paged_kv.router.index import TIER_WEIGHTS

KEYS = [bytes([i]) * 32 for i in range(6)]
REPLICAS = ["a", "b", "c"]
TIERS = ["GPU", "CPU", "DISK"]

stored = st.tuples(st.just("BlockStored"), st.lists(st.sampled_from(KEYS), max_size=4),
                   st.sampled_from(TIERS))
removed = st.tuples(st.just("BlockRemoved"), st.lists(st.sampled_from(KEYS), max_size=4),
                    st.sampled_from([*TIERS, None]))
cleared = st.tuples(st.just("AllBlocksCleared"), st.just([]), st.just(None))
step = st.tuples(st.sampled_from(REPLICAS), st.one_of(stored, removed, cleared,
                                                      st.just(("clear", [], None))))


@settings(max_examples=200, deadline=None)
@given(st.lists(step, max_size=30), st.lists(st.sampled_from(KEYS), max_size=6))
def test_the_index_matches_a_plain_model(steps, query):
    index = PrefixIndex()
    model: dict[str, dict[bytes, set[str]]] = {r: {} for r in REPLICAS}
    for replica, (kind, keys, tier) in steps:
        held = model[replica]
        if kind == "clear":
            index.clear(replica)
            held.clear()
            continue
        if kind == "BlockStored":
            event = ["BlockStored", keys, None, [], 4, None, tier]
            for key in keys:
                held.setdefault(key, set()).add(tier)
        elif kind == "BlockRemoved":
            event = ["BlockRemoved", keys] + ([] if tier is None else [tier])
            for key in keys:
                if tier is None:
                    held.pop(key, None)
                elif key in held:
                    held[key].discard(tier)
                    if not held[key]:
                        del held[key]
        else:
            event = ["AllBlocksCleared"]
            for key in list(held):
                held[key].discard("GPU")
                if not held[key]:
                    del held[key]
        index.apply(replica, [event])
        for r in REPLICAS:
            assert index.blocks_of(r) == set(model[r]), "blocks after every step"
    expected = {}
    for r in REPLICAS:
        score = 0.0
        for key in query:
            if key not in model[r]:
                break
            score += max(TIER_WEIGHTS[t] for t in model[r][key])
        expected[r] = score
    got = index.match(query, REPLICAS)
    assert all(abs(got[r] - expected[r]) < 1e-9 for r in REPLICAS), (got, expected)


def test_guesses_count_until_events_confirm_or_they_expire():
    index = PrefixIndex(guess_ttl=0.0)
    index.guess("a", KEYS[:2])
    assert index.match(KEYS[:2], ["a"])["a"] == 0, "expired at once"
    index = PrefixIndex(guess_ttl=60.0)
    index.guess("a", KEYS[:3])
    assert index.match(KEYS[:3], ["a"])["a"] == 3 * TIER_WEIGHTS["ROUTED"]
    index.apply("a", [["BlockStored", KEYS[:1], None, [], 4, None, "GPU"]])
    assert index.match(KEYS[:3], ["a"])["a"] == 1 + 2 * TIER_WEIGHTS["ROUTED"]
    index.apply("a", [["BlockRemoved", KEYS[1:2], "GPU"]])
    assert index.match(KEYS[:3], ["a"])["a"] == 1, "a removal ends the guess too"


def test_round_robin_and_least_load():
    turn = itertools.count()
    picks = [choose("round_robin", REPLICAS, {}, {}, turn).replica for _ in range(6)]
    assert picks == REPLICAS * 2
    loads = {"a": 3, "b": 1, "c": 2}
    assert choose("least_load", REPLICAS, loads, {}, turn).replica == "b"


def test_cache_weighs_the_cached_prefix_against_the_queue():
    turn = itertools.count()
    scores = {"a": 10.0, "b": 2.0, "c": 0.0}  # blocks of 16 tokens, prompt 200 tokens
    pick = choose("cache", REPLICAS, {"a": 2, "b": 0, "c": 0}, scores, turn, num_tokens=200,
                  load_tokens=32)
    assert pick == ("a", "cache", 10.0), "160 tokens saved beat two requests of 32"
    pick = choose("cache", REPLICAS, {"a": 2, "b": 0, "c": 0}, scores, turn, num_tokens=200,
                  load_tokens=512)
    assert pick.replica == "b", "two queued requests outweigh 128 more cached tokens"
    pick = choose("cache", REPLICAS, {}, {"a": 0.0, "b": 0.0, "c": 0.0}, turn,
                  num_tokens=200, room={"a": 1, "b": 5, "c": 2})
    assert pick == ("b", "no_hit", 0.0), "a miss goes where it evicts least"


def test_the_imbalance_guard_takes_the_least_loaded():
    turn = itertools.count()
    loads = {"a": 20, "b": 2, "c": 5}
    pick = choose("cache", REPLICAS, loads, {"a": 50.0}, turn, num_tokens=800,
                  load_tokens=0, balance_abs=8, balance_rel=1.5)
    assert pick.replica == "b" and pick.reason == "imbalance"


def test_prompt_keys_are_the_keys_an_engine_indexes():
    model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
                                      vocab_size=300, num_heads=4, head_dim=16), seed=0)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=4)))
    prompt = list(range(1, 31))
    for salt in (None, "tenant"):
        engine.cache.reset_prefix_cache()
        engine.add_request(prompt, SamplingParams(max_tokens=1), salt=salt)
        while engine.has_unfinished_requests:
            engine.step()
        allocator = engine.cache.allocator
        indexed = {allocator.block_hash(b) for b in range(allocator.num_blocks)} - {None}
        keys = prompt_keys(prompt, 4, salt)
        assert len(keys) == 7 and set(keys) <= indexed
    assert prompt_keys(prompt, 4, "a")[0] != prompt_keys(prompt, 4, "b")[0]
    assert prompt_keys(prompt[:3], 4, None) == []


def test_the_connection_cap_flag_takes_positive_integers_only():
    import argparse

    import pytest

    from paged_kv.router.cli import positive_int

    assert positive_int("128") == 128
    for bad in ("0", "-4", "many", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"positive integer, got '{bad}'"):
            positive_int(bad)
