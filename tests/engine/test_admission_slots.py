"""The scheduler admits no more sequences than `max_num_seqs` counts slots for: each running
sequence, plus the samples still to be forked off a request's first (``n > 1``), counted
once a step and then kept as admissions take their slots."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.config import CacheConfig
from paged_kv.core.cache import PagedKVCache
from paged_kv.engine import SamplingParams
from paged_kv.engine.request import Request, Sequence
from paged_kv.engine.scheduler import Scheduler


def _scheduler(max_num_seqs: int) -> Scheduler:
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4,
                                     num_blocks=256, dtype=torch.float32,
                                     max_num_seqs=max_num_seqs))
    return Scheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                     preemption="recompute")


def _add(scheduler: Scheduler, request_id: int, n: int, length: int = 6) -> None:
    tokens = [(request_id * 7 + i) % 50 for i in range(length)]
    request = Request(request_id, tokens, SamplingParams(max_tokens=4, n=n), 0.0)
    scheduler.add(Sequence(request, 0, list(tokens), None))


def test_an_admission_takes_the_slots_of_its_samples():
    """Three requests of two samples under five slots: two are admitted (four slots), the
    third waits though one slot is free (it needs two)."""
    scheduler = _scheduler(5)
    for request_id in range(3):
        _add(scheduler, request_id, n=2)
    plan = scheduler.schedule()
    assert [seq.request.request_id for seq in plan] == [0, 1]
    assert len(scheduler.waiting) == 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), max_num_seqs=st.integers(1, 9))
def test_slots_never_exceed_max_num_seqs(seed, max_num_seqs):
    """Random requests of one to three samples arriving over steps: after every schedule
    the running sequences and the samples still to fork fit `max_num_seqs`, and a request
    waits only when its samples do not fit (or nothing is left to admit it with)."""
    rng, scheduler = random.Random(seed), _scheduler(max_num_seqs)
    for request_id in range(30):
        for _ in range(rng.randint(0, 2)):
            _add(scheduler, 100 * request_id + _, n=rng.randint(1, 3), length=rng.randint(1, 9))
        plan = scheduler.schedule()
        used = scheduler._num_slots()
        assert used <= max_num_seqs
        if scheduler.waiting:
            head = scheduler.waiting[0]
            assert used + head.request.params.n > max_num_seqs
        if plan:  # decode on: requests finish and free their slots
            scheduler.prepare(plan)
            scheduler.advance(plan)
            scheduler.update_from_output([(seq, rng.randrange(50), None) for seq in plan
                                          if seq.num_computed == len(seq.token_ids)],
                                         frozenset())


def _slots_by_pass(scheduler: Scheduler) -> int:
    """The running sequences and the samples still to fork off them, counted over them."""
    return len(scheduler.running) + sum(
        seq.request.params.n - len(seq.request.samples) for seq in scheduler.running
        if seq.index == 0 and seq.request.params.n > len(seq.request.samples))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), max_num_seqs=st.integers(2, 9))
def test_the_slot_count_is_the_count_over_the_running_sequences(seed, max_num_seqs):
    """Requests of one to three samples arrive, are admitted, forked once their prompt is
    computed (as the engine forks them), decode, finish, are preempted or aborted: after
    every step the scheduler's count (its running sequences alone while no request has
    samples left to fork) is the count over the running sequences."""
    rng, scheduler = random.Random(seed), _scheduler(max_num_seqs)
    requests = []
    for step in range(40):
        if rng.random() < 0.5:
            _add(scheduler, step, n=rng.randint(1, 3), length=rng.randint(1, 9))
            requests.append(scheduler.waiting[-1].request)
        if requests and rng.random() < 0.15:
            scheduler.abort_request(requests.pop(rng.randrange(len(requests))))
        if scheduler.running and rng.random() < 0.1:
            scheduler._preempt(scheduler.running[-1])
        plan = scheduler.schedule()
        assert scheduler._num_slots() == _slots_by_pass(scheduler)
        if not plan:
            continue
        scheduler.prepare(plan)
        scheduler.advance(plan)
        samples = []
        for seq in [seq for seq in plan if seq.num_computed == len(seq.token_ids)]:
            request = seq.request
            if seq.index == 0 and request.params.n > len(request.samples):
                children = [Sequence(request, i, list(seq.token_ids), None)
                            for i in range(1, request.params.n)]
                scheduler.add_children(seq, children)
                samples += [(child, rng.randrange(50), None) for child in children]
            samples.append((seq, rng.randrange(50), None))
        scheduler.update_from_output(samples, frozenset())
        assert scheduler._num_slots() == _slots_by_pass(scheduler)
    assert scheduler._num_slots() == _slots_by_pass(scheduler)
