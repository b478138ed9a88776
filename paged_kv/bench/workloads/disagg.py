"""``--workloads disagg``: prefill and decode on different engines against two colocated
replicas, on one machine, and the hand-off wire's bandwidth at 64 KiB pages.

Two setups, each on two engines pinned one CPU core each (the same cores): a prefill
engine and a decode engine behind ``paged-kv route --prefill --decode`` ("disaggregated"),
and two ``both`` replicas behind the cache-aware ``paged-kv route --replica --replica``
("colocated"). One mixed trace through each: short prompts that decode many tokens,
streaming, while long prompts arrive. Reported: the decoding requests' inter-token latency
(p50, p99), time to first token, throughput, the hand-off bandwidth the decode engine
measured (its ``paged_kv_handoff_bytes_total / paged_kv_handoff_seconds_sum``) and its
fallbacks. The wire alone (`wire`): a prefill engine's `HandoffServer` in another process,
pulled from over a reused socket (today's `Channel`) against a fresh socket per get.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np

from ..netdelay import free_port, stop_all, wait_healthy
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, percentile
from .disagg_wire import wire_bandwidth

BLOCK = 32  # tokens per block: a page of the embedded model is 64 KiB
MEMORY_MIB = 64
SECRET = "bench-disagg"
SETUPS = ("disaggregated", "colocated")
DESCRIPTION = (
    "The embedded TinyLlama, --block-size {block} (a 64 KiB page), --memory-mib {mib}, one "
    "OpenMP thread per engine. Disaggregated: `serve --role prefill` pinned to CPU core "
    "{cores[0]} and `serve --role decode` pinned to core {cores[1]} (each with its API "
    "process) behind `route --prefill --decode`; colocated: two `serve` (role both) pinned "
    "to the same cores behind `route --replica --replica` (policy cache, --kv-events); the "
    "routers and the client are not pinned. Trace: {decoders} streaming requests of "
    "{short}-token prompts decoding {decode_tokens} tokens each, started {stagger} s apart, "
    "and {longs} long prompts of {long_lo}-{long_hi} tokens ({long_tokens} tokens each) "
    "arriving every {gap} s from {first} s on, while the others decode. Inter-token latency: "
    "gaps between a decoding request's streamed tokens; TTFT over all requests; "
    "throughput: prompt + generated tokens over the trace's wall time. Hand-off bandwidth: "
    "the decode engine's bytes over its seconds in the transfer (paged_kv_handoff_bytes_total "
    "/ paged_kv_handoff_seconds_sum), during the trace and over {transfers} {long_hi}-token "
    "prompts sent one at a time after it (max_tokens 1); wire: {wire_pages} pages "
    "of 64 KiB pulled 64 per get from a HandoffServer in another process.")


def _shape(scale: Scale) -> dict:
    quick = scale.name == "quick"
    return {"block": BLOCK, "mib": MEMORY_MIB, "cores": _cores(), "short": 64,
            "decoders": 6 if quick else 8, "decode_tokens": 64 if quick else 128,
            "stagger": 0.1, "longs": 4 if quick else 10, "long_lo": 1024, "long_hi": 2048,
            "long_tokens": 8, "gap": 0.4, "first": 0.3, "transfers": 3 if quick else 6,
            "wire_pages": 256 if quick else 1024, "repeats": 1 if quick else 2}


def _cores() -> tuple[int, int]:
    """Two cores of this process's affinity (the same one twice on a single core)."""
    mine = sorted(os.sched_getaffinity(0))
    return mine[0], mine[1 % len(mine)]


def trace(shape: dict, seed: int) -> list[dict]:
    """The requests in arrival order: ``at`` (s), ``prompt`` (token ids), ``max_tokens``,
    ``kind`` (``decode`` or ``long``)."""
    rng = np.random.default_rng(seed)
    out = [{"at": i * shape["stagger"], "kind": "decode", "max_tokens": shape["decode_tokens"],
            "prompt": rng.integers(1, 2000, shape["short"]).tolist()}
           for i in range(shape["decoders"])]
    out += [{"at": shape["first"] + i * shape["gap"], "kind": "long",
             "max_tokens": shape["long_tokens"],
             "prompt": rng.integers(1, 2000, int(rng.integers(shape["long_lo"],
                                                              shape["long_hi"] + 1))).tolist()}
            for i in range(shape["longs"])]
    return sorted(out, key=lambda r: r["at"])


def _pinned(core: int | None):
    return None if core is None else (lambda: os.sched_setaffinity(0, {core}))


@contextlib.contextmanager
def _processes(commands: list[tuple[list[str], int | None]]) -> Iterator[None]:
    """Start each ``(argv, core)`` at once (pinned to `core` unless None; argv names its
    port), yield once each answers /health on it, stop them all."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for argv, core in commands:
            procs.append(subprocess.Popen(argv, env=env, preexec_fn=_pinned(core),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for proc in procs:
            wait_healthy(f"http://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}", proc)
        yield
    finally:
        stop_all(procs)


def _serve(*flags: str) -> list[str]:
    return [sys.executable, "-m", "paged_kv.cli", "serve", "--block-size", str(BLOCK),
            "--memory-mib", str(MEMORY_MIB), "--max-waiting", "100000", *flags]


def _events() -> list[str]:
    return ["--kv-events", f"tcp://127.0.0.1:{free_port()}", "--kv-events-replay", "off"]


@contextlib.contextmanager
def _setup(name: str, cores: tuple[int, int]) -> Iterator[tuple[str, str | None]]:
    """The setup's router URL and (disaggregated) the decode engine's URL; the engines and
    the router start together (the router finds the engines up by its probes)."""
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    if name == "disaggregated":
        secret = ("--handoff-secret", SECRET)
        engines = [_serve("--role", "prefill", *secret, *_events()),
                   _serve("--role", "decode", *secret)]
        flags = ("--prefill", "--decode")
    else:
        engines, flags = [_serve(*_events()), _serve(*_events())], ("--replica", "--replica")
    route = [sys.executable, "-m", "paged_kv.cli", "route", "--probe-interval", "0.2",
             *(a for flag, url in zip(flags, urls, strict=False) for a in (flag, url)),
             *(("--handoff-secret", SECRET) if name == "disaggregated" else ())]
    commands = [([*argv, "--port", str(port)], core)
                for argv, port, core in zip([*engines, route], ports, [*cores, None],
                                            strict=True)]
    with _processes(commands):
        _wait_all_up(urls[2], 2)
        yield urls[2], urls[1] if name == "disaggregated" else None


def _wait_all_up(router: str, count: int, timeout: float = 30.0) -> None:
    """Until the router has seen every replica up (a request before would skip one)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if httpx.get(f"{router}/health", timeout=2).json().get("replicas_up") == count:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{router}: not all {count} replicas up after {timeout:.0f} s")


async def _one(client, url: str, request: dict, start: float, records: list[dict]) -> None:
    await asyncio.sleep(max(0.0, start + request["at"] - time.perf_counter()))
    body = {"prompt": request["prompt"], "max_tokens": request["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, times, usage = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if '"choices": []' in line or '"choices":[]' in line:
                usage = json.loads(line[6:])["usage"]
            else:
                times.append(time.perf_counter())
    records.append({"kind": request["kind"], "ttft": times[0] - sent,
                    "gaps": list(np.diff(times)), "tokens": usage["total_tokens"]})


async def _drive(url: str, requests: list[dict]) -> tuple[list[dict], float]:
    import httpx

    records: list[dict] = []
    limits = httpx.Limits(max_connections=len(requests) + 1)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(_one(client, url, r, start, records) for r in requests))
        return records, time.perf_counter() - start


def metric(url: str, name: str) -> float:
    """The sum of `name`'s samples (every label) on ``url/metrics``."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _counters(decode: str) -> dict[str, float]:
    names = ("handoff_bytes_total", "handoff_seconds_sum", "handoff_fallbacks_total",
             "handoffs_total")
    return {name: metric(decode, f"paged_kv_{name}") for name in names}


def _run_setup(name: str, shape: dict, seed: int) -> dict:
    """The warm-up, the trace, and (disaggregated) `transfers` long prompts one at a time:
    the hand-off counters after each phase."""
    with _setup(name, shape["cores"]) as (router, decode):
        warm = trace({**shape, "decoders": 2, "longs": 1}, 1000 + seed)
        asyncio.run(_drive(router, [{**r, "at": 0.0} for r in warm]))  # first calls out
        counted = [_counters(decode)] if decode else []
        records, wall = asyncio.run(_drive(router, trace(shape, seed)))
        out = {"records": records, "wall": wall}
        if decode is None:
            return out
        counted.append(_counters(decode))
        rng = np.random.default_rng(2000 + seed)
        for _ in range(shape["transfers"]):  # each alone: nothing else runs meanwhile
            prompt = rng.integers(1, 2000, shape["long_hi"]).tolist()
            asyncio.run(_drive(router, [{"at": 0.0, "kind": "transfer", "max_tokens": 1,
                                         "prompt": prompt}]))
        counted.append(_counters(decode))
        return out | {"phases": counted}


def _bandwidth(before: dict, after: dict) -> float:
    """MB/s of the hand-offs between two readings of the counters."""
    nbytes = after["handoff_bytes_total"] - before["handoff_bytes_total"]
    return nbytes / max(after["handoff_seconds_sum"] - before["handoff_seconds_sum"], 1e-9) / 1e6


def _figures_of(run: dict) -> dict:
    decode = [r for r in run["records"] if r["kind"] == "decode"]
    gaps = [g for r in decode for g in r["gaps"]]
    out = {"itl_p99": 1e3 * percentile(gaps, 99), "itl_p50": 1e3 * percentile(gaps, 50),
           "ttft_p50": 1e3 * percentile([r["ttft"] for r in run["records"]], 50),
           "long_ttft_p50": 1e3 * percentile([r["ttft"] for r in run["records"]
                                              if r["kind"] == "long"], 50),
           "throughput": sum(r["tokens"] for r in run["records"]) / run["wall"]}
    if "phases" in run:
        warm, traced, alone = run["phases"]
        out["bandwidth"], out["alone"] = _bandwidth(warm, traced), _bandwidth(traced, alone)
    return out


def run(scale: Scale) -> WorkloadResult:
    """Both setups, alternating over the repeats, then the wire."""
    shape = _shape(scale)
    runs: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for r in range(shape["repeats"]):
        for name in SETUPS:
            runs[name].append(_run_setup(name, shape, seed=r))
    wire = wire_bandwidth(shape["wire_pages"], shape["cores"][0], repeats=3 * shape["repeats"])
    return _result(runs, wire, shape)


def _stat(figures: list[dict], key: str, unit: str) -> Stat:
    return Stat(tuple(f[key] for f in figures), unit)


def _result(runs: dict[str, list[dict]], wire: dict[str, Stat], shape: dict) -> WorkloadResult:
    split, both = ([_figures_of(r) for r in runs[name]] for name in SETUPS)
    rows = (("decode inter-token latency, p99", "itl_p99", "ms", False),
            ("decode inter-token latency, p50", "itl_p50", "ms", False),
            ("time to first token, p50", "ttft_p50", "ms", False),
            ("long prompts' time to first token, p50", "long_ttft_p50", "ms", False),
            ("throughput (prompt + generated tokens)", "throughput", "tokens/s", True))
    figures = [Figure(f"disaggregated: {label}", _stat(split, key, unit), "colocated",
                      _stat(both, key, unit), better) for label, key, unit, better in rows]
    figures += [
        Figure("hand-off wire at 64 KiB pages, reused socket", wire["channel"],
               "a fresh socket per get (before)", wire["fresh"], True),
        Figure("hand-off bandwidth in the engines, during the trace (decode metrics)",
               _stat(split, "bandwidth", "MB/s"), "the wire alone, reused socket",
               wire["channel"], True),
        Figure(f"hand-off bandwidth in the engines, {shape['long_hi']}-token prompts one at "
               "a time", _stat(split, "alone", "MB/s"), "the wire alone, reused socket",
               wire["channel"], True)]
    ends = [r["phases"][-1] for r in runs["disaggregated"]]
    fallbacks = int(sum(end["handoff_fallbacks_total"] for end in ends))
    handoffs = int(sum(end["handoffs_total"] for end in ends))
    itl = tuple(float(np.median([f["itl_p99"] for f in fs])) for fs in (split, both))
    plot = Plot("decode inter-token latency, p99", "", "ms",
                (Series("p99", SETUPS, itl),), kind="bar")
    notes = [] if shape["cores"][0] != shape["cores"][1] else [
        "one CPU core: both engines of a setup shared it"]
    return WorkloadResult(
        key="disagg", title="Disaggregated prefill and decode against colocated replicas",
        description=DESCRIPTION.format(**shape), figures=figures,
        info={"fallbacks (decode engine, all reasons)": fallbacks,
              "hand-offs loaded (decode engine)": handoffs,
              "runs of each (median)": shape["repeats"],
              "inter-token p99 disaggregated / colocated (target <= 0.6)":
              f"{itl[0] / itl[1]:.2f}"},
        plots=[plot], notes=notes)
