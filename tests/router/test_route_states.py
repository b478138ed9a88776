"""The index with replicas whose models have recurrent layers: a prefix counts only up to
the deepest block after which the replica holds a state checkpoint (the cache's "never a
hit without its state", router-side), against a plain model of what the events said;
guesses, and the policy's choice between a replica with blocks alone and one with state."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import given, settings

from paged_kv.router import PrefixIndex, choose
from paged_kv.router.index import TIER_WEIGHTS

KEYS = [bytes([i]) * 32 for i in range(6)]
STATE = 2
DECLARED = ["BlockStored", [], None, [], 4, None, "GPU", None, None, STATE, "mamba"]
REPLICAS = ["hybrid", "plain"]
TIERS = ["GPU", "CPU", "DISK"]


def checkpoint(key: bytes) -> bytes:
    return key + bytes([STATE])


def stores(keys: list[bytes], tier: str = "GPU") -> list:
    return ["BlockStored", [checkpoint(k) for k in keys], None, [], 4, None, tier, None,
            None, STATE, "mamba"]


def removes(keys: list[bytes], tier: str | None = "GPU") -> list:
    return ["BlockRemoved", [checkpoint(k) for k in keys], tier, STATE]


keys_ = st.lists(st.sampled_from(KEYS), max_size=4)
step = st.tuples(st.sampled_from(REPLICAS),
                 st.sampled_from(["blocks", "unblocks", "states", "unstates", "cleared",
                                  "clear"]),
                 keys_, st.sampled_from([*TIERS, None]))


def _apply(index: PrefixIndex, model: dict, replica: str, kind: str, keys: list[bytes],
           tier: str | None) -> None:
    """One batch of `replica` (the hybrid one's opens with its declaration), into `index`
    and into `model` (``{replica: (blocks {key: tiers}, checkpoints {key: tiers})}``)."""
    blocks, states = model[replica]
    if kind == "clear":
        index.clear(replica)
        blocks.clear()
        states.clear()
        return
    stored_tier = tier or "GPU"
    if kind == "blocks":
        event = ["BlockStored", keys, None, [], 4, None, stored_tier]
        for key in keys:
            blocks.setdefault(key, set()).add(stored_tier)
    elif kind == "unblocks":
        event = ["BlockRemoved", keys, tier]
        _remove(blocks, keys, tier)
    elif kind == "cleared":  # the pool's blocks; checkpoints stay
        event = ["AllBlocksCleared"]
        _remove(blocks, list(blocks), "GPU")
    elif replica == "plain":
        return  # an attention-only replica has no checkpoints
    elif kind == "states":
        event = stores(keys, stored_tier)
        for key in keys:
            states.setdefault(key, set()).add(stored_tier)
    else:
        event = removes(keys, tier)
        _remove(states, keys, tier)
    index.apply(replica, [DECLARED, event] if replica == "hybrid" else [event])


def _remove(held: dict[bytes, set[str]], keys: list[bytes], tier: str | None) -> None:
    for key in keys:
        if tier is None:
            held.pop(key, None)
        elif key in held:
            held[key].discard(tier)
            if not held[key]:
                del held[key]


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=30), st.lists(st.sampled_from(KEYS), max_size=6))
def test_a_hybrid_replica_matches_its_run_up_to_its_deepest_checkpoint(steps, query):
    index = PrefixIndex()
    model = {r: ({}, {}) for r in REPLICAS}
    for replica, kind, keys, tier in steps:
        _apply(index, model, replica, kind, keys, tier)
        for r in REPLICAS:
            assert index.blocks_of(r) == set(model[r][0])
            assert index.checkpoints_of(r) == {checkpoint(k) for k in model[r][1]}
    expected = dict.fromkeys(REPLICAS, 0.0)
    for r in REPLICAS:
        blocks, states = model[r]
        score = 0.0
        for key in query:
            if key not in blocks:
                break
            score += max(TIER_WEIGHTS[t] for t in blocks[key])
            if r == "plain" or key in states:
                expected[r] = score
    got = index.match(query, REPLICAS)
    assert all(abs(got[r] - expected[r]) < 1e-9 for r in REPLICAS), (got, expected)


def test_a_guess_on_a_hybrid_replica_guesses_the_state_after_the_prompt():
    """The cache keeps a prompt's last boundary while it has room: a routed prompt counts
    whole there until the events say, and a shorter prefix of it (no checkpoint after
    its last block) not at all; a confirmed or evicted checkpoint ends the guess."""
    index = PrefixIndex(guess_ttl=60.0)
    index.apply("hybrid", [DECLARED])
    index.guess("hybrid", KEYS[:3])
    routed = TIER_WEIGHTS["ROUTED"]
    assert index.match(KEYS[:3], ["hybrid"]) == {"hybrid": 3 * routed}
    assert index.match(KEYS[:2], ["hybrid"]) == {"hybrid": 0.0}

    index.apply("hybrid", [DECLARED, ["BlockStored", KEYS[:3], None, [], 4, None, "GPU"],
                           stores(KEYS[2:3])])
    assert index.match(KEYS[:3], ["hybrid"]) == {"hybrid": 3.0}
    index.apply("hybrid", [DECLARED, removes(KEYS[2:3])])
    assert index.match(KEYS[:3], ["hybrid"]) == {"hybrid": 0.0}, "the guess went too"

    expired = PrefixIndex(guess_ttl=0.0)
    expired.apply("hybrid", [DECLARED])
    expired.guess("hybrid", KEYS[:3])
    expired.expire()
    assert expired.match(KEYS[:3], ["hybrid"]) == {"hybrid": 0.0}


def test_blocks_without_their_state_do_not_draw_the_request():
    """The hybrid replica holds all 6 blocks but a checkpoint after none; the plain one
    holds 3: the plain one computes less, and the cache policy sends the prompt there."""
    index = PrefixIndex()
    index.apply("hybrid", [DECLARED, ["BlockStored", KEYS, None, [], 16, None, "GPU"]])
    index.apply("plain", [["BlockStored", KEYS[:3], None, [], 16, None, "GPU"]])
    scores = index.match(KEYS, REPLICAS)
    assert scores == {"hybrid": 0.0, "plain": 3.0}
    picked = choose("cache", REPLICAS, {}, scores, itertools.count(), num_tokens=100)
    assert (picked.replica, picked.reason) == ("plain", "cache")

    index.apply("hybrid", [DECLARED, stores(KEYS[4:5])])  # after block 5 of 6
    scores = index.match(KEYS, REPLICAS)
    assert scores == {"hybrid": 5.0, "plain": 3.0}
    assert choose("cache", REPLICAS, {}, scores, itertools.count(),
                  num_tokens=100).replica == "hybrid"


def test_a_group_no_key_byte_names_never_serves_and_breaks_nothing():
    index = PrefixIndex()
    odd = [*DECLARED[:9], 300, "mamba"]
    index.apply("hybrid", [odd, ["BlockStored", KEYS[:2], None, [], 4, None, "GPU"]])
    assert index.state_groups("hybrid") == {300}
    assert index.match(KEYS[:2], ["hybrid"]) == {"hybrid": 0.0}
