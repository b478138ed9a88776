"""Drawing a step's tokens, and cutting a step by request: the pieces the engine uses to
keep one request's failure its own (a failed batched call is retried request by request,
`by_request`)."""

from __future__ import annotations

import itertools

import torch

from .request import Sequence
from .sampling import sample_rows, token_logprobs

# one sampled token: its sequence, the token, its log-probabilities (when asked for)
Sample = tuple[Sequence, int, dict[int, float] | None]


def draw_rows(logits: torch.Tensor, targets: list[tuple[int, Sequence]]) -> list[Sample]:
    """One batched `sample_rows` call over `targets` (row of `logits`, sample), with each
    token's log-probabilities when its request asks for them."""
    if not targets:
        return []
    rows, seqs = zip(*targets, strict=True)
    # every row once, in order: the common case needs no copy
    drawn = (logits if rows == tuple(range(len(logits)))
             else logits.index_select(0, torch.tensor(rows)))
    params = [seq.request.params for seq in seqs]
    picked = sample_rows(drawn, params, [seq.generator for seq in seqs])
    if all(p.logprobs is None for p in params):  # the common case: tuples built in C
        return list(zip(seqs, picked, itertools.repeat(None)))
    return [(seq, token, None if p.logprobs is None else
             token_logprobs(logits[row], token, p.logprobs))
            for row, seq, token, p in zip(rows, seqs, picked, params, strict=True)]


def by_request(plan: dict[Sequence, int]) -> list[dict[Sequence, int]]:
    """`plan` (samples to token counts or logits rows) cut into one part per request (a
    request's samples stay together), in order."""
    parts: dict[int, dict[Sequence, int]] = {}
    for seq, n in plan.items():
        parts.setdefault(seq.request.request_id, {})[seq] = n
    return list(parts.values())
