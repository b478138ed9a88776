"""The count of waiting requests an API server's 429s use (issue 28, item 3): true on an idle
server, exact at the threshold, the same in every API server process, and never left behind
by a request that did not reach the engine core.

End to end through ``paged-kv serve`` (one and two API servers), and on the engine core and
two `CoreClient`s in this process, where which API server sees what is not up to the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from paged_kv.engine import Engine, SamplingParams, TinyLlama
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.limits import EngineLimits
from paged_kv.engine.process.core_client import CoreClient
from paged_kv.engine.process.engine_core import EngineCoreProc

from .test_openai_semantics import CONFIG
from .test_server import httpx, make_prompt, metric, running_server

LONG = 3000  # tokens: a request that runs for seconds, until aborted


def _post(url: str, **body) -> httpx.Response:
    """A completion on a fresh connection (with two API servers, either may take it)."""
    with httpx.Client(timeout=120) as client:
        return client.post(f"{url}/v1/completions", json={"max_tokens": 2, **body})


@contextlib.contextmanager
def _long_stream(url: str, prompt: str):
    """A streamed request that runs until the block exits (the client leaves: aborted);
    yields its status code once the headers arrived (a 200 was admitted past the 429s)."""
    body = {"prompt": prompt, "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as response:
        yield response.status_code


def _until(condition, timeout: float = 30.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _idle(url: str) -> bool:
    return (metric(url, "paged_kv_running_requests") == 0
            and metric(url, "paged_kv_waiting_requests") == 0)


def _api_server_of(port: int, client_port: int, pids: list[int]) -> int:
    """Which of `pids` holds the server side of the connection from `client_port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote = fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]
                if int(local, 16) == port and int(remote, 16) == client_port:
                    inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return pid
    raise AssertionError(f"no API server holds the connection from port {client_port}")


def _raw_post(port: int, body: bytes, pids: list[int]) -> tuple[int, int]:
    """POST a completion on a socket of our own, kept open (alive) until the API server that
    answered is found: (status, that server's pid)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        head = sock.recv(64)
        return int(head.split()[1]), _api_server_of(port, sock.getsockname()[1], pids)


# -- through `paged-kv serve` ---------------------------------------------------------------
@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_max_waiting_zero_serves_an_idle_server(tmp_path, api_servers):
    """README: with ``--max-waiting 0`` none waits, but an idle server still serves (each API
    server's count started at 0 and only a request's own outputs could lower it)."""
    with running_server("--max-waiting", "0", "--api-server-count", api_servers,
                        log=tmp_path / "log") as (_, url):
        statuses = [_post(url, prompt="idle").status_code for _ in range(8)]
        assert statuses == [200] * 8, (statuses, (tmp_path / "log").read_text()[-2000:])


def test_429_threshold_counts_running_and_waiting_exactly(tmp_path):
    """One slot, ``--max-waiting 1``: the running request waits for nothing, so a second is
    admitted (to wait); with one waiting, a third is refused; once both have gone, the
    server serves again."""
    flags = ("--max-num-seqs", "1", "--max-waiting", "1")
    with running_server(*flags, log=tmp_path / "log") as (_, url):
        with _long_stream(url, "first") as first:
            assert first == 200
            assert _until(lambda: metric(url, "paged_kv_running_requests") == 1)
            with _long_stream(url, "second") as second:
                assert second == 200, "a running request is no waiting one"
                refused = _post(url, prompt="third")
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"]
                # OpenAI's rate-limit error, not a bad request (issue 38)
                error = refused.json()["error"]
                assert error["type"] == error["code"] == "rate_limit_exceeded", error
        assert _until(lambda: _idle(url)), "the streams' clients left: both aborted"
        assert _post(url, prompt="after").status_code == 200


def test_requests_that_cannot_reach_the_core_leave_no_count(tmp_path):
    """Stop token ids msgpack cannot carry (>= 2**64) failed after the count was raised, so
    a few of them (the free slots plus `--max-waiting`) turned every later request into a
    429 until restart."""
    flags = ("--max-num-seqs", "2", "--max-waiting", "0")
    with running_server(*flags, log=tmp_path / "log") as (_, url):
        for _ in range(4):
            bad = _post(url, prompt="x", stop_token_ids=[2**64])
            assert bad.status_code in (400, 500), bad.text  # refused, never served
        assert _post(url, prompt="good").status_code == 200
        assert _idle(url)


def test_every_api_server_serves_after_a_burst(tmp_path):
    """Two API servers, a burst of requests through both (some refused), then each API server
    in turn must serve: a server's count came only with its own requests' outputs, so the one
    whose last output counted the other's queue kept refusing on an idle core."""
    flags = ("--api-server-count", "2", "--max-num-seqs", "2", "--max-waiting", "2")
    with running_server(*flags, log=tmp_path / "log") as (proc, url):
        from .test_process_split import _children

        port = int(url.rsplit(":", 1)[1])
        command = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        fronts = [proc.pid] + [pid for pid in _children(proc.pid)
                               if Path(f"/proc/{pid}/cmdline").read_bytes() == command]
        assert len(fronts) == 2, fronts

        def one(i: int) -> int:
            return _post(url, prompt=make_prompt(8, 300 + i), max_tokens=4 + 7 * i,
                         ignore_eos=True).status_code

        for _ in range(3):
            threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        assert _until(lambda: _idle(url))
        served: dict[int, list[int]] = {pid: [] for pid in fronts}
        body = b'{"prompt": "after", "max_tokens": 2}'
        for _ in range(200):  # bounded: stops once each API server has answered 5 times
            status, pid = _raw_post(port, body, fronts)
            served[pid].append(status)
            if all(len(statuses) >= 5 for statuses in served.values()):
                break
        assert all(statuses and set(statuses) == {200} for statuses in served.values()), \
            served


# -- the engine core and two API servers' clients, in this process --------------------------

@contextlib.contextmanager
def core_on_thread(tmp_path: Path, max_num_seqs: int):
    """An `EngineCoreProc` (TinyLlama, `max_num_seqs` running slots) on a thread of this
    process, bound to an ipc address under `tmp_path`; yields (address, engine). On exit it
    drains (finishes what it has, says Bye, returns) and must have stopped."""
    model = TinyLlama(CONFIG, seed=1)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=128, block_size=8),
                                        max_num_seqs=max_num_seqs))
    address = f"ipc://{tmp_path}/core"
    engine_core = EngineCoreProc(engine, address, os.getppid())
    thread = threading.Thread(target=engine_core.run, daemon=True)
    thread.start()
    try:
        yield address, engine
    finally:
        engine_core.drain()
        thread.join(60)
        engine.close()
        assert not thread.is_alive()


@pytest.fixture
def core(tmp_path):
    """An `EngineCoreProc` with one running slot on a thread; yields (address, limits)."""
    with core_on_thread(tmp_path, max_num_seqs=1) as (address, engine):
        yield address, EngineLimits.of(engine)


async def _clients(address: str, limits: EngineLimits, count: int) -> list[CoreClient]:
    never, _ = os.pipe()  # the core runs on a thread here: no process ends
    clients = [CoreClient(address, b"api-%d" % i, limits, never) for i in range(count)]
    for client in clients:
        client.start()
    return clients


async def _settle(clients: list[CoreClient], want: int, timeout: float = 30.0) -> bool:
    """Whether every client's count reaches `want` within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(c.num_waiting == want for c in clients):
            return True
        await asyncio.sleep(0.02)
    return False


def test_every_api_server_hears_the_queue_of_all(core):
    """API server 0's request finishes while API server 1's still waits; once that one is
    done too, both must count an idle engine (-1: one free slot), not 0's last message."""
    address, limits = core

    async def run() -> None:
        clients = await _clients(address, limits, 2)
        done = [asyncio.Event(), asyncio.Event()]
        try:
            assert await _settle(clients, -1), "told the idle engine's count at start"
            for i, (client, tokens) in enumerate(zip(clients, (150, 300), strict=True)):
                await client.add([5, 6, 7], SamplingParams(max_tokens=tokens, ignore_eos=True),
                                 None, lambda out, i=i: out.output and done[i].set())
            assert await _settle(clients, 1), "one runs, one waits: both servers know"
            await asyncio.wait_for(done[0].wait(), 60)
            await asyncio.wait_for(done[1].wait(), 60)
            assert await _settle(clients, -1), [c.num_waiting for c in clients]
        finally:
            for client in clients:
                client.stop()

    asyncio.run(run())


def test_max_waiting_zero_admits_before_the_core_first_speaks(tmp_path):
    """An API server's count starts at an idle engine's (minus its slots), not at 0: with
    ``--max-waiting 0`` a request that comes before the core's first message is admitted
    and served, not refused with 429 until the core speaks (end-to-end tests wait for
    /health, by which time it has spoken; a real client can be faster)."""
    from paged_kv.server import ByteTokenizer
    from paged_kv.server.http.protocol import CompletionRequest
    from paged_kv.server.http.service import OpenAIService

    model = TinyLlama(CONFIG, seed=1)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=128, block_size=8),
                                        max_num_seqs=1))
    address = f"ipc://{tmp_path}/core"

    async def run() -> None:
        (client,) = await _clients(address, EngineLimits.of(engine), 1)  # nothing bound yet
        service = OpenAIService(client, ByteTokenizer(), model_name="tiny", max_waiting=0)
        job = await service.start(CompletionRequest(prompt=[5, 6, 7], max_tokens=2),
                                  [5, 6, 7], None, "text")
        engine_core = EngineCoreProc(engine, address, os.getppid())  # the core comes up
        thread = threading.Thread(target=engine_core.run, daemon=True)
        thread.start()
        try:
            async for _ in job.generation.updates():
                pass
            assert not job.generation.failed and len(job.generation.choices[0].token_ids) == 2
        finally:
            client.stop()
            engine_core.drain()
            await asyncio.to_thread(thread.join, 60)
            engine.close()
        assert not thread.is_alive()

    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_send_that_fails_leaves_no_count(core):
    """A request that fails to encode, or whose send fails, never reached the core: it must
    not be counted (nothing would ever uncount it)."""
    address, limits = core

    async def run() -> None:
        (client,) = await _clients(address, limits, 1)
        try:
            assert await _settle([client], -1)
            with pytest.raises(OverflowError):  # msgpack carries no int >= 2**64
                await client.add([2**64], SamplingParams(max_tokens=2), None, lambda out: None)
            assert client.num_waiting == -1
        finally:
            client.stop()
        with pytest.raises(Exception):  # noqa: B017 (the connection is closed: EngineDeadError)
            await client.add([5], SamplingParams(max_tokens=2), None, lambda out: None)
        assert client.num_waiting == -1

    asyncio.run(run())
