"""A decode step's state batch (`StateGroup._batch` with ``decode``): where a block fills
at a row's one token, the checkpoint's token is that row's place in the step, read off
the rows' positions kept for the read-only handles instead of the packed-token arithmetic
of any other step. Two caches of full + sliding + state groups take the same decode
steps over rows in a shuffled order (so a row's place differs from its row), one through
`prepare_decode` of row handles, the other through `prepare` of a mapping (the general
path): their batches and bookkeeping agree."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from tests.core.test_decode_forecast import _batch_arrays, _bookkeeping, _cache


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 13), min_size=2, max_size=8),
       steps=st.integers(1, 12), seed=st.integers(0, 1 << 16))
def test_decode_state_batch_matches_the_general_step(lengths, steps, seed):
    shuffle = random.Random(seed)
    pair = (_cache(), _cache())
    for cache in pair:
        for seq, length in enumerate(lengths):
            cache.add_sequence(seq, list(range(seq, seq + length)))
            cache.prepare({seq: list(range(seq, seq + length))})
    order = list(range(len(lengths)))
    emitted = 0
    for step in range(steps):
        if shuffle.random() < 0.3:  # a new running order: new handles
            shuffle.shuffle(order)
        tokens = [100 + 7 * step + seq for seq in order]
        decoded = pair[0].prepare_decode(pair[0].rows_of(order), np.array(tokens))
        general = pair[1].prepare({seq: [token] for seq, token in zip(order, tokens, strict=True)})
        assert _batch_arrays(decoded) == _batch_arrays(general)
        assert _bookkeeping(pair[0]) == _bookkeeping(pair[1])
        emitted += decoded.groups[-1].num_emitted
    if steps >= 4:  # every row filled a block (of 4 tokens) at a decode step's token
        assert emitted >= len(lengths)
