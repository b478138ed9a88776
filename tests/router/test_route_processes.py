"""``paged-kv route`` in front of real ``paged-kv serve`` replicas (and sglang-router in front
of the same replicas): every server a subprocess on a free 127.0.0.1 port, every wait
bounded, everything started here stopped at teardown."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from paged_kv.bench.netdelay import free_port, wait_healthy

httpx = pytest.importorskip("httpx")

START_TIMEOUT_S = 90.0
PROMPT = "".join(f"rule {i:02d}: the router sends a prompt where its prefix is cached. "
                 for i in range(8))  # about 540 tokens of the byte tokenizer
KEYS = {"key-one": "one", "key-two": "two"}
SHARED = (len(PROMPT) + 1) // 16 * 16  # the full blocks of PROMPT + " " (block size 16)



def events_flags() -> list[str]:
    """``--kv-events`` and ``--kv-events-replay`` on free ports of their own: the replay's
    default, the next port, may be one another process took (seen in CI: every test of
    the module errored on "Address already in use")."""
    return ["--kv-events", f"tcp://127.0.0.1:{free_port()}",
            "--kv-events-replay", f"tcp://127.0.0.1:{free_port()}"]

class Process:
    """A server subprocess and its log."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen([*argv, "--port", str(self.port)], stdout=out,
                                            stderr=subprocess.STDOUT)

    def wait_healthy(self) -> None:
        try:
            wait_healthy(self.url, self.process, START_TIMEOUT_S)
        except RuntimeError as exc:
            pytest.fail(f"{exc}:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    """Two replicas with events, one without, a router over them and a dead URL."""
    tmp = tmp_path_factory.mktemp("route")
    keys = tmp / "keys"
    keys.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    serve = [sys.executable, "-m", "paged_kv.cli", "serve", "--api-keys", str(keys)]
    started: list[Process] = []
    try:
        replicas = [Process([*serve, *events_flags()], tmp / f"replica{i}.log")
                    for i in range(2)]
        silent = Process(serve, tmp / "silent.log")
        started += [*replicas, silent]
        for process in started:
            process.wait_healthy()
        dead = f"http://127.0.0.1:{free_port()}"
        router = Process([sys.executable, "-m", "paged_kv.cli", "route", "--api-keys",
                          str(keys), "--probe-interval", "0.2",
                          *[a for p in [*replicas, silent] for a in ("--replica", p.url)],
                          "--replica", dead], tmp / "router.log")
        started.append(router)
        router.wait_healthy()
        _until(lambda: _metric(router.url, "paged_kv_router_replica_up") == 3)
        yield {"replicas": replicas, "silent": silent, "router": router, "keys": keys}
    finally:
        for process in started:
            process.stop()


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _complete(url: str, prompt: str, key: str = "key-one", **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "paged-kv-tiny-llama", "prompt": prompt, "max_tokens": 4,
                            "temperature": 0, "ignore_eos": True, **body})


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_replicas_tell_where_their_events_are(cluster):
    info = httpx.get(f"{cluster['replicas'][0].url}/kv_events", timeout=10).json()
    assert info["endpoint"].startswith("tcp://127.0.0.1:") and info["block_size"] == 16
    assert info["replay_endpoint"] and info["hash"].startswith("paged_kv-sha256")
    missing = httpx.get(f"{cluster['silent'].url}/kv_events", timeout=10)
    assert missing.status_code == 404 and "--kv-events" in missing.text


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(cluster):
    router = cluster["router"].url
    before = _metric(router, "paged_kv_router_decisions_total", reason="cache")
    prompt = PROMPT + " first question"
    assert _cached(_complete(router, prompt)) == 0
    for question in ("second", "third", "fourth"):
        assert _cached(_complete(router, PROMPT + f" {question} question")) == SHARED
    assert _metric(router, "paged_kv_router_decisions_total", reason="cache") >= before + 3
    assert _metric(router, "paged_kv_router_in_flight") == 0
    assert _metric(router, "paged_kv_router_index_blocks") > 0


def test_streaming_through_the_router_equals_the_whole_answer(cluster):
    router = cluster["router"].url
    whole = _complete(router, PROMPT + " streamed", max_tokens=8)
    chunks = []
    with httpx.stream("POST", f"{router}/v1/completions", timeout=60,
                      headers={"Authorization": "Bearer key-one"},
                      json={"prompt": PROMPT + " streamed", "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                chunks += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(chunks) == whole.json()["choices"][0]["text"]


def test_tenants_never_share_a_routing_hit(cluster):
    router = cluster["router"].url
    prompt = PROMPT + " tenant question"
    _cached(_complete(router, prompt, key="key-one"))
    _until(lambda: _cached(_complete(router, prompt, key="key-one")) > 0, timeout=10)
    before = _metric(router, "paged_kv_router_decisions_total", reason="cache")
    assert _cached(_complete(router, prompt, key="key-two")) == 0
    after = _metric(router, "paged_kv_router_decisions_total", reason="cache")
    assert after == before, "the other tenant's keys are salted apart: no hit to route by"


def test_the_router_checks_api_keys_and_passes_bad_bodies_to_a_replica(cluster):
    router = cluster["router"].url
    refused = _complete(router, "hi", key="wrong")
    assert refused.status_code == 401 and "API key" in refused.text
    bad = httpx.post(f"{router}/v1/completions", headers={"Authorization": "Bearer key-one"},
                     json={"prompt": "hi", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400, "a replica's own validation answers"
    assert httpx.get(f"{router}/v1/models", timeout=10).status_code == 401
    models = httpx.get(f"{router}/v1/models", headers={"Authorization": "Bearer key-two"},
                       timeout=10)
    assert models.json()["data"][0]["id"] == "paged-kv-tiny-llama"


def test_a_replica_without_events_and_a_dead_url_leave_the_router_serving(cluster):
    router = cluster["router"].url
    health = httpx.get(f"{router}/health", timeout=10).json()
    assert health == {"status": "ok", "replicas_up": 3, "replicas": 4}
    for i in range(6):  # every request succeeds wherever it lands
        assert _complete(router, f"short prompt {i}").status_code == 200
    assert _metric(router, "paged_kv_router_replica_up", replica=cluster["silent"].url) == 1


def test_a_killed_replica_loses_no_request_that_had_not_started(tmp_path):
    serve = [sys.executable, "-m", "paged_kv.cli", "serve"]
    started = []
    try:
        replicas = [Process([*serve, *events_flags()], tmp_path / f"r{i}.log")
                    for i in range(2)]
        started += replicas
        for replica in replicas:
            replica.wait_healthy()
        router = Process([sys.executable, "-m", "paged_kv.cli", "route", "--probe-interval",
                          "5", *[a for r in replicas for a in ("--replica", r.url)]],
                         tmp_path / "router.log")
        started.append(router)
        router.wait_healthy()
        _complete(router.url, PROMPT)
        _until(lambda: _metric(router.url, "paged_kv_router_index_blocks") > 0)
        holder = next(r for r in replicas if _metric(
            router.url, "paged_kv_router_index_blocks", replica=r.url) > 0)
        holder.process.send_signal(signal.SIGKILL)
        holder.process.wait(timeout=10)
        for i in range(4):  # the first goes to the dead holder and is retried elsewhere
            assert _complete(router.url, PROMPT + f" after {i}").status_code == 200
        assert _metric(router.url, "paged_kv_router_retries_total") >= 1
        assert _metric(router.url, "paged_kv_router_replica_up", replica=holder.url) == 0
        assert _metric(router.url, "paged_kv_router_index_blocks", replica=holder.url) == 0
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
    finally:
        for process in started:
            process.stop()


def _lone_router(tmp_path) -> tuple[Process, httpx.Response]:
    """A router whose only replica is a dead URL, once it answers; and its /health."""
    router = Process([sys.executable, "-m", "paged_kv.cli", "route", "--replica",
                      f"http://127.0.0.1:{free_port()}"], tmp_path / "router.log")
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.HTTPError):
            return router, httpx.get(f"{router.url}/health", timeout=1)
        if time.monotonic() > deadline or router.process.poll() is not None:
            router.stop()
            pytest.fail(f"the router did not answer:\n{router.log.read_text()}")
        time.sleep(0.1)


def test_no_replica_up_is_a_503(tmp_path):
    router, health = _lone_router(tmp_path)
    try:
        assert health.status_code == 503
        answer = _complete(router.url, "hi")
        assert answer.status_code == 503 and "no replica" in answer.text
    finally:
        router.stop()


def test_sigterm_stops_the_router_with_exit_0(tmp_path):
    """As ``paged-kv serve`` does after a clean shutdown (uvicorn re-raised the signal:
    143)."""
    router, _ = _lone_router(tmp_path)
    try:
        router.process.send_signal(signal.SIGTERM)
        assert router.process.wait(timeout=30) == 0, router.log.read_text()
    finally:
        router.stop()


def test_a_malformed_replica_url_is_refused_at_start():
    done = subprocess.run([sys.executable, "-m", "paged_kv.cli", "route", "--replica",
                           "localhost:8000"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "expected http://HOST:PORT" in done.stderr


def test_sglang_router_fronts_the_replicas(cluster, tmp_path):
    if importlib_missing("sglang_router"):
        message = "sglang-router is not installed (pip install -e '.[sglang]')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    urls = [r.url for r in cluster["replicas"]]
    sglang = Process([sys.executable, "-m", "sglang_router.launch_router", "--host",
                      "127.0.0.1", "--worker-urls", *urls, "--policy", "cache_aware",
                      "--log-level", "warn", "--prometheus-port", str(free_port())],
                     tmp_path / "sglang.log")
    try:
        sglang.wait_healthy()
        direct = _complete(urls[0], PROMPT + " via sglang", max_tokens=8)
        for _ in range(2):
            through = _complete(sglang.url, PROMPT + " via sglang", max_tokens=8)
            assert through.status_code == 200, through.text
            assert through.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    finally:
        sglang.stop()


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None
