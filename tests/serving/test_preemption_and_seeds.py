"""Which request preemption takes, what a preempted request reports as cached, and seed 0
(issue 28: faults planted in the serving engine that no test caught)."""

from __future__ import annotations

import pytest

from paged_kv.serving import SamplingParams, TinyLlama

from .test_serving import CONFIG, assert_drained, drive, make_engine, make_prompt, tokens_of

SHARED = make_prompt(16, seed=30)  # one full block of 16


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(CONFIG, seed=0)


def _two_that_outgrow_the_pool(model: TinyLlama, mode: str):
    """Two requests admitted in one step, each growing to 5 blocks in a pool of 7: one is
    preempted. Both prompts start with `SHARED`, cached by a request run before them."""
    engine = make_engine(model, num_blocks=8, num_host_blocks=64 if mode == "swap" else 0,
                         preemption=mode)
    engine.generate([[*SHARED, 1, 2]], SamplingParams(max_tokens=1))
    prompts = [SHARED + make_prompt(4, seed=seed) for seed in (31, 32)]
    ids, outputs, _ = drive(engine, {0: [(p, SamplingParams(max_tokens=60)) for p in prompts]})
    return engine, [outputs[i] for i in ids]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_takes_the_most_recently_admitted_request(model, mode):
    """Fault: the oldest running request preempted instead of the newest (vLLM's order:
    the newest has the least done, and the oldest finishes first)."""
    engine, (older, newer) = _two_that_outgrow_the_pool(model, mode)
    assert engine.scheduler.num_preemptions >= 1
    assert older.num_preemptions == 0, "the older request was preempted"
    assert newer.num_preemptions == engine.scheduler.num_preemptions
    assert_drained(engine)


def test_a_recomputed_request_reports_its_first_admissions_cached_tokens(model):
    """Fault: ``prefix_hit_tokens`` (the API's ``cached_tokens``) overwritten at the
    re-admission after a recompute preemption, where the request's own freed blocks hit:
    more cached tokens than its prompt has."""
    engine, outputs = _two_that_outgrow_the_pool(model, "recompute")
    assert outputs[1].num_preemptions >= 1
    assert [out.prefix_hit_tokens for out in outputs] == [16, 16]
    assert engine.cache.stats().prefix_hit_tokens > 32, "the re-admission did hit more"


def test_seed_zero_is_a_seed(model):
    """Fault: ``seed=0`` treated as no seed (``params.seed or a drawn one``): its samples
    then depend on how many unseeded requests the engine drew seeds for before it."""
    prompt = make_prompt(20, seed=33)
    seeded = SamplingParams(temperature=1.0, seed=0, max_tokens=16)
    [alone] = make_engine(model).generate([prompt], seeded)
    engine = make_engine(model)
    others = [(make_prompt(9, seed=34), SamplingParams(temperature=1.0, max_tokens=3))] * 3
    ids, outputs, _ = drive(engine, {0: others, 1: [(prompt, seeded)]})
    assert tokens_of(outputs[ids[-1]]) == tokens_of(alone)
    [other] = make_engine(model).generate(
        [prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=16))
    assert tokens_of(other) != tokens_of(alone), "the seed is used"
