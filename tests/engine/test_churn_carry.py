"""The steady step's carry outlives a change of the running set: sequences that leave
(finished, aborted, preempted) are dropped from it, and a mixed step's new prompts,
sampled in it, join it. Two schedulers over the same requests, one as it is and one whose
carry never outlives a step (every step's inputs then come from the sequences
themselves), make the same plans, give the model and the cache the same inputs, append
the same tokens, stream the same outputs and finish the same requests, through
arrivals, aborts, stop tokens, lengths, preemptions and forks; and the carry ran."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.config import CacheConfig
from paged_kv.core.cache import PagedKVCache
from paged_kv.engine import SamplingParams
from paged_kv.engine.draw import DrawSetup, Samples
from paged_kv.engine.request import Request, Sequence
from paged_kv.engine.scheduler import Scheduler
from paged_kv.engine.steady import SteadyDecode
from paged_kv.engine.stream import emit_samples

STOP, EOS = 3, 4  # a stop token some requests ask for; the model's end of sequence


class _NoCarry(SteadyDecode):
    """A carry that never reaches the next step: the reference."""

    def carry_over(self, samples) -> None:
        super().carry_over(samples)
        self._carry = None


class _Counted(SteadyDecode):
    """The carry as it is, counting the carries aligned past departures and those made of
    a mixed step (its new prompts joined)."""

    aligned = mixed = 0

    def _align(self, batch):
        carry = super()._align(batch)
        _Counted.aligned += carry is not None and len(batch) > 0
        return carry

    def carry_over(self, samples) -> None:
        super().carry_over(samples)
        _Counted.mixed += self._carry is not None and self._prepared[0] is self._mixed[0]


def _scheduler(reference: bool, num_blocks: int, preemption: str = "recompute") -> Scheduler:
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4,
                                     num_blocks=num_blocks, dtype=torch.float32,
                                     max_num_seqs=8, num_host_blocks=32))
    scheduler = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64,
                          preemption=preemption)
    scheduler.steady = _NoCarry() if reference else _Counted()
    return scheduler


class _Run:
    """One scheduler and what it streamed: (request id, sample index, tokens, finish
    reason, whether the request's output came with it), in order."""

    def __init__(self, reference: bool, num_blocks: int, preemption: str) -> None:
        self.scheduler = _scheduler(reference, num_blocks, preemption)
        self.streamed: list[tuple] = []

    def add(self, request_id: int, prompt: list[int], params: SamplingParams) -> None:
        request = Request(request_id, list(prompt), params, 0.0,
                          on_output=lambda out: self.streamed.append(
                              (out.request_id, out.index, out.new_token_ids,
                               out.finish_reason, out.output is not None)))
        self.scheduler.add(Sequence(request, 0, list(prompt), None))

    def step(self, draws: list[int], drawn: bool) -> tuple:
        """One step; what it planned, the model's and the cache's inputs, the finished."""
        scheduler = self.scheduler
        if not scheduler.has_work:
            return ()
        plan = scheduler.schedule()
        if not plan:
            return ()
        batch = scheduler.prepare(plan)
        inputs = scheduler.step_inputs(plan)
        scheduler.advance(plan)
        seqs = []
        for seq in plan:  # those sampled, and the samples a computed prompt forks, as the
            if seq.num_computed < len(seq.token_ids):  # engine's sampler does
                continue
            seqs.append(seq)
            request = seq.request
            if seq.index == 0 and request.params.n > len(request.samples):
                children = [Sequence(request, i, list(seq.token_ids), None)
                            for i in range(len(request.samples), request.params.n)]
                scheduler.add_children(seq, children)
                seqs += children
        tokens = [draws[(seq.request.request_id * 3 + seq.index + len(seq.token_ids))
                        % len(draws)] for seq in seqs]
        samples = (Samples.of(seqs, tokens) if drawn
                   else [(s, t, None) for s, t in zip(seqs, tokens, strict=True)])
        finished = scheduler.update_from_output(samples, frozenset({EOS}))
        emit_samples(samples, finished, scheduler.steady.outputs(finished))
        return ([(s.seq_id, n) for s, n in plan.items()], inputs.tokens.tolist(),
                inputs.positions.tolist(), batch.slot_mapping.tolist(),
                sorted(r.request_id for r in finished))

    def state(self) -> list:
        scheduler = self.scheduler
        return [(s.seq_id, list(s.token_ids), s.num_computed, s.status,
                 s.request.first_token_time is None)
                for s in (*scheduler.running, *scheduler.waiting, *scheduler.swapped)]


def test_a_carry_kept_through_churn_changes_nothing():
    """Random arrivals (some of two samples, forked when their prompt is computed),
    aborts of running, waiting and swapped requests, steps sampled through `Samples` or a
    plain list; pools of 10 to 24 blocks preempt, by recomputation or by a swap to the host
    pool (a sequence swapped back in joins a mixed step behind the decoding ones). After
    every event both schedulers agree."""
    _Counted.aligned = _Counted.mixed = 0

    @settings(max_examples=150, deadline=None)
    @given(draws=st.lists(st.integers(0, 40), min_size=1, max_size=16),
           events=st.lists(st.sampled_from(("step",) * 6 + ("add",) * 3 + ("abort",)),
                           min_size=5, max_size=50),
           pool=st.sampled_from((10, 14, 24, 256)), swap=st.booleans(), data=st.data())
    def check(draws, events, pool, swap, data):
        runs = [_Run(reference, pool, "swap" if swap else "recompute")
                for reference in (False, True)]
        next_id = 0
        for event in ("add", "add", "add", *events):
            if event == "add":
                length = data.draw(st.integers(1, 14))
                prompt = [(next_id * 7 + i) % 50 + 10 for i in range(length)]
                params = SamplingParams(
                    max_tokens=data.draw(st.integers(1, 20)),
                    stop_token_ids=[STOP] if data.draw(st.booleans()) else (),
                    ignore_eos=data.draw(st.booleans()),
                    n=data.draw(st.sampled_from((1, 1, 1, 2))))
                for run in runs:
                    run.add(next_id, prompt, params)
                next_id += 1
            elif event == "abort":
                live = [*runs[0].scheduler.running, *runs[0].scheduler.waiting,
                        *runs[0].scheduler.swapped]
                if live:
                    victim = data.draw(st.sampled_from(live)).seq_id
                    for run in runs:
                        scheduler = run.scheduler
                        scheduler.abort(next(s for s in (*scheduler.running,
                                                         *scheduler.waiting,
                                                         *scheduler.swapped)
                                             if s.seq_id == victim))
            else:
                drawn = data.draw(st.booleans())
                steps = [run.step(draws, drawn) for run in runs]
                assert steps[0] == steps[1]
            assert runs[0].state() == runs[1].state()
            assert runs[0].streamed == runs[1].streamed
            assert runs[1].scheduler.steady._carry is None

    check()
    assert _Counted.aligned > 20 and _Counted.mixed > 20, (_Counted.aligned, _Counted.mixed)


def test_steps_after_a_departure_and_an_arrival_are_carried():
    """Four requests decode; one is aborted, later one arrives: the step after the abort
    is carried, and so is the mixed step after the arrival (the carry less the aborted),
    and the steps after it (its prompt joined the carry), at the right positions."""
    scheduler = _scheduler(False, 256)
    for request_id in range(4):
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        scheduler.add(Sequence(Request(request_id, [5, 6, 7], params, 0.0), 0, [5, 6, 7],
                               None))
    carried = []
    for step in range(12):
        if step == 4:
            scheduler.abort(scheduler.running[1])  # a departure
        if step == 7:
            params = SamplingParams(max_tokens=30, ignore_eos=True)
            scheduler.add(Sequence(Request(9, [1, 2], params, 0.0), 0, [1, 2], None))
        plan = scheduler.schedule()
        scheduler.prepare(plan)
        scheduler.advance(plan)
        seqs = [seq for seq in plan if seq.num_computed == len(seq.token_ids)]
        scheduler.update_from_output(Samples.of(seqs, [8] * len(seqs)), frozenset())
        carried.append(scheduler.steady.carried)
    # prefill, then carried; the step after the abort and the two after the arrival's
    # mixed step (its prompt joined the carry) carried too
    assert carried == [False, False] + [True] * 10, carried
    assert np.array_equal(scheduler.steady._carry[2],
                          [len(seq.token_ids) - 1 for seq in scheduler.running])


def _carried(n: int) -> tuple[SteadyDecode, tuple]:
    """A `SteadyDecode` holding a carry of `n` stand-in sequences: tokens ``0 .. n-1``,
    positions ten times those, rows a hundred more."""
    steady, seqs = SteadyDecode(), tuple(object() for _ in range(n))
    steady._carry = (seqs, np.arange(n, dtype=np.int32), np.arange(n) * 10,
                     np.arange(n) + 100)
    return steady, seqs


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 12))
def test_departures_anywhere_in_any_order_align(data, n):
    """Sequences leave from any place in any order (each `left` at its index then): the
    carry is what is left of it, each entry still beside its sequence."""
    steady, seqs = _carried(n)
    running = list(seqs)
    for _ in range(data.draw(st.integers(1, n))):
        index = data.draw(st.integers(0, len(running) - 1))
        del running[index]
        steady.left(index)
    assert steady.start(tuple(running), 1 << 20) == bool(running)
    if running:
        kept = [seqs.index(seq) for seq in running]
        carry = steady._carry
        assert carry[0] == tuple(running)
        assert carry[1].tolist() == kept and carry[2].tolist() == [10 * i for i in kept]
        assert steady.rows.tolist() == [100 + i for i in kept]


def test_a_running_list_changed_otherwise_drops_the_carry():
    """One sequence left (told) and another took a place (not told: as a fork would): the
    count matches, the sequences do not, and the carry is dropped, not misread."""
    steady, seqs = _carried(3)
    steady.left(1)
    assert not steady.start((seqs[0], object()), 1 << 20)
    assert steady._carry is None
    steady, seqs = _carried(3)
    assert not steady.start((seqs[0], seqs[2]), 1 << 20)  # nobody told it seqs[1] left
    assert steady._carry is None


def _sample_seq(request_id: int, data) -> Sequence:
    """A sequence of random sampling parameters: greedy or not, a top-k or not, seeded or
    not, asking for log-probabilities or not."""
    temperature = data.draw(st.sampled_from((0.0, 0.0, 0.7)))
    params = SamplingParams(max_tokens=4, temperature=temperature,
                            top_k=data.draw(st.sampled_from((0, 0, 3, 5))),
                            logprobs=data.draw(st.sampled_from((None, None, None, 1))))
    generator = torch.Generator().manual_seed(request_id) if data.draw(st.booleans()) else None
    return Sequence(Request(request_id, [1, 2], params, 0.0), 0, [1, 2], generator)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), new=st.integers(0, 3))
def test_the_sampler_setup_cut_past_departures_is_made_afresh(data, n, new):
    """`DrawSetup.of` with ``dropped``: the last batch's setup less the rows that left,
    then the new sequences' (a mixed step's prompts), is the setup made from the
    sequences afresh, field by field and its groups in the same order (they draw in turn
    from the global generator)."""
    batch = [_sample_seq(i, data) for i in range(n)]
    gone = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    seqs = [seq for i, seq in enumerate(batch) if i not in gone]
    seqs += [_sample_seq(100 + i, data) for i in range(new)]
    kept = DrawSetup()
    kept.of(batch, 16)
    setup = kept.of(seqs, 16, (tuple(batch), gone))
    fresh = DrawSetup().of(seqs, 16)
    assert setup.plain == fresh.plain and setup.vocab == fresh.vocab
    assert setup.params == fresh.params
    assert all(a is b for a, b in zip(setup.generators, fresh.generators, strict=True))
    assert list(setup.groups.items()) == list(fresh.groups.items())
    assert all(a is b for a, b in zip(setup.seeded, fresh.seeded, strict=True))
    assert len(setup.seeded) == len(fresh.seeded)


def test_the_sampler_setup_is_cut_not_made_again():
    """A plain batch less one sequence, with one new one behind: the kept setup is cut
    (the new one's parameters read alone), not made from every sequence again."""
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=3)
    batch = [Sequence(Request(i, [1], params, 0.0), 0, [1], None) for i in range(4)]
    kept = DrawSetup()
    kept.of(batch, 16)
    newcomer = Sequence(Request(9, [1], SamplingParams(max_tokens=4), 0.0), 0, [1], None)
    for seq in batch:  # read again, they would fail: they are not
        seq.request.params = None
    setup = kept.of([batch[0], batch[2], batch[3], newcomer], 16, (tuple(batch), [1]))
    assert setup.groups == {3: [0, 1, 2]} and setup.params[:3] == [params] * 3
    assert setup.params[3] is newcomer.request.params


def test_the_cut_setup_keeps_the_groups_in_order_of_their_first_rows():
    """Rows of top-k 0, 3, 0; the first leaves: the top-k 3 group now comes first, as a
    setup made afresh orders it (the groups draw in turn from the global generator)."""
    batch = [Sequence(Request(i, [1], SamplingParams(max_tokens=4, temperature=0.7,
                                                     top_k=k), 0.0), 0, [1], None)
             for i, k in enumerate((0, 3, 0))]
    kept = DrawSetup()
    kept.of(batch, 16)
    setup = kept.of(batch[1:], 16, (tuple(batch), [0]))
    assert list(setup.groups.items()) == [(3, [0]), (0, [1])]


def test_a_sequence_swapped_back_in_joins_the_carry():
    """A decoding sequence swapped out between steps (as a preemption does) leaves the
    carry; swapped back in by the next schedule, it joins that mixed step behind the
    decoding ones, is carried from then on, and every step matches a scheduler that
    never carries."""
    runs = [_Run(reference, 256, "swap") for reference in (False, True)]
    for request_id in range(3):
        for run in runs:
            run.add(request_id, [5, 6, 7, 8, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    carried = []
    for step in range(9):
        if step == 3:
            for run in runs:  # the last running sequence, swapped to the host pool
                run.scheduler._preempt(run.scheduler.running[-1])
                assert run.scheduler.swapped
        steps = [run.step([11, 12, 13], drawn=True) for run in runs]
        assert steps[0] == steps[1]
        assert runs[0].state() == runs[1].state() and runs[0].streamed == runs[1].streamed
        carried.append(runs[0].scheduler.steady.carried)
    # prefill, a decode step, then carried: after the swap-out, through the mixed step
    # that swapped it in, and after it
    assert carried == [False, False] + [True] * 7, carried
    assert not runs[0].scheduler.swapped and len(runs[0].scheduler.running) == 3
