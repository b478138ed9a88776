"""The batched sampler: greedy rows, the draw's distribution, per-row generators."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.engine import sampling
from paged_kv.engine.draw import DrawSetup, draw_rows
from paged_kv.engine.request import Request, Sequence
from paged_kv.engine.sampling import SamplingParams, greedy_tokens, sample_rows


@pytest.fixture(params=["numpy", "torch"], autouse=True)
def path(request, monkeypatch):
    """Every test on both paths: numpy (CPU logits) and torch (accelerators' logits, run
    here on the CPU)."""
    if request.param == "torch":
        monkeypatch.setattr(sampling, "_on_host", lambda logits: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 300), (33, 2048)])
def test_greedy_tokens_equal_torch_argmax(dtype, rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype)
    logits[0, :3] = logits[0].max()  # a tie: the first index wins, as torch's argmax says
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.7),
], ids=["plain", "top_k", "top_p", "top_k+top_p"])
def test_draw_follows_the_filtered_distribution(params):
    """Empirical frequencies of 20,000 seeded draws against the probabilities the params
    leave: every token within 5 standard errors, no token outside the kept set."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(4)) * 1.5
    x = logits / params.temperature
    if params.top_k:
        x = x.masked_fill(x < torch.topk(x, params.top_k).values[-1], float("-inf"))
    probs = x.softmax(-1)
    if params.top_p < 1:
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(-1) - probs[order]
        dropped = order[before >= params.top_p]
        probs[dropped] = 0
        probs /= probs.sum()
    draws = 20_000
    generator = torch.Generator().manual_seed(9)
    rows = sample_rows(logits.expand(draws, -1), [params] * draws, [generator] * draws)
    counts = np.bincount(rows, minlength=12) / draws
    expected = probs.double().numpy()
    assert np.all(counts[expected == 0] == 0)
    spread = np.sqrt(expected * (1 - expected) / draws) + 1e-9
    assert np.all(np.abs(counts - expected) <= 5 * spread), (counts, expected)


def test_a_token_of_probability_zero_is_never_drawn():
    logits = torch.full((64, 50), float("-inf"))
    logits[:, 7] = 0.0  # the one token left
    logits[::2, 49] = -1e4  # a second one that rounds to zero mass after softmax
    params = [SamplingParams(temperature=1.0)] * 64
    assert sample_rows(logits, params, [None] * 64) == [7] * 64


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), hot=st.data(), seed=st.integers(0, 2**31))
def test_a_seeded_row_does_not_depend_on_its_batch(rows, hot, seed):
    """Row 0 with a fresh generator of one seed picks the same token alone and in any batch
    of greedy, unseeded and other seeded rows."""
    logits = torch.randn(rows, 97, generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=seed)]
    generators: list[torch.Generator | None] = [torch.Generator().manual_seed(seed)]
    for i in range(1, rows):
        kind = hot.draw(st.sampled_from(["greedy", "unseeded", "seeded"]))
        params.append(SamplingParams(temperature=0.0 if kind == "greedy" else 1.1))
        generators.append(torch.Generator().manual_seed(i) if kind == "seeded" else None)
    batch = sample_rows(logits, params, generators)
    alone = sample_rows(logits[:1], params[:1], [torch.Generator().manual_seed(seed)])
    assert batch[0] == alone[0]
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert batch[i] == int(logits[i].argmax())


@settings(max_examples=30, deadline=None)
@given(kinds=st.lists(st.sampled_from(["greedy", "sampled", "top-k"]), min_size=1,
                      max_size=12), seed=st.integers(0, 2**31))
def test_the_drawn_array_holds_the_drawn_tokens(kinds, seed):
    """`sample_rows`' tokens come with the same tokens as an int64 array, greedy and drawn
    rows alike (the scheduler's carry takes the array)."""
    logits = torch.randn(len(kinds), 61, generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams() if kind == "greedy" else
              SamplingParams(temperature=1.3, top_k=5 if kind == "top-k" else 0)
              for kind in kinds]
    picked = sample_rows(logits, params, [torch.Generator().manual_seed(seed)] * len(kinds))
    assert picked.array.dtype == np.int64 and picked.array.tolist() == list(picked)


def test_top_k_past_the_vocabulary_keeps_every_token():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_k=5000), SamplingParams(temperature=1.0,
                                                                         top_k=2),
              SamplingParams()]
    picked = sample_rows(logits, params, [torch.Generator().manual_seed(0), None, None])
    assert picked[1] in torch.topk(logits[1], 2).indices.tolist()
    assert picked[2] == int(logits[2].argmax())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_a_kept_draw_setup_draws_as_a_fresh_one(seed):
    """Batches of the same length drawn one after another through one kept `DrawSetup`
    (the same sequences again, reordered, or others with other parameters): each batch's
    tokens and log-probabilities equal a fresh setup's (the same generator states)."""
    rng = np.random.default_rng(seed)
    choices = [SamplingParams(), SamplingParams(temperature=0.9, seed=1),
               SamplingParams(temperature=1.2, top_k=3, seed=2),
               SamplingParams(temperature=0.8, logprobs=2, seed=3)]
    pool = []
    for i in range(8):
        params = choices[int(rng.integers(len(choices)))]
        request = Request(i, [1, 2], params, 0.0)
        generator = None if params.seed is None else torch.Generator().manual_seed(i)
        pool.append(Sequence(request, 0, [1, 2], generator))
    kept = DrawSetup()
    batch = list(rng.choice(8, size=4, replace=False))
    for _ in range(6):
        if rng.random() < 0.5:  # else the same batch again
            batch = list(rng.choice(8, size=4, replace=False))
        seqs = [pool[i] for i in batch]
        logits = torch.from_numpy(rng.standard_normal((4, 40)).astype(np.float32))
        states = [s.generator.get_state() for s in seqs if s.generator is not None]
        fresh = draw_rows(logits, seqs)
        for state, seq in zip(states, [s for s in seqs if s.generator is not None],
                              strict=True):
            seq.generator.set_state(state)
        assert draw_rows(logits, seqs, None, kept.of(seqs, logits.shape[-1])) == fresh
