"""`SamplingParams` and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import dataclasses
import math
import numbers
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
        Seed of this request's own generator (sample i uses ``seed + i``, modulo 2**64 as
        torch takes seeds), so results do not depend on the batch it runs in; any int in
        ``[-2**63, 2**64)``.
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
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) \
                    or not -2**63 <= self.seed < 2**64:
                raise ValueError(f"SamplingParams.seed: expected None or an int in "
                                 f"[-2**63, 2**64), got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))  # a numpy int would wrap
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos: expected a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """Pick one token from ``logits [vocab]`` as `params` say."""
    return sample_rows(logits[None], [params], [generator])[0]


class Drawn(list):
    """A batch's drawn tokens as `sample_rows` returns them: the list of ints every
    consumer reads, and ``array``, the same tokens as the ``[rows]`` int64 array they were
    drawn into (the argmax's own), so a consumer wanting an array (the scheduler's steady
    carry) need not convert the list back: ~17 us at 1,024 rows, against ~0.4 us for a
    cast. Made once and read only."""

    __slots__ = ("array",)


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                groups: dict[int, list[int]] | None = None) -> Drawn:
    """Pick one token per row of ``logits [rows, vocab]``, row i as ``params[i]`` says
    (`groups`: `sample_groups` of `params` and the vocabulary, when the caller kept it).

    Temperature, top-k and top-p run on all rows at once; each drawn row takes one uniform
    number from its own generator (rows without one share a single draw), so a row's token
    does not depend on the rows beside it. The draw inverts the row's cumulative
    distribution: one small call per seeded row instead of a `torch.multinomial` each.
    Rows with a top-k carry only their k largest candidates past it, in groups of equal k
    (the same arithmetic whatever else is in the batch).
    """
    array = _greedy(logits)
    picked = Drawn(array.tolist())
    if groups is None:
        groups = sample_groups(params, logits.shape[-1])
    for top_k, rows in groups.items():
        tokens = _sample_group(logits, rows, top_k, params, generators)
        for i, token in zip(rows, tokens, strict=True):
            picked[i] = token
        array[rows] = tokens
    picked.array = array
    return picked


def sample_groups(params: Sequence[SamplingParams], vocab: int) -> dict[int, list[int]]:
    """The rows `sample_rows` draws (temperature > 0) by their top-k (0: the whole
    vocabulary of `vocab` tokens), in order; greedy rows are in none."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        if p.temperature != 0:
            groups.setdefault(p.top_k if 0 < p.top_k < vocab else 0, []).append(i)
    return groups


def _sample_group(logits: torch.Tensor, rows: list[int], top_k: int,
                  params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> list[int]:
    """Tokens of `rows`, which share `top_k` (0: none). On the CPU in numpy: a torch op
    costs several times a numpy call on these small arrays (sort: 20x)."""
    chosen = [params[i] for i in rows]
    temperature = [p.temperature for p in chosen]
    top_p = [p.top_p for p in chosen]
    uniform = _uniforms([generators[i] for i in rows])
    if _on_host(logits):
        x = logits[rows].float().numpy()
        return _sample_numpy(x, temperature, top_k, top_p, uniform)
    return _sample_torch(logits[rows].float(), temperature, top_k, top_p, uniform)


def _on_host(logits: torch.Tensor) -> bool:
    """Whether `logits` are sampled in numpy (CPU tensors; tests patch it to run the
    torch path on the CPU)."""
    return logits.device.type == "cpu"


def _uniforms(generators: Sequence[torch.Generator | None]) -> np.ndarray:
    """``[rows]`` float64 in [0, 1): one from each row's generator, torch's global one for
    rows without."""
    uniform = np.empty(len(generators))
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64).numpy()
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator).item()
    return uniform


def _sample_numpy(x: np.ndarray, temperature: list[float], top_k: int, top_p: list[float],
                  uniform: np.ndarray) -> list[int]:
    """The draw of ``x [rows, vocab]`` float32 logits, all in numpy."""
    ids = None  # each column's vocabulary id, once x holds candidates only or is reordered
    if top_k:  # the k largest, in the (row-wise deterministic) order partition leaves them
        ids = np.argpartition(x, -top_k, axis=-1)[:, -top_k:]
        x = np.take_along_axis(x, ids, -1)  # (a temperature > 0 keeps the order: after)
    x = x / np.asarray(temperature, dtype=np.float32)[:, None]
    if any(p < 1 for p in top_p):
        order = np.argsort(-x, axis=-1, kind="stable")
        x = np.take_along_axis(x, order, -1)
        ids = order if ids is None else np.take_along_axis(ids, order, -1)
        weights = np.exp(x - x[:, :1], dtype=np.float64)
        probs = weights / weights.sum(-1, keepdims=True)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= np.asarray(top_p)[:, None]
        drop[:, 0] = False
        x = np.where(drop, -np.inf, x)
    columns = _invert(np.exp(x - x.max(-1, keepdims=True), dtype=np.float64), uniform)
    if ids is not None:
        columns = np.take_along_axis(ids, columns[:, None], -1)[:, 0]
    return columns.tolist()


def _invert(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per row of ``weights [rows, n]`` (float64, >= 0, some > 0): the first column whose
    running sum exceeds ``uniform x total``. Never one of weight 0: the running sum does not
    grow there, and the target stays below the total."""
    cdf = np.cumsum(weights, axis=-1)
    total = cdf[:, -1]
    target = np.minimum(uniform * total, np.nextafter(total, 0))
    return (cdf <= target[:, None]).sum(-1)


def _sample_torch(x: torch.Tensor, temperature: list[float], top_k: int, top_p: list[float],
                  uniform: np.ndarray) -> list[int]:
    """The same draw in torch, where the logits live on an accelerator."""
    x = x / torch.tensor(temperature, device=x.device)[:, None]
    ids = None
    if top_k:
        x, ids = torch.topk(x, top_k)
    if any(p < 1 for p in top_p):
        if ids is None:
            x, ids = x.sort(dim=-1, descending=True, stable=True)
        probs = x.softmax(-1)
        drop = probs.cumsum(-1) - probs >= torch.tensor(top_p, device=x.device)[:, None]
        drop[:, 0] = False
        x = x.masked_fill(drop, float("-inf"))
    weights = (x - x.max(-1, keepdim=True).values).double().exp().cpu().numpy()
    columns = torch.from_numpy(_invert(weights, uniform)).to(x.device)
    if ids is not None:
        columns = ids.gather(-1, columns[:, None])[:, 0]
    return columns.tolist()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The likeliest token of each row of ``logits [rows, vocab]`` (the first on a tie).

    On the CPU numpy's vectorised argmax is 10-30x faster than torch's for these shapes.
    """
    return _greedy(logits).tolist()


def _greedy(logits: torch.Tensor) -> np.ndarray:
    """`greedy_tokens` as a new ``[rows]`` int64 array (the caller's to write)."""
    if _on_host(logits) and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1)
    return logits.argmax(-1).cpu().numpy()


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
    """Sample `index`'s own generator: ``seed + index``, so it equals that seed run alone;
    modulo 2**64, torch's own reading of a seed (a negative seed's sample 1 overflowed
    inside the step that forks the samples, and the engine could no longer step)."""
    if params.temperature == 0:
        return None
    return torch.Generator().manual_seed((seed + index) % 2**64)
