"""Helpers for the end-to-end hand-off tests: ``paged-kv serve`` / ``paged-kv route``
processes started together (`Processes`), a misbehaving HTTP proxy in front of a prefill
replica (`PrefillProxy`) and a misbehaving ZMQ peer in front of a prefill engine's page
server (`PeerProxy`). Everything on 127.0.0.1, free ports, every wait bounded, everything
stopped at the end of its ``with`` block."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from paged_kv.bench.netdelay import free_port

from ..conftest import ROOT, prometheus_value

START_TIMEOUT_S = 120.0  # a server that is not healthy by then failed (2 busy cores)
HANDOFF_SECRET = "s3cret"  # the engines' and routers' of these tests


def signed(params: dict, secret: str = HANDOFF_SECRET) -> dict:
    """`params` (a prefill's ``kv_transfer_params``, edited) signed again, as the prefill
    engine signs them: a test playing a fault of the operator's own network."""
    from paged_kv.handoff.trust import HandoffTrust

    return {**params, "signature": HandoffTrust(secret).sign_params(params)}


def post_as_router(url: str, body: dict, headers: dict | None = None,
                   secret: str = HANDOFF_SECRET, timeout: float = 60) -> httpx.Response:
    """POST `body` to `url` signed as the router signs it (a hand-off is the router's)."""
    from paged_kv.handoff.trust import HEADER, HandoffTrust

    content = json.dumps(body).encode()
    return httpx.post(url, content=content, timeout=timeout,
                      headers={**(headers or {}), "content-type": "application/json",
                               HEADER: HandoffTrust(secret).router_header(content)})


class Proc:
    """One ``python -m paged_kv.cli`` subprocess on a free port, its output in `log`."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}"
                                           f"{os.environ.get('PYTHONPATH', '')}"}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "paged_kv.cli", *argv, "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True)  # its own group: `kill` takes its engine core too

    def healthy(self) -> bool:
        """Whether /health answers 200 (RuntimeError when the process has exited)."""
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.process.args[3:5]} exited with "
                               f"{self.process.returncode}:\n{self.log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        return False

    def kill(self) -> None:
        """SIGKILL to the process and its engine core: the whole engine gone at once,
        nothing cleaned up (a crash). Killing the API process alone would leave the core
        draining -- and still serving its leased pages -- for a while."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        if self.process.returncode is None:
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def metric(self, name: str, labels: str = "") -> float:
        return prometheus_value(httpx.get(f"{self.url}/metrics", timeout=30).text, name,
                                labels)


class Processes(contextlib.ExitStack):
    """Processes started together (their start-ups overlap) and stopped at exit."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.started: list[Proc] = []
        self.callback(self._stop_all)

    def _stop_all(self) -> None:
        """SIGTERM to all at once (their drains overlap), then wait for each."""
        for proc in self.started:
            if proc.process.poll() is None:
                proc.process.send_signal(signal.SIGTERM)
        for proc in self.started:
            proc.stop()

    def start(self, **argvs: list[str]) -> dict[str, Proc]:
        """Start one process per name (``serve``/``route`` and flags); wait until every
        one is healthy."""
        procs = {}
        for name, argv in argvs.items():
            procs[name] = proc = Proc(argv, self.directory / f"{name}.log")
            self.started.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(procs.values())
        while waiting:
            waiting = [p for p in waiting if not p.healthy()]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"not healthy in {START_TIMEOUT_S} s: "
                                   f"{[p.log.read_text() for p in waiting]}")
            time.sleep(0.2)
        return procs


def route(prefill: str, decode: str, secret: str = HANDOFF_SECRET) -> list[str]:
    """``paged-kv route`` over one prefill and one decode replica (fast probes)."""
    return ["route", "--prefill", prefill, "--decode", decode, "--probe-interval", "0.2",
            "--handoff-secret", secret]


class _QuietServer(ThreadingHTTPServer):
    """Without the traceback of a caller that left (the router cancels prefill calls)."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass


class PrefillProxy:
    """An HTTP proxy in front of a prefill replica that can misbehave on its answers'
    ``kv_transfer_params``: ``mode`` ``pass`` (unchanged), ``strip`` (dropped, as proxies
    that do not know the field do) or ``redirect`` (``remote_engine`` replaced by
    `redirect_to`, the real one noted in `engines`, and signed again: a fault of the
    operator's own network, not a client's forgery). It passes the router's signature
    header on."""

    def __init__(self, target: str) -> None:
        self.target, self.mode, self.redirect_to = target, "pass", ""
        self.engines: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._relay(httpx.get(proxy.target + self.path, timeout=30))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("authorization", "content-type",
                                            "x-paged-kv-handoff")}
                answer = httpx.post(proxy.target + self.path, content=body, headers=headers,
                                    timeout=60)
                self._relay(answer, proxy.edit(answer))

            def _relay(self, answer: httpx.Response, content: bytes | None = None) -> None:
                content = answer.content if content is None else content
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", ""))
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def edit(self, answer: httpx.Response) -> bytes:
        """The answer's body as the proxy passes it on."""
        if answer.status_code != 200 or self.mode == "pass":
            return answer.content
        data = answer.json()
        params = data.pop("kv_transfer_params", None)
        if self.mode == "redirect" and params is not None:
            self.engines.append(params["remote_engine"])
            data["kv_transfer_params"] = signed({**params, "remote_engine": self.redirect_to})
        return json.dumps(data).encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


class ZmqPeer:
    """A ZMQ ROUTER on a free 127.0.0.1 port served by a thread running `_loop` (a
    subclass's) until `close`: what stands where a prefill engine's page server would."""

    def __init__(self) -> None:
        import zmq

        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close()
        self._context.term()


class PeerProxy(ZmqPeer):
    """A ZMQ ROUTER in front of a prefill engine's page server (`target`) that forwards
    every message, except that a ``get`` is held (``hold``: never answered), answered
    late (``delay`` seconds) or answered with its second value's last byte flipped
    (``tamper``). `verbs` records what came, `gets` is set at the first ``get``."""

    def __init__(self, mode: str, delay: float = 0.0) -> None:
        from paged_kv.handoff.server import call

        self.mode, self.delay, self.target = mode, delay, ""
        self.verbs: list[bytes] = []
        self.gets = threading.Event()
        self._call = call
        super().__init__()

    def _loop(self) -> None:
        late: list[tuple[float, list[bytes]]] = []
        while not self._stop.is_set():
            if self._sock.poll(20):
                frames = self._sock.recv_multipart()
                self.verbs.append(frames[1])
                if frames[1] != b"get":
                    self._forward(frames)
                elif self.mode == "delay":
                    late.append((time.monotonic() + self.delay, frames))
                elif self.mode == "tamper":
                    self._forward(frames, tamper=True)
                if frames[1] == b"get":
                    self.gets.set()
            for item in [x for x in late if x[0] <= time.monotonic()]:
                late.remove(item)
                self._forward(item[1])

    def _forward(self, frames: list[bytes], tamper: bool = False) -> None:
        answer = self._call(self._context, self.target, frames[1:], 2.0)
        if answer is None:
            return
        if tamper and answer[0] == b"ok" and len(answer) > 3:  # [ok, macs, value, value...]
            value = bytearray(answer[3])
            value[-1] ^= 0xFF
            answer[3] = bytes(value)
        self._sock.send_multipart([frames[0], *answer])


@contextlib.contextmanager
def peer_proxy(proxy: PrefillProxy, target: str, mode: str, delay: float = 0.0,
               ) -> Iterator[PeerProxy]:
    """`proxy` redirecting hand-offs to a `PeerProxy` in `mode` in front of `target` (the
    prefill engine's page server) while the block runs."""
    peer = PeerProxy(mode, delay)
    peer.target = target
    proxy.mode, proxy.redirect_to = "redirect", peer.endpoint
    try:
        yield peer
    finally:
        proxy.mode = "pass"
        peer.close()
