"""Fixtures for the tier stores: real ``redis-server`` processes on free loopback ports."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
START_TIMEOUT_S = 5.0


class RedisServer:
    """One ``redis-server`` bound to 127.0.0.1, persisting nothing; `stop` and `start` keep
    its port, so a store pointed at it sees the same server come back."""

    def __init__(self, directory: Path, maxmemory: str | None, policy: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                     "--save", "", "--appendonly", "no", "--dir", str(directory),
                     "--maxmemory-policy", policy]
        if maxmemory is not None:
            self.args += ["--maxmemory", maxmemory]
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait (bounded) until it answers PING."""
        self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _pings(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(kill=True)
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING "
                                   f"within {START_TIMEOUT_S} s")
            time.sleep(0.02)

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGKILL when `kill`: a crash) and reap it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def redis_servers(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """A factory of `RedisServer` (``maxmemory="4mb"``, ``policy="allkeys-lru"``); every
    server it started is stopped at teardown. Skips without ``redis-server``; fails in CI."""
    if REDIS_SERVER is None:
        _missing("the redis-server binary (not on PATH)")
    if importlib.util.find_spec("redis") is None:
        _missing("the redis client (pip install -e '.[tiers]')")
    started: list[RedisServer] = []

    def start(maxmemory: str | None = None, policy: str = "allkeys-lru") -> RedisServer:
        for attempt in range(3):  # the free port may be taken before the server binds it
            try:
                server = RedisServer(tmp_path / f"redis-{len(started)}-{attempt}", maxmemory,
                                     policy)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _missing(what: str) -> None:
    """Fail in CI (where .ci/run installs everything), skip elsewhere."""
    message = f"the remote tier's tests need {what}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def redis_server(redis_servers: Callable[..., RedisServer]) -> str:
    """The URL of a fresh ``redis-server``: ``redis://127.0.0.1:PORT/0``."""
    return redis_servers().url
