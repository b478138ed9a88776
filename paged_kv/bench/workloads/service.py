"""Workload 6 (``--workloads service``): `paged-kv serve` over loopback against the engine
in-process, on the same requests arriving at the same times.

A load generator streams every request (open loop: Poisson arrivals, no waiting on earlier
replies) at three rates, the last all at once (saturation). The baseline serves the same
requests with the same arrival times through `Engine` in this process, so the ratio is what
the HTTP layer (FastAPI, SSE, the hop to the engine-core process, the client) costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from ..netdelay import free_port, wait_healthy
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, percentile
from ..trace import PromptSpec, UniformLengths, make_prompts

RATE_FRACTIONS = (0.25, 0.5, None)  # of the in-process saturated request rate; None = at once
OUTPUT_LEN = 32
DESCRIPTION = (
    "paged-kv serve (embedded TinyLlama(), default engine flags) on 127.0.0.1, driven by a "
    "load generator in this process (plain HTTP/1.1 on uvloop, connections kept alive): "
    "{num_requests} requests with token-id prompts of 16-128 tokens, {output_len} greedy "
    "tokens each (ignore_eos), streamed; open-loop Poisson arrivals at {rates} requests/s "
    "and all at once. Baseline: the same requests with the same arrival times through Engine "
    "in this process. Time to first token counts from arrival; inter-token latency is the "
    "gap between a request's consecutive tokens (SSE chunks over HTTP).")


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
    from ...serving import SamplingParams

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


class _SSEConnection(asyncio.Protocol):
    """A kept-alive connection streaming one POST at a time: a plain HTTP/1.1 client
    (chunked transfer decoding, a line split per event) that stamps every ``data: {`` event
    with the time its bytes arrived. httpx cost about 0.2 ms of CPU per token here, and on
    2 cores that CPU is taken from the server being measured."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._done: asyncio.Future[bool] | None = None  # True: the server keeps it open
        self._times: list[float] = []
        self._raw = self._body = b""  # received, not de-chunked / de-chunked, not split
        self._head: bytes | None = None  # the response's status line and headers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, times: list[float]) -> asyncio.Future[bool]:
        """Send `request`; the future resolves once its response has ended."""
        self._done = asyncio.get_running_loop().create_future()
        self._times, self._raw, self._body, self._head = times, b"", b"", None
        self.transport.write(request)
        return self._done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._raw += data
        if self._head is None:  # lower-cased once complete
            end = self._raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head, self._raw = self._raw[:end].lower(), self._raw[end + 4:]
            if not self._head.startswith(b"http/1.1 200") or b"chunked" not in self._head:
                self._finish(RuntimeError(f"unexpected response: {self._head[:200]!r}"))
                return
        while (eol := self._raw.find(b"\r\n")) >= 0:
            size = int(self._raw[:eol], 16)
            if len(self._raw) < eol + size + 4:
                break  # the chunk is not all here yet
            self._body += self._raw[eol + 2:eol + 2 + size]
            self._raw = self._raw[eol + size + 4:]
            if size == 0:
                self._finish(b"connection: close" not in self._head)
        lines = self._body.split(b"\n")
        self._body = lines.pop()
        self._times.extend(now for line in lines if line.startswith(b"data: {"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._finish(ConnectionError(f"connection closed mid-response: {exc}"))

    def _finish(self, result: bool | Exception) -> None:
        if self._done is not None and not self._done.done():
            if isinstance(result, Exception):
                self._done.set_exception(result)
            else:
                self._done.set_result(result)


class _Pool:
    """Kept-alive connections to 127.0.0.1:`port`, as an HTTP client pools them; one idle
    longer than `max_idle_s` is closed (uvicorn drops them after 5 s, maybe mid-send)."""

    def __init__(self, port: int, max_idle_s: float = 2.0) -> None:
        self.port, self.max_idle_s = port, max_idle_s
        self._idle: list[_SSEConnection] = []

    async def stream(self, request: bytes, times: list[float]) -> None:
        """Stream one request's response, stamping its events into `times`."""
        connection = self._take()
        if connection is None:
            _, connection = await asyncio.get_running_loop().create_connection(
                _SSEConnection, "127.0.0.1", self.port)
        keep = await connection.send(request, times)
        if keep and connection.transport is not None:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        elif connection.transport is not None:
            connection.transport.close()

    def _take(self) -> _SSEConnection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.transport is not None and (
                    time.monotonic() - connection.idle_since < self.max_idle_s):
                return connection
            if connection.transport is not None:
                connection.transport.close()
        return None

    def close(self) -> None:
        """Close the idle connections."""
        while self._idle:
            connection = self._idle.pop()
            if connection.transport is not None:
                connection.transport.close()


def _post(port: int, path: str, body: dict) -> bytes:
    """An HTTP/1.1 request for `body` as JSON."""
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


async def _stream_one(pool: _Pool, request: bytes, due: asyncio.Future,
                      times: list[float]) -> None:
    await due
    await pool.stream(request, times)


def _release(loop: asyncio.AbstractEventLoop, due: list[asyncio.Future], start: float,
             arrivals: list[float]) -> None:
    """Resolve each of `due` at its arrival: a thread asleep until then, because the event
    loop's timers round to the millisecond (up to 1 ms late, counted against the server)."""
    for i in sorted(range(len(due)), key=arrivals.__getitem__):
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        loop.call_soon_threadsafe(due[i].set_result, None)


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (the server's loop too): less of the client's CPU per event."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def over_http(port: int, prompts: list[list[int]], arrivals: list[float]) -> dict:
    """The same requests, streamed from the server on 127.0.0.1:`port` with open-loop
    arrivals (over connections kept alive within the call, as an HTTP client's pool)."""
    times: list[list[float]] = [[] for _ in prompts]
    requests = [_post(port, "/v1/completions", {
        "prompt": p, "max_tokens": OUTPUT_LEN, "temperature": 0, "stream": True,
        "ignore_eos": True}) for p in prompts]

    async def run() -> float:
        loop, pool = asyncio.get_running_loop(), _Pool(port)
        due = [loop.create_future() for _ in requests]
        start = time.perf_counter()
        clock = threading.Thread(target=_release, args=(loop, due, start, arrivals))
        clock.start()
        try:
            await asyncio.gather(*(_stream_one(pool, r, d, t)
                                   for r, d, t in zip(requests, due, times, strict=True)))
        finally:
            clock.join()
            pool.close()
        return start

    loop = _new_loop()
    try:
        start = loop.run_until_complete(run())
    finally:
        loop.close()
    return _summary(start, arrivals, times)


@contextlib.contextmanager
def _server(threads: int):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "paged_kv.cli", "serve", "--port",
                             str(port), "--max-waiting", "100000"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(scale: Scale) -> WorkloadResult:
    """Three arrival rates over HTTP against the engine in-process."""
    import torch

    from ...server.main import build_engine
    from ...serving import TinyLlama

    num_requests = 24 if scale.name == "quick" else 96
    model = TinyLlama()
    prompts = _requests(num_requests, model.config.vocab_size)

    def engine():
        return build_engine(model, memory_mib=16.0, block_size=16, max_num_seqs=64,
                            max_num_batched_tokens=512, preemption="recompute")

    in_process(engine(), prompts[:4], [0.0] * 4)  # warm-up
    saturated = in_process(engine(), prompts, [0.0] * num_requests)
    request_rate = saturated["throughput"] / OUTPUT_LEN
    rates = [None if f is None else f * request_rate for f in RATE_FRACTIONS]
    results: list[tuple[str, dict, dict]] = []
    with _server(torch.get_num_threads()) as port:
        over_http(port, prompts[:4], [0.0] * 4)  # warm-up
        for rate in rates:
            arrivals = _arrivals(num_requests, rate)
            label = "all at once" if rate is None else f"{rate:.1f} req/s"
            base = saturated if rate is None else in_process(engine(), prompts, arrivals)
            results.append((label, over_http(port, prompts, arrivals), base))
    return _result(results, num_requests, rates)


def _result(results: Sequence[tuple[str, dict, dict]], num_requests: int,
            rates: list[float | None]) -> WorkloadResult:
    figures = []
    for label, http, base in results:
        figures.append(Figure(f"{label}: throughput", Stat((http["throughput"],), "tokens/s"),
                              "engine in-process", Stat((base["throughput"],), "tokens/s"),
                              True))
        for key, name in (("ttft", "time to first token"), ("itl", "inter-token latency")):
            for q in (50, 99):
                figures.append(Figure(
                    f"{label}: {name}, p{q}", Stat((1e3 * percentile(http[key], q),), "ms"),
                    "engine in-process", Stat((1e3 * percentile(base[key], q),), "ms"), False))
    plot = Plot("throughput by arrival rate", "", "generated tokens/s", (
        Series("HTTP (paged-kv serve)", tuple(r[0] for r in results),
               tuple(r[1]["throughput"] for r in results)),
        Series("engine in-process", tuple(r[0] for r in results),
               tuple(r[2]["throughput"] for r in results))), kind="bar")
    rate_text = ", ".join(f"{r:.1f}" for r in rates if r is not None)
    return WorkloadResult(
        key="service", title="6. Service: paged-kv serve over HTTP against the engine in-process",
        description=DESCRIPTION.format(num_requests=num_requests, output_len=OUTPUT_LEN,
                                       rates=rate_text),
        figures=figures, info={"requests": num_requests, "tokens per request": OUTPUT_LEN,
                               "HTTP overhead at saturation (throughput ratio)":
                                   round(results[-1][1]["throughput"]
                                         / results[-1][2]["throughput"], 3)},
        plots=[plot])
