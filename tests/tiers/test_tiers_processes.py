"""Cache tiers across processes: ``paged-kv serve`` replicas share blocks through one Redis,
and a server restarted on the same ``--kv-disk`` directory finds the blocks it wrote.

Each server is a real subprocess (``python -m paged_kv.cli serve``, the embedded TinyLlama and
its byte tokenizer: one token per byte) on a free 127.0.0.1 port; every wait is bounded and
the fixture kills whatever is still running at teardown. A prompt sent again, to another
process, comes back with ``usage.prompt_tokens_details.cached_tokens`` covering its full
blocks and the same greedy completion, token for token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_kv.bench import netdelay
from paged_kv.bench.netdelay import free_port

from ..conftest import ROOT

httpx = pytest.importorskip("httpx")
redis = pytest.importorskip("redis")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

BLOCK_SIZE = 16  # serve's default --block-size
START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 60.0
# 600 bytes, so 600 tokens: 37 full blocks before the block of the last token
PROMPT = "".join(f"line {i:03d}: the paged cache keeps its blocks below the device. "
                 for i in range(10))[:600]
CACHED = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE


@dataclasses.dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def wait_healthy(self) -> None:
        """Wait (bounded) until /health answers 200; fail with the log if it exits first."""
        try:
            netdelay.wait_healthy(self.url, self.process, START_TIMEOUT_S)
        except RuntimeError as exc:
            pytest.fail(f"{exc}:\n{self.log.read_text()}")

    def stop(self) -> int:
        """SIGTERM, then wait (bounded) for a clean exit; its exit code."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            pytest.fail(f"server did not exit on SIGTERM:\n{self.log.read_text()}")

    def complete(self, prompt: str) -> dict:
        """A greedy completion of 8 tokens (EOS ignored), with the token ids."""
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body,
                              timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture
def serve_processes(tmp_path):
    """``start(*flags)``: a `Server` running ``paged-kv serve`` with `flags` on a free port
    (not yet waited for); every one still running at teardown is killed and reaped."""
    servers: list[Server] = []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def start(*flags: str) -> Server:
        port = free_port()
        log = tmp_path / f"serve-{len(servers)}.log"
        with open(log, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "paged_kv.cli", "serve", "--port", str(port), *flags],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        servers.append(Server(process, f"http://127.0.0.1:{port}", log))
        return servers[-1]

    yield start
    for server in servers:
        if server.process.poll() is None:
            server.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=10)


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def same_completion(a: dict, b: dict) -> bool:
    (first,), (second,) = a["choices"], b["choices"]
    return (first["token_ids"], first["text"]) == (second["token_ids"], second["text"])


def test_two_replicas_share_blocks_through_redis(redis_server, serve_processes):
    first = serve_processes("--kv-remote", redis_server)
    second = serve_processes("--kv-remote", redis_server)
    first.wait_healthy()
    second.wait_healthy()
    admin = redis.Redis.from_url(redis_server, socket_timeout=5)

    computed = first.complete(PROMPT)
    assert computed["usage"]["prompt_tokens"] == len(PROMPT)
    assert cached_tokens(computed) == 0
    assert len(computed["choices"][0]["token_ids"]) == 8
    deadline = time.monotonic() + 10  # the writes are in the background: bounded wait
    while admin.dbsize() < CACHED // BLOCK_SIZE:
        assert time.monotonic() < deadline, f"only {admin.dbsize()} blocks reached Redis"
        time.sleep(0.05)

    fetched = second.complete(PROMPT)
    assert cached_tokens(fetched) == CACHED, second.log.read_text()
    assert same_completion(fetched, computed)
    admin.close()


def test_a_restarted_server_finds_its_blocks_on_disk(tmp_path, serve_processes):
    flags = ("--kv-disk", str(tmp_path / "blocks"), "--kv-disk-mib", "64")
    server = serve_processes(*flags)
    server.wait_healthy()
    computed = server.complete(PROMPT)
    assert cached_tokens(computed) == 0
    assert server.stop() == 0  # a clean stop writes the queued blocks down first
    files = [name for _, _, names in os.walk(tmp_path / "blocks") for name in names]
    assert len(files) >= CACHED // BLOCK_SIZE

    restarted = serve_processes(*flags)
    restarted.wait_healthy()
    fetched = restarted.complete(PROMPT)
    assert cached_tokens(fetched) == CACHED, restarted.log.read_text()
    assert same_completion(fetched, computed)


def test_a_second_server_on_a_disk_directory_in_use_exits_2(tmp_path, serve_processes):
    directory = tmp_path / "blocks"
    flags = ("--kv-disk", str(directory), "--kv-disk-mib", "64")
    first = serve_processes(*flags)
    first.wait_healthy()
    second = serve_processes(*flags)
    try:
        code = second.process.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the second server started:\n{second.log.read_text()}")
    log = second.log.read_text()
    assert code == 2, log
    assert f"{str(directory)!r} is in use by another disk tier" in log, log
    assert "Traceback" not in log.split("paged-kv serve: error:")[-1], log
    # the first server goes on serving from its directory
    assert cached_tokens(first.complete(PROMPT)) == 0
    assert cached_tokens(first.complete(PROMPT)) == CACHED
