"""Loopback helpers for the tiers workload: a private ``redis-server``, and a TCP proxy that
adds latency (a store "50 ms away") and counts the round trips through it."""

from __future__ import annotations

import contextlib
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def redis_server(maxmemory: str | None = None) -> Iterator[str]:
    """A ``redis-server`` on a free loopback port, persisting nothing, stopped on exit;
    yields its URL. FileNotFoundError when the binary is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", directory, "--maxmemory-policy", "allkeys-lru"]
        if maxmemory:
            args += ["--maxmemory", maxmemory]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(
                        ("127.0.0.1", port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


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
