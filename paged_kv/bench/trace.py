"""Seeded synthetic prompts and serving traces: the one source of every workload's requests.

`PromptSpec` says how prompts are drawn (lengths, a shared system prompt, token ids) and
`PromptSource` draws them one by one from a numpy generator, so that a caller can interleave
its own draws (arrival counts, output lengths) and keep its seeded sequence. The demo's
synthetic workload, the allocator and serving traces, the service and the peers workloads all
draw their prompts here.

A trace is saved and loaded as JSON lines (one request per line). Requests arrive over
discrete steps (Poisson arrivals per step); prompt and output lengths are long-tailed
(lognormal, clipped); half of the prompts start with one shared system prompt. Any allocator
can replay the very same trace from the file: each line holds the request's arrival step, its
prompt token ids and how many tokens it generates; the ids of generated tokens are
`output_token_id`, a pure function of the request and position.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class LognormalLengths:
    """Long-tailed token counts: ``int(clip(lognormal(mu, sigma), low, high)) + shift``.

    Examples
    --------
    >>> lengths = LognormalLengths.with_median(150, 0.6, low=8, high=512)
    >>> rng = np.random.default_rng(0)
    >>> all(8 <= lengths.draw(rng) <= 512 for _ in range(100))
    True
    """

    mu: float
    sigma: float
    low: float = 1
    high: float = math.inf
    shift: int = 0  # added after rounding down: the demo's lengths are 1 + a lognormal

    @classmethod
    def with_mean(cls, mean: float, sigma: float = 1.0, **bounds) -> LognormalLengths:
        """Lengths whose lognormal (before clipping) has mean `mean`."""
        return cls(np.log(mean) - sigma**2 / 2, sigma, **bounds)

    @classmethod
    def with_median(cls, median: float, sigma: float, **bounds) -> LognormalLengths:
        """Lengths whose lognormal (before clipping) has median `median`."""
        return cls(np.log(median), sigma, **bounds)

    def draw(self, rng: np.random.Generator, high: float | None = None) -> int:
        """One length, at most `high` as well when given (before `shift`)."""
        limit = self.high if high is None else min(self.high, high)
        return int(np.clip(rng.lognormal(self.mu, self.sigma), self.low, limit)) + self.shift


@dataclasses.dataclass(frozen=True, slots=True)
class UniformLengths:
    """Token counts uniform in ``[low, high]`` (both included)."""

    low: int
    high: int

    def draw(self, rng: np.random.Generator, high: float | None = None) -> int:
        """One length, at most `high` as well when given."""
        limit = self.high if high is None else int(min(self.high, high))
        return int(rng.integers(self.low, limit + 1))


@dataclasses.dataclass(frozen=True, slots=True)
class PromptSpec:
    """How prompts are drawn: their lengths, the shared system prompt, the token ids.

    Parameters
    ----------
    lengths : LognormalLengths or UniformLengths
        The drawn length: of the part after the system prompt, or of the whole prompt when
        `length_counts_system`.
    vocab_size, min_token_id : int
        Token ids are uniform in ``[min_token_id, vocab_size)`` (1: keep 0 for padding).
    system_prompt_len : int
        Tokens of the one system prompt, drawn first.
    shared_fraction : float
        Share of the prompts that start with the system prompt.
    random_share : bool
        Whether a prompt shares it is a uniform draw per prompt; else it goes by index, the
        first and then evenly (every second one at 0.5), without a draw.
    length_counts_system : bool
        The drawn length is the whole prompt's; the part after the system prompt is the rest
        (at least 1 token).
    max_len : int, optional
        The whole prompt's length at most: the part after the system prompt is cut to fit
        (at least 1 token).
    """

    lengths: LognormalLengths | UniformLengths
    vocab_size: int = 32000
    min_token_id: int = 0
    system_prompt_len: int = 0
    shared_fraction: float = 0.0
    random_share: bool = False
    length_counts_system: bool = False
    max_len: int | None = None


class PromptSource:
    """Prompts of a `PromptSpec` drawn one by one from `rng` (the system prompt on creation).

    Examples
    --------
    >>> spec = PromptSpec(UniformLengths(4, 8), system_prompt_len=3, shared_fraction=0.5)
    >>> source = PromptSource(spec, np.random.default_rng(0))
    >>> [source.draw()[1] for _ in range(4)]  # system prompt tokens of each
    [3, 0, 3, 0]
    """

    def __init__(self, spec: PromptSpec, rng: np.random.Generator) -> None:
        self.spec, self._rng, self._count = spec, rng, 0
        self.system = rng.integers(spec.min_token_id, spec.vocab_size,
                                   spec.system_prompt_len).tolist()

    def draw(self) -> tuple[list[int], int]:
        """The next prompt, and how many of its first tokens are the system prompt (0: none)."""
        spec, rng, index = self.spec, self._rng, self._count
        self._count += 1
        if spec.random_share:
            shares = bool(rng.random() < spec.shared_fraction)
        else:  # of the first i prompts, ceil(i * fraction) share
            shares = math.ceil((index + 1) * spec.shared_fraction) > math.ceil(
                index * spec.shared_fraction)
        prefix = self.system if shares else []
        if spec.length_counts_system:
            own = max(1, spec.lengths.draw(rng) - len(prefix))
        else:
            limit = None if spec.max_len is None else max(spec.max_len - len(prefix), 1)
            own = spec.lengths.draw(rng, limit)
        return prefix + rng.integers(spec.min_token_id, spec.vocab_size, own).tolist(), len(prefix)


def make_prompts(spec: PromptSpec, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """`num_prompts` seeded prompts of `spec`.

    Examples
    --------
    >>> prompts = make_prompts(PromptSpec(UniformLengths(16, 128), vocab_size=100), 3)
    >>> len(prompts), all(16 <= len(p) <= 128 for p in prompts)
    (3, True)
    """
    source = PromptSource(spec, np.random.default_rng(seed))
    return [source.draw()[0] for _ in range(num_prompts)]


@dataclasses.dataclass(frozen=True, slots=True)
class TraceSpec:
    """Shape of a synthetic trace; the defaults are the benchmark's serving trace."""

    num_requests: int = 2000
    arrival_rate: float = 2.0        # mean requests arriving per step (Poisson)
    mean_prompt_len: int = 512       # shared system prompt included
    max_prompt_len: int = 4096
    mean_output_len: int = 128
    max_output_len: int = 1024
    system_prompt_len: int = 256
    shared_fraction: float = 0.5     # of the prompts that start with the system prompt
    vocab_size: int = 32000


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: it arrives at `arrival_step`, then generates `output_len` tokens.

    The first `system_prompt_len` tokens of the prompt are the shared system prompt
    (0: none).
    """

    request_id: int
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    output_len: int
    system_prompt_len: int = 0

    @property
    def total_len(self) -> int:
        """Tokens the request holds when it finishes (prompt and output)."""
        return len(self.prompt_token_ids) + self.output_len


def make_trace(spec: TraceSpec = TraceSpec(), seed: int = 0) -> list[TraceRequest]:
    """A seeded trace of ``spec.num_requests`` requests in arrival order.

    Examples
    --------
    >>> trace = make_trace(TraceSpec(num_requests=4, mean_prompt_len=40, system_prompt_len=8))
    >>> [r.request_id for r in trace]
    [0, 1, 2, 3]
    >>> len({r.prompt_token_ids[:8] for r in trace if r.system_prompt_len}) <= 1  # one prefix
    True
    """
    rng = np.random.default_rng(seed)
    # lognormal, sigma 1: median ~0.6 x mean and a long tail; the unique part's mean is set so
    # the prompt (system prompt included for the shared fraction) averages mean_prompt_len
    shared_mean = spec.shared_fraction * spec.system_prompt_len
    unique = LognormalLengths.with_mean(max(spec.mean_prompt_len - shared_mean, 1.0))
    prompts = PromptSource(PromptSpec(
        unique, vocab_size=spec.vocab_size, system_prompt_len=spec.system_prompt_len,
        shared_fraction=spec.shared_fraction, random_share=True,
        max_len=spec.max_prompt_len), rng)
    outputs = LognormalLengths.with_mean(spec.mean_output_len, high=spec.max_output_len)
    requests: list[TraceRequest] = []
    step = 0
    while len(requests) < spec.num_requests:
        for _ in range(int(rng.poisson(spec.arrival_rate))):
            if len(requests) == spec.num_requests:
                break
            prompt, system_len = prompts.draw()
            requests.append(TraceRequest(
                request_id=len(requests), arrival_step=step, prompt_token_ids=tuple(prompt),
                output_len=outputs.draw(rng), system_prompt_len=system_len))
        step += 1
    return requests


def output_token_id(request_id: int, index: int, vocab_size: int = 32000) -> int:
    """Id of the `index`-th generated token of a request (deterministic, so replays agree)."""
    return (request_id * 7919 + index * 104729 + 1) % vocab_size


def scale_trace(trace: Iterable[TraceRequest], factor: int,
                vocab_size: int) -> list[TraceRequest]:
    """The same requests with every length divided by `factor` (at least 1 token each).

    The system prompt is cut to its first ``len // factor`` tokens, so sharing survives;
    token ids are taken modulo `vocab_size`.
    """
    scaled = []
    for r in trace:
        system_len = r.system_prompt_len // factor
        unique = r.prompt_token_ids[r.system_prompt_len:]
        unique = unique[: max(len(unique) // factor, 1)]
        prompt = r.prompt_token_ids[:system_len] + unique
        scaled.append(dataclasses.replace(
            r, prompt_token_ids=tuple(t % vocab_size for t in prompt),
            output_len=max(r.output_len // factor, 1), system_prompt_len=system_len))
    return scaled


def save_trace(trace: Iterable[TraceRequest], path: str | Path) -> None:
    """Write `trace` as JSON lines, one request per line, in arrival order."""
    with open(path, "w", encoding="utf-8") as file:
        for r in trace:
            file.write(json.dumps({"request_id": r.request_id, "arrival_step": r.arrival_step,
                                   "output_len": r.output_len,
                                   "system_prompt_len": r.system_prompt_len,
                                   "prompt_token_ids": list(r.prompt_token_ids)}) + "\n")


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace written by `save_trace`; ValueError naming the line if one is malformed."""
    trace = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
                trace.append(TraceRequest(
                    request_id=int(fields["request_id"]),
                    arrival_step=int(fields["arrival_step"]),
                    prompt_token_ids=tuple(int(t) for t in fields["prompt_token_ids"]),
                    output_len=int(fields["output_len"]),
                    system_prompt_len=int(fields.get("system_prompt_len", 0))))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: not a trace request ({exc})") from None
    return sorted(trace, key=lambda r: (r.arrival_step, r.request_id))


def describe(trace: list[TraceRequest]) -> dict:
    """Summary numbers of a trace (for the report)."""
    prompts = np.array([len(r.prompt_token_ids) for r in trace])
    outputs = np.array([r.output_len for r in trace])
    return {"requests": len(trace), "steps_of_arrivals": trace[-1].arrival_step + 1,
            "prompt_len_mean": float(prompts.mean()), "prompt_len_max": int(prompts.max()),
            "output_len_mean": float(outputs.mean()), "output_len_max": int(outputs.max()),
            "shared_system_prompt": sum(r.system_prompt_len > 0 for r in trace)}
