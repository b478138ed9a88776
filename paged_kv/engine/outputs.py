"""What the engine gives back, vLLM's shapes: per finished request, and per step for
streaming. Plain values; the scheduler and the server import them without the engine."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request: vLLM's ``CompletionOutput`` fields that apply here.

    ``logprobs`` (one dict per generated token, see `token_logprobs`) and
    ``cumulative_logprob`` (the sum of the chosen tokens') are None unless
    ``SamplingParams.logprobs`` asked for them.
    """

    index: int
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_preemptions: int
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request: its `n` samples and what serving it cost.

    ``time_to_first_token`` and ``token_latencies`` (gaps between a sample's consecutive
    tokens) are in seconds. ``prompt_logprobs`` (None for the first prompt token, then one
    `token_logprobs` dict per token) is None unless ``SamplingParams.prompt_logprobs`` asked.
    """

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prefix_hit_tokens: int
    num_preemptions: int
    time_to_first_token: float
    token_latencies: list[float]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # why the engine failed it (finish reason "error")
    # cached prompt tokens by where they came from (device, host, disk, remote), and why
    # the first uncached block missed (`paged_kv.tenants.Miss.as_dict`; None: no miss)
    cached_by_source: dict[str, int] | None = None
    miss: dict | None = None
    # a prefill engine's hand-off parameters (`paged_kv.handoff`: where its pages are leased)
    kv_transfer_params: dict | None = None


class StepOutput(NamedTuple):
    """What one step gave one sample of a request, for streaming.

    ``new_token_ids`` is the token this step appended (empty when the sample only finished,
    e.g. aborted); ``finish_reason`` is set once the sample is done ("stop", "length",
    "abort", or "error" when the engine failed it); ``output`` is the whole `RequestOutput`
    on the request's last step output, with ``prefix_hit_tokens`` (the cached prompt tokens)
    for usage.

    A named tuple, not a frozen dataclass: the engine makes one per sample per step (1,024
    a step at 1,024 running sequences), and a tuple is built in about a third of the time.
    """

    request_id: int
    index: int
    new_token_ids: list[int]
    finish_reason: str | None
    output: RequestOutput | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine at one instant: its queues, preemptions, and the cache's block and prefix
    counters (`Engine.stats`; what metrics, the demo, the server and the bench read)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_live_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int  # from the device pool and every tier below it
    num_loading: int = 0  # waiting for their prompts' blocks from a lower tier
    tiers: Any = None  # tiers.TiersStats when the engine has tiers
    # (tenant, state, blocks), state live / cached / retained (`tenant_stats.tenant_blocks`);
    # tenant "" is requests without a salt, and with a policy the salts it does not name
    tenant_blocks: tuple[tuple[str, str, int], ...] = ()
    # (reason, tenant) -> first uncached blocks that missed for that reason (CacheReports)
    prefix_misses: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    # tenant -> (prompt tokens looked up, found cached), counted at first admission
    tenant_prefix_tokens: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
