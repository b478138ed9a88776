"""Drawing a step's tokens, and cutting a step by request: the pieces the engine uses to
keep one request's failure its own (a failed batched call is retried request by request,
`by_request`)."""

from __future__ import annotations

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
    rows = [row for row, _ in targets]
    # every row once, in order: the common case needs no copy
    drawn = (logits if rows == list(range(len(logits)))
             else logits.index_select(0, torch.tensor(rows)))
    picked = sample_rows(drawn, [t.request.params for _, t in targets],
                         [t.generator for _, t in targets])
    return [(seq, token, None if seq.request.params.logprobs is None else
             token_logprobs(logits[row], token, seq.request.params.logprobs))
            for (row, seq), token in zip(targets, picked, strict=True)]


def by_request(plan: dict[Sequence, int]) -> list[dict[Sequence, int]]:
    """`plan` (samples to token counts or logits rows) cut into one part per request (a
    request's samples stay together), in order."""
    parts: dict[int, dict[Sequence, int]] = {}
    for seq, n in plan.items():
        parts.setdefault(seq.request.request_id, {})[seq] = n
    return list(parts.values())
