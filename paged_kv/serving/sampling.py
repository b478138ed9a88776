"""`SamplingParams` and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
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

    Temperature, top-k and top-p run on all rows at once; each drawn row takes one uniform
    number from its own generator (rows without one share a single draw), so a row's token
    does not depend on the rows beside it. The draw inverts the row's cumulative
    distribution: one small call per seeded row instead of a `torch.multinomial` each.
    Rows with a top-k carry only their k largest candidates past it, in groups of equal k
    (the same arithmetic whatever else is in the batch).
    """
    picked = greedy_tokens(logits)
    vocab = logits.shape[-1]
    groups: dict[int, list[int]] = {}  # top-k (0: the whole vocabulary) -> rows
    for i, p in enumerate(params):
        if p.temperature != 0:
            groups.setdefault(p.top_k if 0 < p.top_k < vocab else 0, []).append(i)
    for top_k, rows in groups.items():
        for i, token in zip(rows, _sample_group(logits, rows, top_k, params, generators),
                            strict=True):
            picked[i] = token
    return picked


def _sample_group(logits: torch.Tensor, rows: list[int], top_k: int,
                  params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> list[int]:
    """Tokens of `rows`, which share `top_k` (0: none)."""
    chosen = [params[i] for i in rows]
    x = logits[rows].float() / torch.tensor([[p.temperature] for p in chosen])
    ids = None  # each column's vocabulary id, once x holds the top-k candidates only
    if top_k:
        x, ids = _candidates(x, top_k)
    top_p = [p.top_p for p in chosen]
    if any(p < 1 for p in top_p):
        x = _keep_top_p(x, torch.tensor(top_p)[:, None], presorted=ids is not None)
    columns = _draw(x.softmax(-1), [generators[i] for i in rows])
    if ids is None:
        return columns
    return ids.gather(-1, torch.tensor(columns)[:, None]).flatten().tolist()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The likeliest token of each row of ``logits [rows, vocab]`` (the first on a tie).

    On the CPU numpy's vectorised argmax is 10-30x faster than torch's for these shapes.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def _candidates(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest of each row of `x`, largest first, and their columns:
    ``[rows, count]`` each (on the CPU by numpy's partition, cheaper than `torch.topk`)."""
    if x.device.type != "cpu":
        return torch.topk(x, count)
    values = x.numpy()
    columns = np.argpartition(-values, count - 1, axis=-1)[:, :count]
    kept = np.take_along_axis(values, columns, -1)
    order = np.argsort(-kept, axis=-1, kind="stable")
    return (torch.from_numpy(np.take_along_axis(kept, order, -1)),
            torch.from_numpy(np.take_along_axis(columns, order, -1)))


def _keep_top_p(x: torch.Tensor, top_p: torch.Tensor, presorted: bool = False) -> torch.Tensor:
    """`x` with each row's tail beyond its ``top_p [rows, 1]`` probability mass masked
    (`presorted`: each row of `x` is already in descending order)."""
    sorted_x, order = (x, None) if presorted else x.sort(-1, descending=True)
    probs = sorted_x.softmax(-1)
    # drop a token when the ones before it already reach top_p (the first always stays)
    drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)
    drop[:, 0] = False  # the likeliest always stays, even for a top_p float32 rounds to 0
    kept = sorted_x.masked_fill(drop, float("-inf"))
    return kept if order is None else x.scatter(-1, order, kept)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``probs [rows, vocab]`` by inverting its cumulative sum at a
    uniform number from the row's generator (float64, so no rounding picks a token of
    probability 0: the first index whose running sum exceeds u x total has mass)."""
    uniform = torch.empty(len(generators), 1, dtype=torch.float64)
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).flatten().tolist()


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
