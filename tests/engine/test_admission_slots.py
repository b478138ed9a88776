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
