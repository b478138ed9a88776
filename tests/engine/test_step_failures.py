"""A step that fails fails only the requests it belongs to (issue 20): the culprit, found by
rerunning the step's requests one by one, finishes with "error"; its batch-mates, and the
requests waiting behind them, finish with exactly the tokens they get without it. An engine
that can no longer step says so with `EngineDeadError`."""

from __future__ import annotations

import threading

import pytest

from paged_kv.engine import Engine, EngineDeadError, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine import draw as draw_module

from ..conftest import make_engine
from .conftest import prompt

CONFIG = TinyLlamaConfig(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         hidden_size=64, intermediate_size=128, vocab_size=256,
                         max_position=512)
GREEDY = SamplingParams(max_tokens=6)
MODEL_SEED = 3
VOCAB = CONFIG.vocab_size
POOL = dict(num_blocks=64, block_size=8)  # make_engine's pool


def alone(model: TinyLlama, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    [out] = make_engine(model, **POOL).generate([prompt_ids], params)
    return out.outputs[0].token_ids


def run(engine: Engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
        ) -> dict[int, list]:
    """Step to completion, adding ``arrivals[step]`` before each step; every sample's
    stream, by request id. `step` must never raise, and the cache stays consistent."""
    streams: dict[int, list] = {}
    step = 0
    while engine.has_unfinished_requests or any(s >= step for s in arrivals):
        for prompt_ids, params in arrivals.get(step, []):
            request_id = engine.add_request(prompt_ids, params,
                                            on_output=lambda o: streams[o.request_id].append(o))
            streams[request_id] = []
        engine.step()
        engine.cache.check()
        step += 1
    assert engine.cache.stats().num_live_blocks == 0, "a failed request's blocks leaked"
    return streams


def final(stream: list) -> tuple[list[int], str, str | None]:
    """A request's streamed tokens, its finish reason and error (one sample)."""
    last = stream[-1]
    assert last.output is not None, "the request's last step output carries its output"
    tokens = [t for out in stream for t in out.new_token_ids]
    assert tokens == last.output.outputs[0].token_ids
    return tokens, last.finish_reason, last.output.error


def test_a_model_error_fails_only_the_request_whose_input_raises(model, monkeypatch):
    good = [prompt(20, 1, VOCAB), prompt(9, 2, VOCAB), prompt(30, 3, VOCAB), prompt(5, 4, VOCAB)]
    want = [alone(model, p, GREEDY) for p in good]
    mark = min(set(range(CONFIG.vocab_size)) - {t for p, w in zip(good, want, strict=True)
                                                  for t in p + w})
    bad = [*prompt(12, 5, VOCAB)[:6], mark, *prompt(12, 5, VOCAB)[6:]]
    real_forward = model.forward

    def forward(token_ids, *args, **kwargs):  # the model raises on the marked token
        if mark in token_ids.tolist():
            raise RuntimeError("bad input")
        return real_forward(token_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    # two decoding when the culprit arrives with a batch-mate; a fourth waits for a slot
    engine = make_engine(model, **POOL, max_num_seqs=4, max_num_batched_tokens=128)
    streams = run(engine, {0: [(good[0], GREEDY), (good[1], GREEDY)],
                           2: [(bad, GREEDY), (good[2], GREEDY), (good[3], GREEDY)]})
    tokens, reason, error = final(streams[2])
    assert (tokens, reason) == ([], "error") and "bad input" in error
    for request_id, expected in zip((0, 1, 3, 4), want, strict=True):
        assert final(streams[request_id]) == (expected, "length", None), request_id


def test_generate_returns_a_failed_request_instead_of_waiting_for_it(model, monkeypatch):
    real_forward = model.forward

    def forward(token_ids, *args, **kwargs):
        if 7 in token_ids.tolist():
            raise RuntimeError("bad input")
        return real_forward(token_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    ok = [1, 2, 3]
    want = alone(model, ok, SamplingParams(max_tokens=1))
    outs: list = []
    engine = make_engine(model, **POOL)
    # it used to wait forever for the failed request: a thread, so a hang is a failure
    worker = threading.Thread(target=lambda: outs.extend(
        engine.generate([[7, 8], ok], SamplingParams(max_tokens=1))), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "generate() waits for a request that failed"
    failed, served = outs
    assert failed.outputs[0].finish_reason == "error" and "bad input" in failed.error
    assert served.outputs[0].token_ids == want and served.error is None


def test_a_sampling_error_fails_only_its_request(model, monkeypatch):
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=5)
    culprit = SamplingParams(max_tokens=6, temperature=0.9, seed=13)
    good = [(prompt(10, 6, VOCAB), seeded), (prompt(17, 7, VOCAB), GREEDY),
            (prompt(4, 8, VOCAB), seeded)]
    want = [alone(model, p, params) for p, params in good]
    real = draw_module.sample_rows

    def sample_rows(logits, params, generators, groups=None):
        tokens = real(logits, params, generators, groups)  # draws first: the retry must undo it
        if any(p.seed == 13 for p in params):
            raise RuntimeError("sampling blew up")
        return tokens

    monkeypatch.setattr(draw_module, "sample_rows", sample_rows)
    engine = make_engine(model, **POOL)
    streams = run(engine, {0: good[:2], 1: [(prompt(8, 9, VOCAB), culprit)], 2: good[2:]})
    _, reason, error = final(streams[2])
    assert reason == "error" and "sampling blew up" in error
    for request_id, expected in zip((0, 1, 3), want, strict=True):
        assert final(streams[request_id]) == (expected, "length", None), request_id


def test_a_closed_engine_raises_engine_dead_error_on_every_step(model):
    engine = make_engine(model, **POOL)
    engine.generate([[1, 2, 3]], GREEDY)
    engine.close()
    engine.add_request([4, 5], GREEDY)
    for _ in range(2):
        with pytest.raises(EngineDeadError, match="closed"):
            engine.step()


def test_the_queues_are_read_through_stats_and_unfinished_request_ids(model):
    """What the server's loop needs to fail every request, without the scheduler."""
    engine = make_engine(model, **POOL, max_num_seqs=2)
    ids = [engine.add_request(prompt(5, seed, VOCAB), GREEDY) for seed in range(3)]
    engine.step()
    stats = engine.stats()
    assert (engine.max_num_seqs, stats.num_running, stats.num_waiting) == (2, 2, 1)
    assert engine.unfinished_request_ids() == ids
    for request_id in engine.unfinished_request_ids():
        engine.abort(request_id, error="the engine died")
    assert engine.unfinished_request_ids() == [] and not engine.has_unfinished_requests
    assert engine.stats().num_live_blocks == 0


def test_blocks_a_failed_step_planned_are_never_found_by_a_later_prompt(model, monkeypatch):
    """A step indexes the full blocks it plans before the model writes them; when the model
    then fails, those blocks hold no K/V of their tokens. They must leave the prefix index:
    the same prompt sent again computes them instead of being served garbage."""
    prompt_ids = prompt(40, 7, VOCAB)  # five full blocks of 8, and more
    want = alone(model, prompt_ids, GREEDY)
    engine = make_engine(model, **POOL)
    real_forward = model.forward
    failing = [True]

    def forward(*args, **kwargs):
        if failing[0]:
            raise RuntimeError("the model failed")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    [failed] = engine.generate([prompt_ids], GREEDY)
    assert failed.error is not None
    engine.cache.check()
    assert engine.cache.allocator.num_cached_blocks == 0, "unwritten blocks stayed cached"
    failing[0] = False
    [out] = engine.generate([prompt_ids], GREEDY)
    assert out.prefix_hit_tokens == 0
    assert out.outputs[0].token_ids == want


def test_a_failed_chunk_starting_mid_block_leaves_that_block_out_of_the_index(model,
                                                                              monkeypatch):
    """The chunk that fails starts inside a block (12 of the prompt's tokens computed, 8 a
    block): the block it would have completed holds only its first 4 tokens' K/V, so it
    leaves the index with the blocks after it; the block before stays cached and is hit."""
    prompt_ids = prompt(40, 8, VOCAB)
    want = alone(model, prompt_ids, GREEDY)
    engine = make_engine(model, **POOL, max_num_batched_tokens=12)
    real_forward = model.forward
    calls = [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= 2:  # the first chunk runs, every later call fails
            raise RuntimeError("the model failed")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    [failed] = engine.generate([prompt_ids], GREEDY)
    assert failed.error is not None and calls[0] >= 2
    engine.cache.check()
    assert engine.cache.allocator.num_cached_blocks == 1, "only the block written whole"
    calls[0] = -1_000_000
    [out] = engine.generate([prompt_ids], GREEDY)
    assert out.prefix_hit_tokens == 8
    assert out.outputs[0].token_ids == want
