"""Loopback helpers for the workloads: `paged-kv serve` on a free port, a private
``redis-server``, and a TCP proxy that
adds latency (a store "50 ms away") and counts the round trips through it."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

START_TIMEOUT_S = 5.0


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until ``url/health`` answers 200; RuntimeError when `process` exits first or
    `timeout` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited with {process.returncode}")
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def stop_all(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM to every process at once (their shutdowns overlap), then wait for each;
    one not gone within `timeout` is killed."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def serve_process(threads: int, *flags: str) -> Iterator[int]:
    """`paged-kv serve` on a free 127.0.0.1 port with `flags` and `threads` OpenMP threads,
    healthy; yields the port, stops it on exit."""
    import sys

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "paged_kv.cli", "serve", "--port",
                             str(port), *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` on a free 127.0.0.1 port, persisting nothing; `stop` and
    `start` keep its port, so a store pointed at it sees the same server come back.
    FileNotFoundError when the binary is missing; RuntimeError when it does not answer
    PING within `START_TIMEOUT_S`."""

    def __init__(self, directory: str, maxmemory: str | None = None,
                 policy: str = "allkeys-lru") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed "
                                    "(apt-get install redis-server)")
        os.makedirs(directory, exist_ok=True)
        self.port = free_port()
        self.args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(directory),
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


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(maxmemory: str | None = None) -> Iterator[str]:
    """A `RedisServer` in a temporary directory, stopped on exit; yields its URL."""
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(directory, maxmemory)
        try:
            yield server.url
        finally:
            server.stop()


class DelayProxy:
    """Forwards 127.0.0.1:`port` to `target`, holding every chunk `delay_s` in each
    direction (one round trip costs about ``2 * delay_s``, bandwidth is kept)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for sock in (client, upstream):  # no Nagle wait on top of the added delay
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Read chunks as they come and hand them on, stamped; a second thread sends each
        `delay_s` after it arrived, so delays overlap (latency added, bandwidth kept)."""
        chunks: queue.Queue = queue.Queue()
        sender = threading.Thread(target=self._send, args=(chunks, dst), daemon=True)
        sender.start()
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 20):
                chunks.put((time.monotonic() + self.delay_s, chunk))
        chunks.put(None)
        sender.join(timeout=10)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _send(chunks: queue.Queue, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while (item := chunks.get()) is not None:
                due, chunk = item
                time.sleep(max(0.0, due - time.monotonic()))
                dst.sendall(chunk)

    def close(self) -> None:
        self._closed = True
        self._server.close()
