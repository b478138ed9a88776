"""`SamplingParams` and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, vLLM's names.

    Parameters
    ----------
    max_tokens : int
        Tokens to generate at most (>= 1).
    temperature : float
        0 means greedy; so does anything below ``GREEDY_BELOW`` (1e-5, vLLM's threshold),
        where dividing the logits would overflow.
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
    logprobs : int, optional
        Per generated token, return the chosen token's log-probability and those of the
        `logprobs` most likely tokens (0: the chosen one only; None: nothing). They are of the
        model's distribution, before temperature, top-k and top-p, as vLLM returns them.
    prompt_logprobs : int, optional
        The same for every prompt token after the first (each predicted from the ones before
        it); such a request computes its whole prompt, reusing no cached prefix.
    ignore_eos : bool
        Keep generating past the model's end-of-sequence tokens (``stop_token_ids`` still
        stop).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: expected an int >= 1, "
                             f"got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name}: expected a finite number, "
                                 f"got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: expected >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            # logits / 1e-40 overflow to inf and the draw fails; vLLM's rule: this is greedy
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: expected >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: expected in (0, 1], got {self.top_p}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n: expected an int >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"SamplingParams.{name}: expected None or an int >= 0, "
                                 f"got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos: expected a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """Pick one token from ``logits [vocab]`` as `params` say."""
    return sample_rows(logits[None], [params], [generator])[0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """Pick one token per row of ``logits [rows, vocab]``, row i as ``params[i]`` says.

    Temperature, top-k and top-p run on all rows at once; only the draw is per row, with the
    row's own generator, so a row's token does not depend on the rows beside it.
    """
    greedy = logits.argmax(-1).tolist()
    hot = [i for i, p in enumerate(params) if p.temperature != 0]
    if not hot:
        return greedy
    chosen = [params[i] for i in hot]
    x = logits[hot].float() / torch.tensor([[p.temperature] for p in chosen])
    top_k = torch.tensor([p.top_k if p.top_k else x.shape[-1] for p in chosen])
    if (top_k < x.shape[-1]).any():
        kth = torch.topk(x, int(top_k.max())).values.gather(-1, (top_k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = torch.tensor([[p.top_p] for p in chosen])
    if (top_p < 1).any():
        sorted_x, order = x.sort(-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)
        drop[:, 0] = False  # the likeliest always stays, even for a top_p float32 rounds to 0
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    for row, i in enumerate(hot):
        greedy[i] = int(torch.multinomial(probs[row], 1, generator=generators[i]))
    return greedy


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> dict[int, float]:
    """Log-probabilities of `token_id` and of the `num_top` most likely tokens.

    Parameters
    ----------
    logits : torch.Tensor
        ``[vocab]`` logits of one position, any float dtype.
    token_id : int
        The token that was chosen.
    num_top : int
        How many of the most likely tokens to add (>= 0).

    Returns
    -------
    dict of int to float
        ``{token_id: logprob, *top}``: the chosen token first, then the top tokens from most to
        least likely (the chosen one appears once, first, when it is among them).

    Examples
    --------
    >>> out = token_logprobs(torch.tensor([0.0, 2.0, 1.0]), token_id=2, num_top=2)
    >>> list(out)  # chosen 2 first, then 1 (most likely); 2 is already in
    [2, 1]
    >>> import math
    >>> round(sum(math.exp(v) for v in out.values()), 2)  # (e^2 + e^1) / (e^0 + e^2 + e^1)
    0.91
    """
    logprobs = logits.float().log_softmax(-1)
    out = {token_id: float(logprobs[token_id])}
    if num_top:
        top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            out.setdefault(index, value)
    return out


def sample_generator(params: SamplingParams, seed: int, index: int) -> torch.Generator | None:
    """Sample `index`'s own generator: ``seed + index``, so it equals that seed run alone."""
    if params.temperature == 0:
        return None
    return torch.Generator().manual_seed(seed + index)
