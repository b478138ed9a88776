"""A steady step's carry takes the tokens the sampler kept beside its samples
(`draw.Samples`) instead of unzipping them: two schedulers over the same requests, one
handed `Samples` and one the same samples as a plain list, end every step with the same
sequences, the same carry and the same finished requests, through steady steps, stop
tokens, lengths, aborts and arrivals; and the carry reads the kept tokens, not the
tuples."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.config import CacheConfig
from paged_kv.core.cache import PagedKVCache
from paged_kv.engine import SamplingParams
from paged_kv.engine.draw import Samples, draw_rows
from paged_kv.engine.request import Request, Sequence
from paged_kv.engine.scheduler import Scheduler

STOP = 3  # a stop token some requests ask for


def _scheduler() -> Scheduler:
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4,
                                     num_blocks=512, dtype=torch.float32, max_num_seqs=16))
    return Scheduler(cache, max_num_seqs=16, max_num_batched_tokens=256,
                     preemption="recompute")


def _add(scheduler: Scheduler, request_id: int, max_tokens: int, stop: bool) -> None:
    tokens = [(request_id * 7 + i) % 50 + 10 for i in range(5 + request_id % 7)]
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP] if stop else ())
    scheduler.add(Sequence(Request(request_id, tokens, params, 0.0), 0, list(tokens), None))


def _state(scheduler: Scheduler) -> tuple:
    """Every running sequence's tokens and computed count, and the carry's arrays."""
    carry = scheduler.steady._carry
    return ([(s.request.request_id, list(s.token_ids), s.num_computed)
             for s in scheduler.running],
            None if carry is None else ([s.request.request_id for s in carry[0]],
                                        carry[1].tolist(), carry[2].tolist()))


def _step(scheduler: Scheduler, draws: list[int], drawn: bool) -> list[int]:
    if not scheduler.running and not scheduler.waiting:
        return []
    plan = scheduler.schedule()
    scheduler.prepare(plan)
    scheduler.advance(plan)
    seqs = [seq for seq in plan if seq.num_computed == len(seq.token_ids)]
    tokens = [draws[(seq.request.request_id + len(seq.token_ids)) % len(draws)]
              for seq in seqs]
    samples = Samples.of(seqs, tokens) if drawn else [(s, t, None) for s, t in
                                                      zip(seqs, tokens, strict=True)]
    finished = scheduler.update_from_output(samples, frozenset())
    return sorted(request.request_id for request in finished)


def test_the_kept_tokens_carry_as_the_tuples_do():
    carried = []  # over every example: steps that left a carry

    @settings(max_examples=60, deadline=None)
    @given(draws=st.lists(st.integers(0, 40), min_size=1, max_size=20),
           events=st.lists(st.sampled_from(("step",) * 6 + ("add", "abort")), min_size=5,
                           max_size=40),
           data=st.data())
    def check(draws, events, data):
        schedulers = [_scheduler(), _scheduler()]
        next_id = 0
        for event in ("add", "add", *events):
            if event == "add":
                max_tokens, stop = data.draw(st.integers(1, 12)), data.draw(st.booleans())
                for scheduler in schedulers:
                    _add(scheduler, next_id, max_tokens, stop)
                next_id += 1
            elif event == "abort" and schedulers[0].running:
                victim = data.draw(st.sampled_from(schedulers[0].running)).request.request_id
                for scheduler in schedulers:
                    scheduler.abort(next(s for s in scheduler.running
                                         if s.request.request_id == victim))
            finished = [_step(scheduler, draws, drawn) for scheduler, drawn in
                        zip(schedulers, (True, False), strict=True)]
            assert finished[0] == finished[1]
            assert _state(schedulers[0]) == _state(schedulers[1])
            carried.append(schedulers[0].steady._carry is not None)

    check()
    assert sum(carried) > 100  # the carry ran, through the kept tokens


def test_the_carry_reads_the_kept_tokens():
    """A `Samples` whose kept tokens differ from its tuples' (never made so by the engine):
    the carry, and so the next step's input, holds the kept ones."""
    scheduler = _scheduler()
    _add(scheduler, 0, 20, False)
    _add(scheduler, 1, 20, False)
    for _ in range(3):
        _step(scheduler, [5], drawn=False)  # prefill, then steady
    plan = scheduler.schedule()
    scheduler.prepare(plan)
    scheduler.advance(plan)
    seqs = list(plan)
    samples = Samples.of(seqs, [7, 8])
    samples.tokens = [11, 12]
    scheduler.update_from_output(samples, frozenset())
    assert scheduler.steady._carry[1].tolist() == [11, 12]


def test_the_sampler_keeps_its_tokens_beside_the_samples():
    logits = torch.randn(3, 16)
    seqs = [Sequence(Request(i, [1, 2], SamplingParams(max_tokens=2), 0.0), 0, [1, 2], None)
            for i in range(3)]
    samples = draw_rows(logits, seqs)
    assert isinstance(samples, Samples) and samples.seqs == seqs
    assert samples.tokens == [token for _, token, _ in samples]
    assert samples.tokens == logits.argmax(-1).tolist()
    assert list(samples) == [(s, t, None) for s, t in zip(seqs, samples.tokens, strict=True)]
    np.testing.assert_array_equal(samples.tokens, logits.argmax(-1).numpy())
