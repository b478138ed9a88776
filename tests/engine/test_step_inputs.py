"""The model's inputs of a steady decode step, made from the scheduler's token array, are
the inputs the general path makes from the plan; and the engine streams each step's
samples as if each had been updated and emitted in turn."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.config import CacheConfig, LayerKind
from paged_kv.core.cache import PagedKVCache
from paged_kv.engine import SamplingParams, StepOutput, TinyLlamaConfig
from paged_kv.engine.inputs import StepInputs
from paged_kv.engine.request import Request, Sequence
from paged_kv.engine.scheduler import Scheduler
from paged_kv.engine.steady import SteadyDecode

from ..conftest import make_engine
from .conftest import prompt

CONFIG = TinyLlamaConfig(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         hidden_size=64, intermediate_size=128, vocab_size=300)
LAYOUTS = {"full": (), "full+sliding": (LayerKind(), LayerKind.sliding(8))}


def _scheduler(layout: str, num_blocks: int) -> Scheduler:
    kinds = LAYOUTS[layout]
    cache = PagedKVCache(CacheConfig(num_layers=max(len(kinds), 1), num_kv_heads=1, head_dim=2,
                                     block_size=4, num_blocks=num_blocks, dtype=torch.float32,
                                     max_num_seqs=8, layer_kinds=kinds))
    return Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=24, preemption="recompute")


def _same(fast: StepInputs, slow: StepInputs) -> None:
    assert torch.equal(fast.tokens, slow.tokens)
    assert torch.equal(fast.positions, slow.positions)
    assert torch.equal(fast.logits_rows, slow.logits_rows)
    assert fast.sampled == slow.sampled and fast.prompt_rows == slow.prompt_rows


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), layout=st.sampled_from(sorted(LAYOUTS)),
       num_blocks=st.integers(14, 40))
def test_steady_decode_inputs_match_the_general_path(seed, layout, num_blocks):
    _compare_steps(seed, layout, num_blocks)


def test_mixed_steps_were_compared():
    """The random schedules above include mixed steps (running sequences decoding while a
    new prompt is prefilled), made through `prepare_decode` with counts and `StepInputs.joined`."""
    assert sum(_compare_steps(seed, layout, 24) for seed in range(4)
               for layout in sorted(LAYOUTS)) > 0


def _compare_steps(seed: int, layout: str, num_blocks: int) -> int:
    """Random prompts arriving over time, chunked prefills, finishes, aborts and preemptions
    (small pools): every step's inputs from `step_inputs` equal `StepInputs.of` of the plan,
    and the steady decode path is taken, with its arrays carried from the step before (so
    the test compares something); returns how many mixed steps it made."""
    rng = random.Random(seed)
    scheduler, steady, carried, mixed = _scheduler(layout, num_blocks), [], [], []
    made, joined = StepInputs.decode, StepInputs.joined
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepInputs, "decode",
                      staticmethod(lambda *a: steady.append(1) or made(*a)))
        patch.setattr(StepInputs, "joined",
                      staticmethod(lambda *a: mixed.append(1) or joined(*a)))
        for request_id in range(40):
            if rng.random() < 0.3 or request_id < 3:
                params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
                tokens = [rng.randrange(300) for _ in range(rng.randint(1, 20))]
                scheduler.add(Sequence(Request(request_id, tokens, params, 0.0), 0, tokens,
                                       None))
            if scheduler.running and rng.random() < 0.1:  # a client's abort between steps
                scheduler.abort(rng.choice(scheduler.running))
            plan = scheduler.schedule()
            if not plan:
                continue
            carried.append(scheduler.steady.carried)
            scheduler.prepare(plan)
            # a general plan's inputs come from its preparation's pass: made before the
            # cache's step, compared after it
            _same(scheduler.step_inputs(plan), StepInputs.of(plan))
            scheduler.advance(plan)
            samples = [(seq, rng.randrange(300), None) for seq in plan
                       if seq.num_computed == len(seq.token_ids)]
            scheduler.update_from_output(samples, frozenset())
            scheduler.cache.check()
            tables = scheduler.cache.tables
            for seq in scheduler.running:  # the cache holds the tokens the sequences computed
                row = scheduler.cache.rows_of([seq.seq_id])[0]
                assert tables.num_tokens[row] == seq.num_computed, seq.seq_id
                assert tables.token_ids[row, :seq.num_computed].tolist() == \
                    seq.token_ids[:seq.num_computed], seq.seq_id
    assert steady or not scheduler.has_work, "no steady decode step was compared"
    assert any(carried) or not steady, "no steady step was carried from the one before"
    return len(mixed)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_general_inputs_are_each_plans_tokens_in_order(data):
    """`StepInputs.of` of a random plan mixing decoding sequences (one token), prefill
    chunks and sequences catching up: each sequence's tokens and positions from its
    computed count, packed in the plan's order; the caught-up ones sampled at their last
    token's row (a plain reference built token by token)."""
    plan, tokens, positions, rows, sampled = {}, [], [], [], []
    for request_id in range(data.draw(st.integers(1, 12))):
        ids = data.draw(st.lists(st.integers(0, 299), min_size=1, max_size=12))
        seq = Sequence(Request(request_id, ids, SamplingParams(max_tokens=4), 0.0), 0,
                       list(ids), None)
        seq.num_computed = data.draw(st.integers(0, len(ids) - 1))
        n = data.draw(st.integers(1, len(ids) - seq.num_computed))
        plan[seq] = n
        for position in range(seq.num_computed, seq.num_computed + n):
            tokens.append(ids[position])
            positions.append(position)
        if seq.num_computed + n == len(ids):
            rows.append(len(tokens) - 1)
            sampled.append(seq)
    inputs = StepInputs.of(plan)
    assert inputs.tokens.tolist() == tokens and inputs.positions.tolist() == positions
    assert inputs.logits_rows.tolist() == rows and inputs.sampled == sampled
    assert inputs.prompt_rows == []
    # the cache's mapping made in the same pass: each sequence's tokens to compute
    new_tokens: dict = {}
    _same(StepInputs.of(plan, new_tokens), inputs)
    assert new_tokens == {seq.seq_id: seq.token_ids[seq.num_computed: seq.num_computed + n]
                          for seq, n in plan.items()}
    assert list(new_tokens) == [seq.seq_id for seq in plan]


def test_decode_inputs_are_positions_and_last_tokens():
    """Two sequences caught up but for one token: their last tokens at their positions,
    every row sampled, no prompt rows."""
    scheduler = _scheduler("full", 32)
    for request_id, tokens in enumerate(([5, 6, 7], [8, 9])):
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        scheduler.add(Sequence(Request(request_id, tokens, params, 0.0), 0, list(tokens), None))
    plan = scheduler.schedule()
    scheduler.prepare(plan)
    scheduler.advance(plan)
    scheduler.update_from_output([(seq, 40 + seq.request.request_id, None) for seq in plan],
                                 frozenset())
    plan = scheduler.schedule()
    scheduler.prepare(plan)
    inputs = scheduler.step_inputs(plan)
    assert inputs.tokens.tolist() == [40, 41] and inputs.positions.tolist() == [3, 2]
    assert inputs.logits_rows.tolist() == [0, 1] and inputs.sampled == list(plan)
    assert inputs.prompt_rows == []


def _drive(scheduler: Scheduler, seed: int, eos: frozenset[int]) -> list[tuple]:
    """Random arrivals (random stop tokens, EOS or not, lengths), aborts and steps with
    random samples from a small vocabulary; what each step finished and every sequence's
    state after it."""
    rng, seqs, record = random.Random(seed), [], []
    for request_id in range(40):
        if rng.random() < 0.3 or request_id < 3:
            params = SamplingParams(max_tokens=rng.randint(1, 12),
                                    ignore_eos=rng.random() < 0.5,
                                    stop_token_ids=tuple(rng.sample(range(12), rng.randint(0, 2))))
            tokens = [rng.randrange(12) for _ in range(rng.randint(1, 20))]
            seqs.append(Sequence(Request(request_id, tokens, params, 0.0), 0, tokens, None))
            scheduler.add(seqs[-1])
        if scheduler.running and rng.random() < 0.05:
            scheduler.abort(rng.choice(scheduler.running))
        plan = scheduler.schedule()
        if plan:
            scheduler.prepare(plan)
            scheduler.advance(plan)
            samples = [(seq, rng.randrange(12), None) for seq in plan
                       if seq.num_computed == len(seq.token_ids)]
            finished = scheduler.update_from_output(samples, eos)
            record.append(([r.request_id for r in finished],
                           [(s.seq_id, list(s.token_ids), len(s.token_times), s.finish_reason,
                             s.request.first_token_time is not None) for s in seqs]))
    return record


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), eos=st.sampled_from([frozenset(), frozenset({3}),
                                                         frozenset({3, 7})]))
def test_carried_appends_finish_as_the_general_path(seed, eos):
    """The same random arrivals, samples, stop tokens, EOS and aborts through a scheduler
    whose carried steps append in C and one that appends every step in Python: the same
    finished requests each step, the same tokens, token times and finish reasons."""
    fast = _drive(_scheduler("full", 40), seed, eos)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SteadyDecode, "append", lambda *a: None)
        slow = _drive(_scheduler("full", 40), seed, eos)
    assert fast == slow


def _steady_pair(scheduler: Scheduler) -> list[Sequence]:
    """Two requests admitted, prefilled and decoded once: the next plan is steady and its
    arrays carried from the step before."""
    for request_id, tokens in enumerate(([5, 6, 7], [8, 9])):
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        scheduler.add(Sequence(Request(request_id, tokens, params, 0.0), 0, list(tokens), None))
    for step in range(2):
        plan = scheduler.schedule()
        scheduler.prepare(plan)
        scheduler.advance(plan)
        scheduler.update_from_output([(seq, 40 + 10 * step + seq.request.request_id, None)
                                      for seq in plan], frozenset())
    return list(scheduler.running)


def test_carry_follows_the_running_sequences_not_their_count():
    """A running sequence aborted and another's sample forked in between (same count, other
    sequences): the next step's inputs are the running ones', not the carried arrays."""
    scheduler = _scheduler("full", 32)
    first, second = _steady_pair(scheduler)
    scheduler.abort(first)
    child = Sequence(second.request, 1, list(second.token_ids), None)
    scheduler.add_children(second, [child])
    plan = scheduler.schedule()
    assert list(plan) == [second, child] and not scheduler.steady.carried
    scheduler.prepare(plan)
    _same(scheduler.step_inputs(plan), StepInputs.of(plan))
    assert scheduler.step_inputs(plan).tokens.tolist() == [51, 51]


def test_carried_step_has_the_sampled_tokens_at_the_next_positions():
    """A steady step after a steady step: the carried arrays are each sequence's last
    sample at its computed count."""
    scheduler = _scheduler("full", 32)
    _steady_pair(scheduler)
    plan = scheduler.schedule()
    assert scheduler.steady.carried
    scheduler.prepare(plan)
    inputs = scheduler.step_inputs(plan)
    assert inputs.tokens.tolist() == [50, 51] and inputs.positions.tolist() == [4, 3]


@pytest.mark.parametrize("n", [1, 3])
def test_each_request_gets_one_final_output_on_its_last_sample(model, n):
    """Samples of one request finishing in the same step (``max_tokens``) or apart (a stop
    token): the request's whole output rides on its last step output, exactly once, and
    after every token of every sample."""
    engine = make_engine(model, num_blocks=64, block_size=8)
    streams: dict[int, list[StepOutput]] = {}
    for seed, params in enumerate([SamplingParams(max_tokens=6, n=n, temperature=1.0, seed=3),
                                   SamplingParams(max_tokens=9, n=n, temperature=1.0, seed=5,
                                                  stop_token_ids=tuple(range(0, 300, 7)))]):
        engine.add_request(prompt(11 + seed, seed, CONFIG.vocab_size), params,
                           on_output=lambda out: streams.setdefault(out.request_id, []).append(out))
    while engine.has_unfinished_requests:
        engine.step()
    for outs in streams.values():
        finals = [o for o in outs if o.output is not None]
        assert len(finals) == 1 and finals[0] is outs[-1]
        assert {o.index for o in outs if o.finish_reason} == set(range(n))
        for completion in finals[0].output.outputs:
            mine = [t for o in outs if o.index == completion.index for t in o.new_token_ids]
            assert mine == completion.token_ids


def _streams(model, silent: int | None, plain: bool, used: list[bool]) -> dict[int, list]:
    """Five requests decoding together, finishing apart (lengths, a stop token), request
    `silent` without a listener: each listener's outputs, with carried steps' plain
    outputs handed over in C (`plain`) or every sample emitted in Python; `used` gets
    whether each step's outputs went the C way."""
    engine = make_engine(model, num_blocks=64, block_size=8)
    streams: dict[int, list[tuple]] = {}

    def keep(out: StepOutput) -> None:
        streams.setdefault(out.request_id, []).append(
            (out.index, out.new_token_ids, out.finish_reason, out.output is not None))

    for i in range(5):
        params = SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True,
                                stop_token_ids=(7,) if i == 4 else ())
        engine.add_request(prompt(5 + i, i, CONFIG.vocab_size), params,
                           on_output=None if i == silent else keep)
    made = SteadyDecode.outputs

    def outputs(self, finished):
        out = made(self, finished)
        used.append(out is not None)
        return out if plain else None

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SteadyDecode, "outputs", outputs)
        while engine.has_unfinished_requests:
            engine.step()
    return streams


@pytest.mark.parametrize("silent", [None, 2])
def test_plain_outputs_stream_as_the_general_path(model, silent):
    """Every listener gets the same outputs whether carried steps hand them over in C or
    each sample is emitted in Python, and the C path ran."""
    used: list[bool] = []
    fast = _streams(model, silent, True, used)
    assert any(used), "no step's outputs went the C way"
    assert fast == _streams(model, silent, False, [])
    assert all(outs[-1][3] for outs in fast.values())  # each ends with its request output


def _prompt_rows_reference(plan: dict[Sequence, int]) -> list[tuple]:
    """Every prompt position a plan computes whose log-probabilities are asked for and not
    recorded, row by row over the whole plan (the pass before it was folded into `of`)."""
    rows, offset = [], 0
    for seq, n in plan.items():
        request = seq.request
        if request.params.prompt_logprobs is not None and seq.index == 0:
            recorded = len(request.prompt_logprobs) - 1
            for position in range(seq.num_computed, seq.num_computed + n):
                if position >= recorded and position + 1 < len(request.prompt_token_ids):
                    rows.append((request, offset + position - seq.num_computed,
                                 request.prompt_token_ids[position + 1]))
        offset += n
    return rows


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_prompt_logprob_rows_are_found_in_the_inputs_pass(data):
    """Random plans of prompts asking for prompt log-probabilities or not, some already
    recorded in part (a recomputation), in chunks of one token or more, decoding
    sequences, and forked samples: the prompt rows `of` finds in its pass are those of a
    token-by-token pass over every sequence of the plan, and they follow the sampled rows."""
    plan = {}
    for request_id in range(data.draw(st.integers(1, 10))):
        prompt_ids = data.draw(st.lists(st.integers(0, 299), min_size=1, max_size=10))
        outputs = data.draw(st.lists(st.integers(0, 299), max_size=4))
        params = SamplingParams(max_tokens=8, prompt_logprobs=data.draw(
            st.sampled_from([None, 0, 2])))
        request = Request(request_id, prompt_ids, params, 0.0)
        request.prompt_logprobs = [None] * data.draw(st.integers(0, len(prompt_ids)))
        seq = Sequence(request, data.draw(st.integers(0, 1)), prompt_ids + outputs, None)
        seq.num_computed = data.draw(st.integers(0, len(seq.token_ids) - 1))
        plan[seq] = data.draw(st.integers(1, len(seq.token_ids) - seq.num_computed))
    inputs = StepInputs.of(plan)
    assert inputs.prompt_rows == _prompt_rows_reference(plan)
    rows = [row for _, row, _ in inputs.prompt_rows]
    assert inputs.logits_rows.tolist() == inputs.logits_rows.tolist()[:len(inputs.sampled)] + rows
