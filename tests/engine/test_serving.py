"""The serving engine against a cache-free reference: `TinyLlama.forward_dense`.

Greedy engine outputs must equal, token for token, a plain loop over ``forward_dense``
(append the argmax of the last row, repeat) whatever the batch, the token budget (chunked
prefill), prefix hits, arrivals mid-run, stop tokens and preemption (recompute or swap). Seeded
sampling must not depend on the batch; ``n`` samples share the prompt's blocks. Every step is
followed by ``cache.check()``, and a drained engine must hold no blocks.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv.engine import (
    CompletionOutput,
    Engine,
    RequestOutput,
    SamplingParams,
    TinyLlamaConfig,
)
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.sampling import sample

from ..conftest import make_engine
from ..conftest import prometheus_value as metric

CONFIG = TinyLlamaConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                         hidden_size=128, intermediate_size=256, vocab_size=512,
                         max_position=1024)
VOCAB = CONFIG.vocab_size
PROMPT_LENGTHS = (1, 15, 16, 17, 33, 100)  # cross block boundaries mid-prefill and mid-decode
SMALL_POOL = 12  # 11 usable blocks = 176 tokens: too few for the 9-prompt batch at once


def make_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(10_000 + 97 * seed + length)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


SYSTEM = make_prompt(40, seed=999)  # 2 full blocks + 8 tokens


@pytest.fixture(scope="module")
def dense(model):
    """``dense(prompt, max_tokens)``: the greedy reference, no cache (memoised)."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        out = memo.setdefault(key, [])
        while len(out) < max_tokens:
            logits = model.forward_dense(torch.tensor(list(prompt) + out))
            out.append(int(logits[-1].argmax()))
        return out[:max_tokens]

    return run


def drive(engine: Engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
          on_step=None, max_steps: int = 2000) -> tuple[list[int], dict[int, RequestOutput],
                                                         dict[int, int]]:
    """add_request + step loop: ``arrivals[s]`` are added before step ``s``; the cache's
    invariants are checked after every step. Returns the ids in arrival order, the outputs
    by id, and the step each request finished at."""
    ids, outputs, finished_at = [], {}, {}
    last_arrival = max(arrivals, default=0)
    for step in range(max_steps):
        for prompt, params in arrivals.get(step, []):
            ids.append(engine.add_request(prompt, params))
        if step > last_arrival and not engine.has_unfinished_requests:
            break
        for out in engine.step():
            assert out.request_id not in outputs, "a request finished twice"
            outputs[out.request_id] = out
            finished_at[out.request_id] = step
        engine.cache.check()
        if on_step is not None:
            on_step(engine)
    else:
        pytest.fail(f"engine did not drain in {max_steps} steps")
    assert sorted(outputs) == sorted(ids), "every request finishes exactly once"
    return ids, outputs, finished_at


def assert_drained(engine: Engine) -> None:
    stats = engine.cache.stats()
    assert stats.num_live_blocks == 0
    assert stats.num_swapped_blocks == 0
    assert stats.num_live_tokens == 0
    assert stats.num_live_blocks + stats.num_cached_blocks + stats.num_free_blocks \
        == engine.cache.config.num_blocks - 1
    assert not engine.scheduler.running and not engine.scheduler.waiting \
        and not engine.scheduler.swapped
    engine.cache.check()


def tokens_of(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


# -- 1. greedy engine == dense loop ----------------------------------------------------------
@pytest.mark.parametrize("budget", [24, 512])
def test_greedy_matches_dense_loop(model, dense, budget):
    greedy = SamplingParams  # temperature 0
    stop_prompt = make_prompt(17, seed=5)
    reference = dense(stop_prompt, 20)
    stop_token = reference[6]
    stop_expected = reference[: reference.index(stop_token) + 1]  # first occurrence stops it
    wave0 = [(SYSTEM + make_prompt(7, seed=1), greedy(max_tokens=10))]
    wave0 += [(make_prompt(length, seed=2), greedy(max_tokens=m))
              for length, m in zip(PROMPT_LENGTHS, (3, 20, 12, 17, 9, 16), strict=True)]
    wave1 = [(SYSTEM + make_prompt(length, seed=3), greedy(max_tokens=m))
             for length, m in ((1, 8), (24, 14), (9, 5))]
    wave2 = [(stop_prompt, greedy(max_tokens=20, stop_token_ids=(stop_token,))),
             (make_prompt(50, seed=4), greedy(max_tokens=6))]
    arrivals = {0: wave0, 3: wave1, 8: wave2}
    engine = make_engine(model, max_num_batched_tokens=budget)
    ids, outputs, finished_at = drive(engine, arrivals)

    requests = [r for s in sorted(arrivals) for r in arrivals[s]]
    for request_id, (prompt, params) in zip(ids, requests, strict=True):
        [completion] = outputs[request_id].outputs
        if params.stop_token_ids:
            assert completion.token_ids == stop_expected
            assert completion.finish_reason == "stop"
            assert len(completion.token_ids) < params.max_tokens
        else:
            assert completion.token_ids == dense(prompt, params.max_tokens), \
                f"prompt of {len(prompt)} tokens, budget {budget}"
            assert completion.finish_reason == "length"
        assert outputs[request_id].prompt_token_ids == prompt
    # sequences finished before later ones arrived: a real continuous batch
    assert min(finished_at.values()) < max(arrivals)
    # wave1 arrived after the system prompt's 2 full blocks were computed and indexed
    hits = [outputs[i].prefix_hit_tokens for i in ids]
    assert hits[len(wave0): len(wave0) + len(wave1)] == [32] * len(wave1)
    assert all(h == 0 for h in hits[1: len(wave0)])  # unrelated prompts hit nothing
    assert engine.cache.stats().prefix_hit_tokens >= 32 * len(wave1)
    assert_drained(engine)


def test_generate_returns_outputs_in_prompt_order(model, dense):
    prompts = [make_prompt(length, seed=6) for length in PROMPT_LENGTHS]
    outs = make_engine(model, max_num_batched_tokens=24).generate(
        prompts, [SamplingParams(max_tokens=m) for m in (4, 9, 2, 7, 5, 3)])
    assert [tokens_of(o) for o in outs] == [[dense(p, m)] for p, m in
                                            zip(prompts, (4, 9, 2, 7, 5, 3), strict=True)]


# -- 2. preemption ---------------------------------------------------------------------------
def preemption_workload() -> list[tuple[list[int], SamplingParams]]:
    """9 requests, ~300 tokens of prompt: far more than the 176 tokens of `SMALL_POOL`."""
    prompts = [make_prompt(length, seed=7) for length in PROMPT_LENGTHS]
    prompts += [SYSTEM + make_prompt(length, seed=8) for length in (5, 20, 40)]
    max_tokens = (30, 20, 16, 25, 12, 16, 30, 10, 20)
    # greedy and seeded sampling: a preempted sequence must keep its generator's state
    return [(p, SamplingParams(max_tokens=m, temperature=0.8 if i % 3 == 1 else 0.0,
                               top_k=50, seed=i))
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]


@pytest.fixture(scope="module")
def unconstrained(model):
    workload = preemption_workload()
    outs = make_engine(model).generate([p for p, _ in workload], [q for _, q in workload])
    assert all(o.num_preemptions == 0 for o in outs)
    return [tokens_of(o) for o in outs]


@pytest.mark.parametrize("budget", [24, 512])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_completes_every_request_unchanged(model, dense, unconstrained, mode,
                                                      budget):
    workload = preemption_workload()
    engine = make_engine(model, num_blocks=SMALL_POOL,
                         num_host_blocks=64 if mode == "swap" else 0,
                         max_num_batched_tokens=budget, preemption=mode)
    peak_swapped = []
    ids, outputs, _ = drive(engine, {0: workload},
                            on_step=lambda e: peak_swapped.append(
                                e.cache.stats().num_swapped_blocks))

    assert [tokens_of(outputs[i]) for i in ids] == unconstrained
    for (prompt, params), request_id in zip(workload, ids, strict=True):
        if params.temperature == 0:  # and the greedy ones are still the dense reference
            assert tokens_of(outputs[request_id]) == [dense(prompt, params.max_tokens)]
    preemptions = engine.scheduler.num_preemptions
    assert preemptions > 0
    assert sum(outputs[i].num_preemptions for i in ids) == preemptions
    assert sum(c.num_preemptions for i in ids for c in outputs[i].outputs) == preemptions
    assert metric(engine.metrics_text(), "paged_kv_preemptions_total") == preemptions
    if mode == "swap":  # it really swapped (the cache counts swaps only)
        assert engine.cache.stats().num_swap_outs > 0
        assert max(peak_swapped) > 0
    else:
        assert engine.cache.stats().num_swap_outs == 0
        assert max(peak_swapped) == 0
    assert_drained(engine)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_sequence_preempted_mid_prefill_completes(model, dense, preemption):
    # request 2 (51 tokens) is preempted after 28 of its prompt tokens; with swap it comes
    # back with 4 obtainable blocks (its 2 + 1 checked) and is scheduled 22 tokens needing
    # 2 more blocks
    requests = [(make_prompt(length, seed=9), SamplingParams(max_tokens=m))
                for length, m in ((10, 15), (31, 7), (51, 24))]
    engine = make_engine(model, num_blocks=8, max_num_batched_tokens=24, preemption=preemption,
                         num_host_blocks=64 if preemption == "swap" else 0)
    ids, outputs, _ = drive(engine, {0: requests})
    assert engine.scheduler.num_preemptions > 0
    for request_id, (prompt, params) in zip(ids, requests, strict=True):
        assert tokens_of(outputs[request_id]) == [dense(prompt, params.max_tokens)]
    assert_drained(engine)


def test_request_filling_the_whole_pool_runs(model, dense):
    # 161 + 16 tokens: the last one is never written, so 176 slots = exactly 11 blocks
    prompt = make_prompt(161, seed=10)
    engine = make_engine(model, num_blocks=SMALL_POOL)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=16))
    assert tokens_of(out) == [dense(prompt, 16)]
    assert_drained(engine)


# -- 3. parallel sampling --------------------------------------------------------------------
def test_n_samples_share_the_prompt_and_match_their_seeds_alone(model):
    prompt = make_prompt(40, seed=11)  # 2 full blocks + a partial one
    params = SamplingParams(n=4, temperature=0.8, top_k=50, seed=123, max_tokens=12)
    engine = make_engine(model)
    bytes_per_block = engine.cache.config.bytes_per_block
    seen = []
    _, outputs, _ = drive(engine, {0: [(prompt, params)]},
                          on_step=lambda e: seen.append(e.cache.stats()))
    # right after the fork all 4 samples own the 3 prompt blocks
    assert max(s.num_shared_blocks for s in seen) == 3
    assert max(s.bytes_saved_by_sharing for s in seen) == 3 * 3 * bytes_per_block
    # while they decode, the 2 full prompt blocks stay shared (the partial one was copied)
    assert all(s.num_shared_blocks >= 2 and s.bytes_saved_by_sharing >= 6 * bytes_per_block
               for s in seen[:-1])
    [out] = outputs.values()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = tokens_of(out)
    for i, tokens in enumerate(samples):
        alone = make_engine(model).generate(
            [prompt], SamplingParams(temperature=0.8, top_k=50, seed=123 + i, max_tokens=12))
        assert tokens_of(alone[0]) == [tokens], f"sample {i}"
    assert len({tuple(t) for t in samples}) >= 2, "samples differ from each other"
    assert_drained(engine)


def test_n_samples_never_exceed_max_num_seqs(model):
    engine = make_engine(model, max_num_seqs=4, max_num_batched_tokens=24)
    arrivals = {0: [(make_prompt(100, seed=12), SamplingParams(n=4, temperature=0.8, seed=1,
                                                               max_tokens=5)),
                    (make_prompt(3, seed=12), SamplingParams(max_tokens=5))]}
    running = []
    drive(engine, arrivals, on_step=lambda e: running.append(len(e.scheduler.running)))
    assert max(running) <= 4


# -- 4. seeded sampling is batch-independent ------------------------------------------------
def test_seeded_sampling_does_not_depend_on_the_batch(model):
    target = (make_prompt(33, seed=13), SamplingParams(temperature=1.0, top_p=0.9, seed=7,
                                                       max_tokens=16))
    [alone] = make_engine(model).generate([target[0]], target[1])
    others = [(make_prompt(length, seed=14), SamplingParams(temperature=1.0, max_tokens=m))
              for length, m in ((20, 10), (64, 20), (5, 3))]
    engine = make_engine(model, max_num_batched_tokens=24)
    ids, outputs, _ = drive(engine, {0: others[:2], 2: [target],
                                     4: [*others[2:], (target[0], SamplingParams(max_tokens=4))]})
    assert tokens_of(outputs[ids[2]]) == tokens_of(alone)
    # and a different seed gives a different sample (the seed is really used)
    [other_seed] = make_engine(model).generate(
        [target[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=16))
    assert tokens_of(other_seed) != tokens_of(alone)


# -- 5. bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize(("prompt", "params", "match"), [
    ([], SamplingParams(), "empty prompt"),
    ([1, -1], SamplingParams(), r"token ids must be ints in \[0, 512\), got \[-1\]"),
    ([1, VOCAB], SamplingParams(), r"token ids must be ints in \[0, 512\), got \[512\]"),
    ([1, 2.5], SamplingParams(), r"token ids must be ints.*2\.5"),
    ([1, "7"], SamplingParams(), "token ids must be ints"),
    ([True, 3], SamplingParams(), "token ids must be ints"),
    ([1, 2], SamplingParams(n=3), "n=3 exceeds max_num_seqs=2"),
    ([1] * 1000, SamplingParams(max_tokens=30), r"1030 exceeds the model's max_position"),
    (make_prompt(170, seed=15), SamplingParams(max_tokens=16),
     r"needs 12 blocks, more than the pool's 11; raise num_blocks"),
    (make_prompt(162, seed=15), SamplingParams(max_tokens=16), "raise num_blocks"),
], ids=["empty", "negative", "vocab", "float", "str", "bool", "n>max_num_seqs",
        "max_position", "pool", "pool+1"])
def test_add_request_rejects_bad_requests_and_leaves_the_engine_working(
        model, dense, prompt, params, match):
    engine = make_engine(model, num_blocks=SMALL_POOL, max_num_seqs=2)
    queued = [make_prompt(length, seed=16) for length in (17, 33)]
    first = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in queued]
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == 2
    later = engine.add_request(queued[0], SamplingParams(max_tokens=3))
    assert later == first[-1] + 1  # the rejected request took no id
    outputs = {}
    while engine.has_unfinished_requests:
        outputs.update((o.request_id, o) for o in engine.step())
        engine.cache.check()
    assert [tokens_of(outputs[i]) for i in [*first, later]] == \
        [[dense(queued[0], 6)], [dense(queued[1], 6)], [dense(queued[0], 3)]]
    assert_drained(engine)


def test_add_request_rejects_params_of_the_wrong_type(model):
    engine = make_engine(model)
    with pytest.raises(TypeError, match="params: expected SamplingParams"):
        engine.add_request([1, 2], {"max_tokens": 3})


def test_generate_validates_every_prompt_before_queueing_any(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match=r"prompt 1: .*token ids must be ints"):
        engine.generate([[1, 2], [3, VOCAB + 5]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests
    with pytest.raises(ValueError, match="params: 1 given for 2 prompts"):
        engine.generate([[1, 2], [3]], [SamplingParams()])


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_tokens=0), r"max_tokens: expected an int >= 1, got 0"),
    (dict(max_tokens=-3), r"max_tokens: expected an int >= 1, got -3"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(temperature=-0.1), r"temperature: expected >= 0, got -0.1"),
    (dict(top_p=0.0), r"top_p: expected in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), r"top_k: expected >= 0, got -1"),
    (dict(n=0), r"n: expected an int >= 1, got 0"),
])
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("host_blocks", "kwargs", "match"), [
    (0, dict(preemption="swap"), r"preemption='swap' needs cache.num_host_blocks > 0"),
    (8, dict(preemption="bogus"), r"preemption: expected 'recompute' or 'swap', got 'bogus'"),
    (0, dict(max_num_seqs=0), r"max_num_seqs: expected >= 1, got 0"),
    (0, dict(max_num_batched_tokens=0), r"max_num_batched_tokens: expected >= 1, got 0"),
])
def test_engine_rejects_bad_configuration(model, host_blocks, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_engine(model, num_host_blocks=host_blocks, **kwargs)


# -- 6. metrics ------------------------------------------------------------------------------
def test_metrics_track_the_cache_scheduler_and_tokens(model):
    engine = make_engine(model, max_num_batched_tokens=24)
    arrivals = {0: [(SYSTEM + make_prompt(9, seed=17), SamplingParams(max_tokens=6)),
                    (make_prompt(33, seed=17), SamplingParams(n=2, temperature=0.9, seed=4,
                                                              max_tokens=7))],
                4: [(SYSTEM + make_prompt(length, seed=18), SamplingParams(max_tokens=5))
                    for length in (3, 30)]}

    def check_gauges(e: Engine) -> None:
        text, stats = e.metrics_text(), e.cache.stats()
        for state, value in (("live", stats.num_live_blocks), ("cached", stats.num_cached_blocks),
                             ("free", stats.num_free_blocks)):
            assert metric(text, "paged_kv_blocks", f'{{state="{state}"}}') == value
        assert metric(text, "paged_kv_live_tokens") == stats.num_live_tokens
        assert metric(text, "paged_kv_empty_slots") == stats.num_empty_slots
        assert metric(text, "paged_kv_running_requests") == len(e.scheduler.running)
        assert metric(text, "paged_kv_waiting_requests") == \
            len(e.scheduler.waiting) + len(e.scheduler.swapped)

    _, outputs, _ = drive(engine, arrivals, on_step=check_gauges)
    text, stats = engine.metrics_text(), engine.cache.stats()
    generated = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    assert generated == 6 + 2 * 7 + 5 + 5
    assert metric(text, "paged_kv_generated_tokens_total") == generated
    assert metric(text, "paged_kv_prefix_query_tokens_total") == stats.prefix_query_tokens > 0
    assert metric(text, "paged_kv_prefix_hit_tokens_total") == stats.prefix_hit_tokens >= 64
    assert metric(text, "paged_kv_preemptions_total") == 0
    assert metric(text, "paged_kv_running_requests") == 0
    assert metric(text, "paged_kv_waiting_requests") == 0
    assert metric(text, "paged_kv_blocks", '{state="live"}') == 0
    assert metric(text, "paged_kv_blocks", '{state="cached"}') == stats.num_cached_blocks > 0
    assert metric(text, "paged_kv_blocks", '{state="free"}') == stats.num_free_blocks
    assert metric(text, "paged_kv_live_tokens") == 0
    assert metric(text, "paged_kv_empty_slots") == 0


# -- 7. sampling parameters ------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=12),
    SamplingParams(temperature=1.0, top_p=0.01, seed=3, max_tokens=12),
], ids=["top_k=1", "top_p=0.01"])
def test_degenerate_sampling_is_greedy(model, dense, params):
    prompts = [make_prompt(length, seed=19) for length in (15, 33)]
    outs = make_engine(model).generate(prompts, params)
    assert [tokens_of(o) for o in outs] == [[dense(p, 12)] for p in prompts]


def test_sample_is_reproducible_with_the_same_generator_seed():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.5)

    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample(logits, params, generator) for _ in range(40)]

    assert draws(21) == draws(21)
    assert draws(21) != draws(22)
    assert len(set(draws(21))) > 5  # really sampling, not argmax
    assert sample(logits, SamplingParams(), None) == int(logits.argmax())


def test_sample_keeps_only_the_top_k_and_the_nucleus():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=generator)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    picked = {sample(logits, SamplingParams(temperature=2.0, top_k=5), generator)
              for _ in range(300)}
    assert picked == top5
    probs = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # smallest set reaching top_p: {0, 1} for 0.6 (0.5 < 0.6 <= 0.8), {0} for 0.4
    assert {sample(probs, SamplingParams(temperature=1.0, top_p=0.6), generator)
            for _ in range(300)} == {0, 1}
    assert {sample(probs, SamplingParams(temperature=1.0, top_p=0.4), generator)
            for _ in range(50)} == {0}


# -- 8. RequestOutput ------------------------------------------------------------------------
def test_request_output_shape(model, dense):
    prompt_a, prompt_b = make_prompt(20, seed=20), make_prompt(18, seed=21)
    stop = dense(prompt_b, 10)[2]
    params_a = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=8)
    params_b = SamplingParams(max_tokens=10, stop_token_ids=[stop])
    engine = make_engine(model)
    outs = engine.generate([prompt_a, prompt_b], [params_a, params_b])
    assert [o.request_id for o in outs] == [0, 1]
    for out, prompt, n in ((outs[0], prompt_a, 3), (outs[1], prompt_b, 1)):
        assert isinstance(out, RequestOutput) and out.finished
        assert out.prompt_token_ids == prompt
        assert all(isinstance(c, CompletionOutput) for c in out.outputs)
        assert [c.index for c in out.outputs] == list(range(n))
        assert all(c.finish_reason in {"stop", "length"} for c in out.outputs)
        assert all(1 <= len(c.token_ids) <= 10 for c in out.outputs)
        assert out.time_to_first_token > 0
        assert len(out.token_latencies) == sum(len(c.token_ids) - 1 for c in out.outputs)
        assert all(latency >= 0 for latency in out.token_latencies)
        assert out.num_preemptions == 0 and out.prefix_hit_tokens == 0
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in outs[0].outputs)
    [completion] = outs[1].outputs
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == stop
    assert completion.token_ids == dense(prompt_b, 10)[: completion.token_ids.index(stop) + 1]
    assert_drained(engine)


def test_a_failing_model_step_leaves_the_engine_able_to_continue(model, dense):
    """A model error mid-step returns the step's slots and fails that step's request with
    the error (never a success, never an exception out of `step`); the engine goes on and
    the next request gets exact tokens."""
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64),
                                        max_num_batched_tokens=64))
    prompt = list(range(1, 30))
    seen = []
    engine.add_request(prompt, SamplingParams(max_tokens=5), on_output=seen.append)
    calls = {"n": 0}
    real_forward = model.forward

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_forward(*args, **kwargs)

    model.forward = failing_once
    try:
        engine.step()
        assert engine.step() == []
        assert seen[-1].finish_reason == "error" and "device lost" in seen[-1].output.error
        assert not engine.has_unfinished_requests
        engine.cache.check()
        assert engine.cache.stats().num_live_blocks == 0, "the failed step's blocks leaked"
        again = engine.generate([prompt], SamplingParams(max_tokens=5))
    finally:
        del model.forward
    assert again[0].outputs[0].token_ids == dense(prompt, 5)
