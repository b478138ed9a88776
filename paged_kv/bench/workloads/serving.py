"""``--workloads serving``: the engine on the paged cache against the same engine on a
contiguous cache.

Contiguous max-length preallocation is emulated by a cache whose block is the longest
request of the workload (each sequence then reserves one max-length slab) with prefix
caching off. Both pools get the same bytes for sequences. All requests are queued at once
(offline throughput, as vLLM's throughput benchmark), so time to first token includes
queueing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, percentile
from ..trace import TraceRequest, scale_trace

BLOCK_SIZE = 16
SLABS = 8  # the memory budget: this many max-length sequences
PAGED, CONTIGUOUS = "paged cache", "contiguous max-length cache"
DESCRIPTION = (
    "paged_kv.engine.Engine with TinyLlama on the trace's first {num_requests} requests, every "
    "length divided by {factor} (system prompt included), greedy, all queued at once. Same KV "
    "budget for both: {slabs} max-length sequences ({budget} token slots). Paged: block size "
    "{block_size}, prefix caching on. Contiguous max-length preallocation: block size = the "
    "longest request ({max_len} tokens), prefix caching off, so each sequence reserves one "
    "slab. Throughput counts tokens over wall time; time to first token includes time queued; "
    "per-token latency is the gap between a request's consecutive tokens.")
METRICS = [  # name, value of one run, unit, higher is better
    ("throughput, generated tokens", lambda r: r.throughput, "tokens/s", True),
    ("throughput, prompt + generated tokens", lambda r: r.total_throughput, "tokens/s", True),
    ("requests running at once, mean", lambda r: statistics.fmean(r.running), "seqs", True),
    ("requests running at once, max", lambda r: max(r.running), "seqs", True),
    ("time to first token, median", lambda r: 1e3 * percentile(r.ttft, 50), "ms", False),
    ("time to first token, p99", lambda r: 1e3 * percentile(r.ttft, 99), "ms", False),
    ("per-token latency, median", lambda r: 1e3 * percentile(r.token_latencies, 50), "ms",
     False),
    ("per-token latency, p99", lambda r: 1e3 * percentile(r.token_latencies, 99), "ms", False),
]


@dataclasses.dataclass(frozen=True, slots=True)
class ServingRun:
    """One engine run: throughput, concurrency per step, latencies (seconds)."""

    throughput: float
    total_throughput: float
    running: tuple[int, ...]
    ttft: tuple[float, ...]
    token_latencies: tuple[float, ...]
    num_preemptions: int
    prefix_hit_tokens: int


def serve(model, requests: Sequence[TraceRequest], *, paged: bool,
          budget_tokens: int, max_len: int) -> ServingRun:
    """Serve `requests` (greedy, their output lengths) on a fresh engine."""
    if paged:
        config = model.cache_config(num_blocks=budget_tokens // BLOCK_SIZE + 1,
                                    block_size=BLOCK_SIZE)
    else:
        config = model.cache_config(num_blocks=budget_tokens // max_len + 1,
                                    block_size=max_len, enable_prefix_caching=False)
    return serve_config(model, config, requests)[0]


def serve_config(model, config, requests: Sequence[TraceRequest]) -> tuple[ServingRun, list]:
    """Serve `requests` (greedy, their output lengths) on a fresh engine over `config`; the
    run's figures and the outputs in request order."""
    from ...engine import Engine  # the serve extra: imported when used
    from ...engine.config import EngineConfig

    engine = Engine(model, EngineConfig(cache=config, max_num_seqs=256))
    outputs, running, elapsed = run_to_completion(engine, requests)
    outputs.sort(key=lambda out: out.request_id)
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    prompts = sum(len(r.prompt_token_ids) for r in requests)
    run = ServingRun(generated / elapsed, (generated + prompts) / elapsed, tuple(running),
                     tuple(out.time_to_first_token for out in outputs),
                     tuple(x for out in outputs for x in out.token_latencies),
                     engine.stats().num_preemptions,
                     sum(out.prefix_hit_tokens for out in outputs))
    return run, outputs


def run_to_completion(engine, requests: Sequence[TraceRequest]) -> tuple[list, list[int], float]:
    """Queue `requests` on `engine` and step until all finish: the outputs (in finishing
    order), the sequences running at each step, and the seconds the steps took."""
    from ...engine import SamplingParams  # the serve extra: imported when used

    for r in requests:
        engine.add_request(list(r.prompt_token_ids), SamplingParams(max_tokens=r.output_len))
    outputs, running = [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests:
        outputs += engine.step()
        running.append(engine.stats().num_running)
    return outputs, running, time.perf_counter() - start


def served_model(scale: Scale, trace: Sequence[TraceRequest], **shape,
                 ) -> tuple[object, list[TraceRequest], int]:
    """The serving workloads' TinyLlama at `scale` (seed 0; `shape` sets its heads), the
    first ``scale.serving_requests`` requests with lengths divided by ``scale.serving_scale``,
    and the longest one's total length."""
    from ...engine import TinyLlama, TinyLlamaConfig

    config = TinyLlamaConfig(num_layers=scale.serving_layers, hidden_size=scale.serving_hidden,
                             intermediate_size=2 * scale.serving_hidden, **shape)
    requests = scale_trace(trace[:scale.serving_requests], scale.serving_scale,
                           config.vocab_size)
    return TinyLlama(config, seed=0), requests, max(r.total_len for r in requests)


def run(scale: Scale, trace: Sequence[TraceRequest]) -> WorkloadResult:
    """Both engines on the first ``scale.serving_requests`` requests, lengths scaled down."""
    model, requests, max_len = served_model(scale, trace)
    budget = SLABS * max_len
    serve(model, requests[:2], paged=True, budget_tokens=budget, max_len=max_len)  # warm-up
    runs: dict[str, list[ServingRun]] = {PAGED: [], CONTIGUOUS: []}
    for _ in range(scale.serving_repeats):
        for name in runs:
            runs[name].append(serve(model, requests, paged=name == PAGED, budget_tokens=budget,
                                    max_len=max_len))
    return _result(scale, requests, runs, budget, max_len, model.config)


def stat_of(runs: list[ServingRun], metric, unit: str) -> Stat:
    """One figure's `Stat` over repeated runs."""
    return Stat(tuple(metric(r) for r in runs), unit)


def _result(scale: Scale, requests: list[TraceRequest], runs: dict[str, list[ServingRun]],
            budget: int, max_len: int, config) -> WorkloadResult:
    figures = [Figure(name, stat_of(runs[PAGED], metric, unit), CONTIGUOUS,
                      stat_of(runs[CONTIGUOUS], metric, unit), higher)
               for name, metric, unit, higher in METRICS]
    plot = Plot("requests running at each engine step (last repeat)", "engine step",
                "requests running",
                tuple(Series(name, tuple(range(len(r[-1].running))), r[-1].running)
                      for name, r in runs.items()), kind="line")
    bars = Plot("throughput", "", "tokens/s", tuple(
        Series(name, ("generated", "prompt + generated"),
               (statistics.median(r.throughput for r in rs),
                statistics.median(r.total_throughput for r in rs)))
        for name, rs in runs.items()), kind="bar")
    last = runs[PAGED][-1]
    info = {"requests": len(requests),
            "prompt tokens": sum(len(r.prompt_token_ids) for r in requests),
            "generated tokens": sum(r.output_len for r in requests),
            "longest request (tokens)": max_len, "KV budget (token slots)": budget,
            "model": f"TinyLlama {config.num_layers} layers, hidden {config.hidden_size}, "
                     f"{config.num_kv_heads} KV heads x {config.head_dim}, float32",
            "paged: prefix hit tokens": last.prefix_hit_tokens,
            "paged: preemptions": last.num_preemptions}
    return WorkloadResult(
        key="serving", title="5. Serving: the engine on paged against contiguous KV memory",
        description=DESCRIPTION.format(num_requests=len(requests), factor=scale.serving_scale,
                                       slabs=SLABS, budget=budget, block_size=BLOCK_SIZE,
                                       max_len=max_len),
        figures=figures, info=info, plots=[plot, bars])
