"""Which request preemption takes, what a preempted request reports as cached, and seed 0
(issue 28: faults planted in the serving engine that no test caught)."""

from __future__ import annotations

import pytest

from paged_kv.engine import SamplingParams, TinyLlama

from ..conftest import make_engine
from . import test_serving
from .test_serving import assert_drained, drive, make_prompt, tokens_of

CONFIG = test_serving.CONFIG  # the model fixture's: test_serving's model

SHARED = make_prompt(16, seed=30)  # one full block of 16


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


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 - 1])
def test_a_seed_at_the_ends_of_its_range_samples_n_and_the_engine_goes_on(model, seed):
    """A negative seed (which the API accepts) with ``n=2``: sample 1's seed overflowed
    torch's inside the step that forks the samples, and every later step raised. Seeds
    wrap as torch reads them: sample 1 of seed -1 is seed 0 alone."""
    prompt = make_prompt(20, seed=35)
    params = SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=8)
    engine = make_engine(model)
    [out] = engine.generate([prompt], params)
    assert out.error is None and len(out.outputs) == 2
    for i, sample in enumerate(out.outputs):
        [alone] = make_engine(model).generate([prompt], SamplingParams(
            temperature=1.0, seed=(seed + i) % 2**64, max_tokens=8))
        assert sample.token_ids == alone.outputs[0].token_ids, f"sample {i}"
    [after] = engine.generate([prompt], SamplingParams(max_tokens=3))
    assert after.error is None and len(after.outputs[0].token_ids) == 3
    assert_drained(engine)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, True, 1.5, "7"])
def test_a_seed_out_of_range_is_refused_when_the_params_are_made(seed):
    with pytest.raises(ValueError, match=r"SamplingParams.seed: expected None or an int in"):
        SamplingParams(seed=seed)
