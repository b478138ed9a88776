"""``--workloads service``: `paged-kv serve` over loopback against the engine
in-process, on the same requests arriving at the same times.

A load generator streams every request (open loop: Poisson arrivals, no waiting on earlier
replies) at three rates, the last all at once (saturation). The baseline serves the same
requests with the same arrival times through `Engine` in this process, so the ratio is what
the HTTP layer (FastAPI, SSE, the hop to the engine-core process, the client) costs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import numpy as np

from ..netdelay import serve_process
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, percentile
from ..trace import PromptSpec, UniformLengths, make_prompts

RATE_FRACTIONS = (0.25, 0.5, None)  # of the in-process saturated request rate; None = at once
OUTPUT_LEN = 32
_JSON = {"Content-Type": "application/json"}
DESCRIPTION = (
    "paged-kv serve (embedded TinyLlama(), default engine flags) on 127.0.0.1, driven by a "
    "load generator in this process (HTTP/1.1 on uvloop, a connection per request opened "
    "beforehand, each request written at its arrival by a thread): "
    "{num_requests} requests with token-id prompts of 16-128 tokens, {output_len} greedy "
    "tokens each (ignore_eos), streamed; open-loop Poisson arrivals at {rates} requests/s "
    "and all at once. Baseline: the same requests with the same arrival times through Engine "
    "in this process. Time to first token counts from arrival; inter-token latency is the "
    "gap between a request's consecutive tokens (SSE chunks over HTTP). Each figure is the "
    "median [min-max] of {repeats} alternating runs of each side.")


def _requests(num_requests: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    return make_prompts(PromptSpec(UniformLengths(16, 128), vocab_size=vocab_size),
                        num_requests, seed)


def _arrivals(num_requests: int, rate: float | None, seed: int = 1) -> list[float]:
    if rate is None:
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1 / rate, num_requests)
    return np.cumsum(gaps).tolist()


def _summary(start: float, arrivals: list[float], times: list[list[float]]) -> dict:
    """Throughput and latencies from each request's token arrival times (absolute)."""
    tokens = sum(len(t) for t in times)
    end = max(t[-1] for t in times)
    return {"throughput": tokens / (end - start),
            "ttft": [t[0] - (start + a) for t, a in zip(times, arrivals, strict=True)],
            "itl": [b - a for t in times for a, b in itertools.pairwise(t)]}


def in_process(engine, prompts: list[list[int]], arrivals: list[float]) -> dict:
    """Serve `prompts` arriving at `arrivals` (seconds from start) through `engine`."""
    from ...engine import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_LEN)
    times: list[list[float]] = [[] for _ in prompts]
    start, next_request = time.perf_counter(), 0
    while next_request < len(prompts) or engine.has_unfinished_requests:
        now = time.perf_counter() - start
        while next_request < len(prompts) and arrivals[next_request] <= now:
            i = next_request
            engine.add_request(prompts[i], params,
                               on_output=lambda out, i=i: out.new_token_ids and times[i].append(
                                   time.perf_counter()))
            next_request += 1
        if engine.has_unfinished_requests:
            engine.step()
        else:
            time.sleep(max(0.0, arrivals[next_request] - now))
    return _summary(start, arrivals, times)


def over_http(port: int, prompts: list[list[int]], arrivals: list[float]) -> dict:
    """The same requests, streamed from the server on 127.0.0.1:`port` with open-loop
    arrivals, each written to the server at its arrival (`service_client`)."""
    from .service_client import request_bytes, stream_all

    _flush_prefix_cache(port)
    requests = [request_bytes(port, "/v1/completions",
                              {"prompt": p, "max_tokens": OUTPUT_LEN, "temperature": 0,
                               "stream": True, "ignore_eos": True}) for p in prompts]
    loop = _new_loop()
    try:
        start, times = loop.run_until_complete(stream_all(port, requests, arrivals))
    finally:
        loop.close()
    return _summary(start, arrivals, times)


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (the server's loop too): less of the client's CPU per event."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _flush_prefix_cache(port: int) -> None:
    """Empty the server's prefix cache (``POST /v1/cache/flush``): the in-process baseline
    starts each run on a fresh engine, and every run sends the same prompts, so a server
    kept across runs would otherwise prefill them from the last run's cached blocks (a
    first token some 3 ms sooner than a cold prefill on this model)."""
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/cache/flush", data=b"{}",
                                     headers=_JSON, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def run(scale: Scale) -> WorkloadResult:
    """Three arrival rates over HTTP against the engine in-process."""
    import torch

    from ...engine import TinyLlama
    from ...engine.process.engine_core import build_engine

    num_requests = 24 if scale.name == "quick" else 96
    model = TinyLlama()
    prompts = _requests(num_requests, model.config.vocab_size)

    def engine():
        return build_engine(model, memory_mib=16.0, block_size=16, max_num_seqs=64,
                            max_num_batched_tokens=512, preemption="recompute")

    in_process(engine(), prompts[:4], [0.0] * 4)  # warm-up
    # one run of either side swings by a third on a shared 2-core machine: each figure is
    # the median of alternating runs, the saturated rate too
    repeats = 1 if scale.name == "quick" else scale.serving_repeats
    saturated = [in_process(engine(), prompts, [0.0] * num_requests)["throughput"]
                 for _ in range(repeats)]
    request_rate = float(np.median(saturated)) / OUTPUT_LEN
    rates = [None if f is None else f * request_rate for f in RATE_FRACTIONS]
    results: list[tuple[str, list[dict], list[dict]]] = []
    with serve_process(torch.get_num_threads(), "--max-waiting", "100000") as port:
        over_http(port, prompts[:4], [0.0] * 4)  # warm-up
        for rate in rates:
            arrivals = _arrivals(num_requests, rate)
            label = "all at once" if rate is None else f"{rate:.1f} req/s"
            runs: tuple[list[dict], list[dict]] = ([], [])
            for _ in range(repeats):
                runs[1].append(in_process(engine(), prompts, arrivals))
                runs[0].append(over_http(port, prompts, arrivals))
            results.append((label, *runs))
    return _result(results, num_requests, rates, repeats)


def _result(results: Sequence[tuple[str, list[dict], list[dict]]], num_requests: int,
            rates: list[float | None], repeats: int) -> WorkloadResult:
    figures = []
    for label, http, base in results:
        figures.append(Figure(f"{label}: throughput",
                              Stat(tuple(h["throughput"] for h in http), "tokens/s"),
                              "engine in-process",
                              Stat(tuple(b["throughput"] for b in base), "tokens/s"), True))
        for key, name in (("ttft", "time to first token"), ("itl", "inter-token latency")):
            for q in (50, 99):
                figures.append(Figure(
                    f"{label}: {name}, p{q}",
                    Stat(tuple(1e3 * percentile(h[key], q) for h in http), "ms"),
                    "engine in-process",
                    Stat(tuple(1e3 * percentile(b[key], q) for b in base), "ms"), False))
    plot = Plot("throughput by arrival rate", "", "generated tokens/s", (
        Series("HTTP (paged-kv serve)", tuple(r[0] for r in results),
               tuple(_median_throughput(r[1]) for r in results)),
        Series("engine in-process", tuple(r[0] for r in results),
               tuple(_median_throughput(r[2]) for r in results))), kind="bar")
    rate_text = ", ".join(f"{r:.1f}" for r in rates if r is not None)
    return WorkloadResult(
        key="service", title="6. Service: paged-kv serve over HTTP against the engine in-process",
        description=DESCRIPTION.format(num_requests=num_requests, output_len=OUTPUT_LEN,
                                       rates=rate_text, repeats=repeats),
        figures=figures, info={"requests": num_requests, "tokens per request": OUTPUT_LEN,
                               "alternating runs of each side per figure (median)": repeats,
                               "HTTP overhead at saturation (throughput ratio)":
                                   round(_median_throughput(results[-1][1])
                                         / _median_throughput(results[-1][2]), 3)},
        plots=[plot])


def _median_throughput(runs: list[dict]) -> float:
    return float(np.median([r["throughput"] for r in runs]))
