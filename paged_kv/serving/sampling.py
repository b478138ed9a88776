"""`SamplingParams` and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, vLLM's names.

    Parameters
    ----------
    max_tokens : int
        Tokens to generate at most (>= 1).
    temperature : float
        0 means greedy.
    top_k : int
        Keep the k most likely tokens (0 = all).
    top_p : float
        Keep the smallest set of tokens whose probability reaches top_p (1.0 = all).
    seed : int, optional
        Seed of this request's own generator (sample i uses ``seed + i``), so results do not
        depend on the batch it runs in.
    n : int
        Samples per prompt; they share the prompt's blocks.
    stop_token_ids : tuple of int
        Finishing tokens (kept in the output).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: expected an int >= 1, "
                             f"got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: expected >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: expected >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: expected in (0, 1], got {self.top_p}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n: expected an int >= 1, got {self.n!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """Pick one token from ``logits [vocab]`` as `params` say."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop[0] = False  # the likeliest always stays, even for a top_p float32 rounds to 0
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
