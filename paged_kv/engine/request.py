"""A request and its samples, as the scheduler tracks them (it is their one writer)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch

from .outputs import CompletionOutput, RequestOutput, StepOutput
from .sampling import SamplingParams


class Status(enum.Enum):
    """Where a sample is: waiting to be admitted (or loading its prefix from a tier),
    running, swapped to the host, finished."""

    WAITING = "waiting"
    LOADING = "loading"  # waiting for its prompt's blocks from a lower tier
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt and its `n` samples; owned by the engine."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[Sequence] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    prefix_hit_tokens: int | None = None
    prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(
        default_factory=lambda: [None])  # the first prompt token has none
    salt: str | None = None  # the prefix-cache salt of every sample (tenant isolation)
    error: str | None = None  # why the engine failed it
    # soft retention of its blocks once finished: `PagedKVCache.free`'s keyword arguments
    retain: dict = dataclasses.field(default_factory=dict)
    # its cache report (`misses.CacheReports`): what a tier fetch loaded and how it failed,
    # then the cached tokens by source and the first miss's cause (`Miss.as_dict`)
    fetch_report: tuple[dict[str, int], tuple[str, str] | None] | None = None
    cached_by_source: dict[str, int] | None = None
    miss: dict | None = None
    on_output: Callable[[StepOutput], None] | None = None
    # the hand-off (`paged_kv.handoff`): a prefill engine's request parameters, a decode
    # engine's source of its prompt's pages (a `PeerSource`), the response's parameters
    handoff: Any = None
    peer: Any = None
    kv_transfer_params: dict | None = None
    # the chained keys of its prompt's full blocks under its salt, made once as it arrives
    # (`Scheduler.add`) and read by the device lookup, the tiers and both hand-off roles
    block_keys: list[bytes] = dataclasses.field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples)

    def output(self, now: float) -> RequestOutput:
        """The request as it stands, ended at `finish_time` (or `now` while unfinished)."""
        end = self.finish_time or now
        first = self.first_token_time or end
        latencies = [b - a for s in self.samples
                     for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.samples],
            finished=True,
            prefix_hit_tokens=self.prefix_hit_tokens or 0,
            num_preemptions=sum(s.num_preemptions for s in self.samples),
            time_to_first_token=first - self.arrival_time,
            token_latencies=latencies,
            prompt_logprobs=(list(self.prompt_logprobs)
                             if self.params.prompt_logprobs is not None else None),
            error=self.error,
            cached_by_source=self.cached_by_source,
            miss=self.miss,
            kv_transfer_params=self.kv_transfer_params,
        )


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample: its tokens (prompt + output) and how many are in the cache."""

    request: Request
    index: int
    token_ids: list[int]
    generator: torch.Generator | None
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    token_times: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    fetch: Any = None  # its prompt's blocks being fetched from the tiers (a tiers.Fetch)
    tiered: bool = False  # the tiers were asked for its prompt since it last waited
    # the chained keys of its tokens' full blocks (under its request's salt), computed once
    # at its first admission and extended by the blocks it gained when admitted again
    block_keys: list[bytes] = dataclasses.field(default_factory=list)

    seq_id: tuple[int, int] = dataclasses.field(init=False)  # the cache's name for it
    # its tokens (prompt + `max_tokens` outputs) when it finishes for length
    max_len: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        # read several times a step for every running sample: built once
        self.seq_id = (self.request.request_id, self.index)
        # read by every sample's update (`Scheduler.update_from_output`): worked out once
        self.max_len = len(self.request.prompt_token_ids) + self.request.params.max_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt_token_ids):]

    def completion(self) -> CompletionOutput:
        """This sample as vLLM reports it (log-probabilities only when asked for)."""
        wanted = self.request.params.logprobs is not None
        return CompletionOutput(self.index, self.output_token_ids, self.finish_reason,
                                self.num_preemptions, list(self.logprobs) if wanted else None,
                                self.cumulative_logprob if wanted else None)
