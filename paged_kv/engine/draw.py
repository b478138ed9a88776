"""Drawing a step's tokens, and cutting a step by request: the pieces the engine uses to
keep one request's failure its own (a failed batched call is retried request by request,
`by_request`)."""

from __future__ import annotations

import itertools
from collections import abc
from typing import NamedTuple

import numpy as np
import torch

from .request import Sequence
from .sampling import SamplingParams, sample_groups, sample_rows, token_logprobs
from .steady import without

# one sampled token: its sequence, the token, its log-probabilities (when asked for)
Sample = tuple[Sequence, int, dict[int, float] | None]


class Samples(list):
    """A step's samples as `draw_rows` draws them without log-probabilities: the list of
    `Sample` every consumer reads, with the sequences and the tokens kept beside it as
    drawn (`seqs`, `tokens`), so a steady step's carry takes the tokens as they are
    instead of unzipping the tuples again (`SteadyDecode.carry_over`: ~30 us at 1,024
    rows). Made once and read only: the engine hands it to the scheduler and the stream
    as it is, never changed."""

    __slots__ = ("seqs", "tokens")

    @classmethod
    def of(cls, seqs: list[Sequence], tokens: list[int]) -> Samples:
        """``(seqs[i], tokens[i], None)`` for each i, with `seqs` and `tokens` kept."""
        samples = cls(zip(seqs, tokens, itertools.repeat(None)))
        samples.seqs, samples.tokens = seqs, tokens
        return samples


class Setup(NamedTuple):
    """What drawing a batch needs from its sequences (`DrawSetup.of`)."""

    vocab: int
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    plain: bool  # none asks for log-probabilities
    groups: dict[int, list[int]]  # the rows `sample_rows` draws, by top-k (`sample_groups`)
    seeded: list[torch.Generator]  # the generators that are not None, in order


class DrawSetup:
    """What drawing a batch of sequences needs from them (`Setup`), kept for the next
    batch of the same sequences in the same order (a steady decode step draws the same
    running sequences every step), and carried past the sequences that left the batch
    and the new ones behind them (`of`'s ``dropped``: a loaded server's step).

    Valid for the same sequences because `SamplingParams` is frozen and a sequence's
    request and generator never change; the batch is compared by identity, in C.
    """

    def __init__(self) -> None:
        self._seqs: list[Sequence] = []
        self._setup: Setup | None = None

    def of(self, seqs: list[Sequence], vocab: int,
           dropped: tuple[abc.Sequence[Sequence], list[int]] | None = None) -> Setup:
        """The setup of `seqs` drawn from `vocab` tokens: the last one when `seqs` are the
        same sequences in the same order, else made now (and kept).

        ``dropped = (batch, gone)``: `seqs` may be `batch` less the sequences at the
        indexes `gone` (ascending), then others (`SteadyDecode.dropped`). When the last
        setup is `batch`'s, it is cut to match and only the others are read."""
        setup = self._setup
        if setup is not None and setup.vocab == vocab and seqs == self._seqs:
            return setup
        cut = None
        if dropped is not None and setup is not None and setup.vocab == vocab \
                and self._seqs == list(dropped[0]):
            cut = _cut(setup, seqs, *dropped)
        self._setup = cut if cut is not None else _setup_of(seqs, vocab)
        self._seqs = list(seqs)
        return self._setup


def _setup_of(seqs: abc.Sequence[Sequence], vocab: int) -> Setup:
    """The setup of `seqs`, read from each one."""
    params = [seq.request.params for seq in seqs]
    generators = [seq.generator for seq in seqs]
    return Setup(vocab, params, generators, all(p.logprobs is None for p in params),
                 sample_groups(params, vocab), [g for g in generators if g is not None])


def _cut(setup: Setup, seqs: list[Sequence], batch: abc.Sequence[Sequence],
         gone: list[int]) -> Setup | None:
    """`setup` (of `batch`) less the rows at `gone`, then `_setup_of` the sequences of
    `seqs` after those left of `batch`; None when `seqs` does not start with those."""
    count = len(batch) - len(gone)
    if not setup.plain or len(seqs) < count or seqs[:count] != list(without(batch, gone)):
        return None  # (a batch asking for log-probabilities is read again: rare)
    params, generators = list(without(setup.params, gone)), list(without(setup.generators, gone))
    groups = {}
    for top_k, rows in setup.groups.items():  # each row less those gone before it
        left = np.asarray(rows)
        left = left[~np.isin(left, gone)]
        if left.size:
            groups[top_k] = (left - np.searchsorted(gone, left)).tolist()
    seeded = setup.seeded if len(setup.seeded) == 0 else [g for g in generators if g is not None]
    plain = True
    if count < len(seqs):  # the new ones behind
        then = _setup_of(seqs[count:], setup.vocab)
        params, generators = params + then.params, generators + then.generators
        for top_k, rows in then.groups.items():
            groups.setdefault(top_k, []).extend(row + count for row in rows)
        plain, seeded = then.plain, seeded + then.seeded
    # in the order of their first rows, as `sample_groups` makes them: the groups draw in
    # turn from the global generator for their unseeded rows
    groups = dict(sorted(groups.items(), key=lambda group: group[1][0]))
    return Setup(setup.vocab, params, generators, plain, groups, list(seeded))


def draw_rows(logits: torch.Tensor, seqs: abc.Sequence[Sequence],
              rows: abc.Sequence[int] | None = None, setup: Setup | None = None,
              ) -> list[Sample]:
    """One batched `sample_rows` call drawing each of `seqs` from its row of `logits`
    (``rows[i]`` for ``seqs[i]``; None: row i), with each token's log-probabilities when its
    request asks for them (`setup`: theirs, from the caller's `DrawSetup`; else made here)."""
    if not seqs:
        return []
    # every row once, in order: the common case needs no copy
    drawn = (logits if rows is None or list(rows) == list(range(len(logits)))
             else logits.index_select(0, torch.tensor(rows)))
    seqs = seqs if type(seqs) is list else list(seqs)
    if setup is None:
        setup = DrawSetup().of(seqs, logits.shape[-1])
    params, generators, plain, groups = setup[1:5]
    picked = sample_rows(drawn, params, generators, groups)
    if plain:  # the common case: tuples built in C
        return Samples.of(seqs, picked)
    return [(seq, token, None if p.logprobs is None else
             token_logprobs(logits[row], token, p.logprobs))
            for row, seq, token, p in zip(range(len(seqs)) if rows is None else rows, seqs,
                                          picked, params, strict=True)]


def by_request(plan: dict[Sequence, int]) -> list[dict[Sequence, int]]:
    """`plan` (samples to token counts or logits rows) cut into one part per request (a
    request's samples stay together), in order."""
    parts: dict[int, dict[Sequence, int]] = {}
    for seq, n in plan.items():
        parts.setdefault(seq.request.request_id, {})[seq] = n
    return list(parts.values())
