"""A seeded synthetic serving trace, saved and loaded as JSON lines (one request per line).

Requests arrive over discrete steps (Poisson arrivals per step); prompt and output lengths
are long-tailed (lognormal, clipped); half of the prompts start with one shared system
prompt. Any allocator can replay the very same trace from the file: each line holds the
request's arrival step, its prompt token ids and how many tokens it generates; the ids of
generated tokens are `output_token_id`, a pure function of the request and position.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np


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
    system = rng.integers(0, spec.vocab_size, spec.system_prompt_len).tolist()
    # lognormal, sigma 1: median ~0.6 x mean and a long tail; the unique part's mean is set so
    # the prompt (system prompt included for the shared fraction) averages mean_prompt_len
    shared_mean = spec.shared_fraction * spec.system_prompt_len
    unique_mean = max(spec.mean_prompt_len - shared_mean, 1.0)
    requests, step = [], 0
    while len(requests) < spec.num_requests:
        for _ in range(int(rng.poisson(spec.arrival_rate))):
            if len(requests) == spec.num_requests:
                break
            shares = bool(rng.random() < spec.shared_fraction)
            prefix = system if shares else []
            limit = max(spec.max_prompt_len - len(prefix), 1)
            unique_len = _lognormal_int(rng, unique_mean, limit)
            prompt = prefix + rng.integers(0, spec.vocab_size, unique_len).tolist()
            requests.append(TraceRequest(
                request_id=len(requests), arrival_step=step, prompt_token_ids=tuple(prompt),
                output_len=_lognormal_int(rng, spec.mean_output_len, spec.max_output_len),
                system_prompt_len=len(prefix)))
        step += 1
    return requests


def _lognormal_int(rng: np.random.Generator, mean: float, limit: int) -> int:
    return int(np.clip(rng.lognormal(np.log(mean) - 0.5, 1.0), 1, limit))


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
