"""Drawing a step's tokens, and cutting a step by request: the pieces the engine uses to
keep one request's failure its own (a failed batched call is retried request by request,
`by_request`)."""

from __future__ import annotations

import itertools
from collections import abc

import torch

from .request import Sequence
from .sampling import sample_rows, token_logprobs

# one sampled token: its sequence, the token, its log-probabilities (when asked for)
Sample = tuple[Sequence, int, dict[int, float] | None]


def draw_rows(logits: torch.Tensor, seqs: abc.Sequence[Sequence],
              rows: abc.Sequence[int] | None = None) -> list[Sample]:
    """One batched `sample_rows` call drawing each of `seqs` from its row of `logits`
    (``rows[i]`` for ``seqs[i]``; None: row i), with each token's log-probabilities when its
    request asks for them."""
    if not seqs:
        return []
    # every row once, in order: the common case needs no copy
    drawn = (logits if rows is None or list(rows) == list(range(len(logits)))
             else logits.index_select(0, torch.tensor(rows)))
    params = [seq.request.params for seq in seqs]
    picked = sample_rows(drawn, params, [seq.generator for seq in seqs])
    if all(p.logprobs is None for p in params):  # the common case: tuples built in C
        return list(zip(seqs, picked, itertools.repeat(None)))
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
