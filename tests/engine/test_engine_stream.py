"""The engine's streaming API: per-token step outputs, abort, and tenant salts."""

from __future__ import annotations

from paged_kv.engine import SamplingParams, StepOutput, TinyLlamaConfig

from ..conftest import make_engine
from .conftest import prompt

CONFIG = TinyLlamaConfig(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         hidden_size=64, intermediate_size=128, vocab_size=300)
VOCAB = CONFIG.vocab_size


def test_step_outputs_stream_the_generated_tokens(model):
    engine = make_engine(model, num_blocks=64, block_size=8)
    params = [SamplingParams(max_tokens=7), SamplingParams(max_tokens=5, n=3, temperature=1.0,
                                                          seed=4)]
    expected = engine.generate([prompt(20, 1, VOCAB), prompt(9, 2, VOCAB)], params)
    streams: dict[int, list[StepOutput]] = {}
    for i, p in enumerate(params):
        engine.add_request([prompt(20, 1, VOCAB), prompt(9, 2, VOCAB)][i], p,
                           on_output=lambda out: streams.setdefault(out.request_id, []).append(out))
    while engine.has_unfinished_requests:
        engine.step()
    for want, outs in zip(expected, streams.values(), strict=True):
        for sample in want.outputs:
            mine = [o for o in outs if o.index == sample.index]
            assert [t for o in mine for t in o.new_token_ids] == sample.token_ids
            assert mine[-1].finish_reason == "length"
            assert all(o.finish_reason is None for o in mine[:-1])
        finals = [o.output for o in outs if o.output is not None]
        assert len(finals) == 1 and finals[0] is outs[-1].output, "one final output, last"
        assert [c.token_ids for c in finals[0].outputs] == [c.token_ids for c in want.outputs]


def test_final_output_made_once_for_listener_and_step(model):
    """A finished request's `RequestOutput` is made once a step: its listener's final
    output is the object the step returns, and it holds what the request says."""
    engine = make_engine(model, num_blocks=64, block_size=8)
    streams: dict[int, list[StepOutput]] = {}
    ids = [engine.add_request(prompt(12 + i, 10 + i, VOCAB), SamplingParams(max_tokens=3 + i),
                              on_output=lambda out: streams.setdefault(out.request_id,
                                                                        []).append(out))
           for i in range(3)]
    requests = {rid: engine._requests[rid] for rid in ids}
    returned = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            returned[output.request_id] = output
    assert sorted(returned) == sorted(ids)
    for rid in ids:
        final = streams[rid][-1].output
        assert final is returned[rid]
        request = requests[rid]
        assert final == request.output(request.finish_time)
        assert len(final.token_latencies) == len(final.outputs[0].token_ids) - 1


def test_abort_frees_blocks_and_reports_abort(model):
    engine = make_engine(model, num_blocks=64, block_size=8)
    seen: list[StepOutput] = []
    rid = engine.add_request(prompt(30, 3, VOCAB),
                             SamplingParams(max_tokens=50, n=2, temperature=1.0),
                             on_output=seen.append)
    other = engine.add_request(prompt(10, 4, VOCAB), SamplingParams(max_tokens=3))
    for _ in range(3):
        engine.step()
    assert engine.cache.allocator.num_live_blocks > 0
    assert engine.abort(rid) and not engine.abort(rid), "a second abort is a no-op"
    assert [o.finish_reason for o in seen[-2:]] == ["abort", "abort"]
    assert seen[-1].output is not None and seen[-2].output is None
    outputs = engine.generate([prompt(5, 5, VOCAB)], SamplingParams(max_tokens=2))
    assert outputs[0].outputs[0].finish_reason == "length"
    assert not engine.has_unfinished_requests and other not in engine._requests
    assert engine.cache.allocator.num_live_blocks == 0
    engine.cache.check()


def test_abort_a_waiting_request(model):
    engine = make_engine(model, num_blocks=64, block_size=8)
    seen: list[StepOutput] = []
    rid = engine.add_request(prompt(12, 6, VOCAB), on_output=seen.append)
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests
    assert seen[0].finish_reason == "abort" and seen[0].output.outputs[0].token_ids == []


def test_salt_isolates_prefix_hits(model):
    engine = make_engine(model, num_blocks=64, block_size=8)
    shared = prompt(40, 7, VOCAB)
    hits = []
    for salt in ("a", "a", "b", None):
        engine.add_request(shared, SamplingParams(max_tokens=1), salt=salt,
                           on_output=lambda o: o.output and hits.append(o.output.prefix_hit_tokens))
        while engine.has_unfinished_requests:
            engine.step()
    assert hits[0] == 0 and hits[1] > 0, "same salt shares the cached prompt"
    assert hits[2] == 0 and hits[3] == 0, "another salt (or none) never sees it"
