"""The wire between the engines: a prefill engine's `HandoffServer` (a ZMQ ROUTER served by a
thread of the engine-core process) and the decode side's `call`.

A message is multipart: ``[verb, secret, lease, key, key, ...]`` (keys raw, 32 bytes each);
the answer ``[status, value, value, ...]``. Verbs: ``get`` (the leased values of the keys,
in order, raw: no per-token framing), ``heartbeat`` (extends the lease), ``release`` (drops
it: the decode engine's ack). Statuses: ``ok``; ``refused`` (wrong secret, or a malformed
message); ``expired`` / ``unknown`` (no such lease now); ``missing`` (a key not in the
lease). A value is a tier value (`paged_kv.tiers.codec`), so the decode side verifies it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading

import zmq

from .lease import LeaseTable

logger = logging.getLogger(__name__)
_POLL_MS = 100  # how often the thread sweeps expired leases and looks at its stop flag


class HandoffServer:
    """Serves `leases` on ``tcp://host:port`` (port 0: a free one) from a thread.

    Parameters
    ----------
    leases : LeaseTable
    host : str
    port : int
    secret : str
        Every message must carry it.
    """

    def __init__(self, leases: LeaseTable, host: str, port: int, secret: str) -> None:
        self.leases, self._secret = leases, secret.encode()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.refused = 0  # messages without the secret
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="paged-kv-handoff",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(_POLL_MS):
                    frames = self._socket.recv_multipart()
                    self._socket.send_multipart([frames[0], *self._answer(frames[1:])],
                                                copy=False)
                self.leases.sweep()
        except Exception:
            logger.exception("paged_kv hand-off server stopped")
        finally:
            self._socket.close()

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 3 or not hmac.compare_digest(frames[1], self._secret):
            self.refused += 1
            return [b"refused"]
        verb, lease = frames[0], frames[2].decode(errors="replace")
        if verb == b"heartbeat":
            return [b"ok" if self.leases.heartbeat(lease) else b"expired"]
        if verb == b"release":
            self.leases.release(lease)
            return [b"ok"]
        if verb != b"get":
            return [b"refused"]
        values = self.leases.get(lease, frames[3:])
        if isinstance(values, str):
            return [values.encode() if values == "unknown" else b"expired"]
        if any(v is None for v in values):
            return [b"missing"]
        return [b"ok", *values]

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with contextlib.suppress(Exception):
            self._context.term()


def call(context: zmq.Context, endpoint: str, frames: list[bytes],
         timeout_s: float) -> list[bytes] | None:
    """One request to a `HandoffServer` on a fresh DEALER; its answer's frames, or None when
    none came within `timeout_s` (the engine is gone, or too slow). A caller that asks
    often uses a `Channel` instead (no connection set up per call)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        socket.send_multipart(frames, copy=False)
        if not socket.poll(max(1, int(timeout_s * 1000))):
            return None
        return socket.recv_multipart()
    finally:
        socket.close()


class Channel:
    """Requests to `HandoffServer`s over one DEALER per endpoint and per thread, kept open
    between calls: a fresh socket per call costs a TCP and a ZMTP handshake, which at 64
    blocks of 64 KiB per call halved the loopback bandwidth. Answers are received without
    a copy (their frames' buffers, which `paged_kv.tiers.codec.decode` reads in place).

    A socket whose answer did not come in time is closed and replaced, so that a late
    answer can never be taken for the next call's (one call at a time per socket: an
    answer is the one to the socket's last request).

    Parameters
    ----------
    context : zmq.Context
    """

    def __init__(self, context: zmq.Context) -> None:
        self._context = context
        self._local = threading.local()  # .sockets: endpoint -> DEALER, this thread's
        self._all: list[zmq.Socket] = []  # every open socket, for `close`
        self._lock = threading.Lock()

    def call(self, endpoint: str, frames: list[bytes],
             timeout_s: float) -> list[bytes | memoryview] | None:
        """`call` on this thread's socket to `endpoint`: ``[status (bytes), value
        (memoryview), ...]``, or None when no answer came within `timeout_s`."""
        sockets = self._local.__dict__.setdefault("sockets", {})
        socket = sockets.get(endpoint)
        if socket is None:
            socket = sockets[endpoint] = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            with self._lock:
                self._all.append(socket)
        socket.send_multipart(frames, copy=False)
        if not socket.poll(max(1, int(timeout_s * 1000))):
            self._discard(sockets.pop(endpoint))
            return None
        answer = socket.recv_multipart(copy=False)
        return [answer[0].bytes, *(frame.buffer for frame in answer[1:])]

    @property
    def open_sockets(self) -> int:
        """Sockets open now (one per endpoint and thread that called it)."""
        return len(self._all)

    def _discard(self, socket: zmq.Socket) -> None:
        with self._lock:
            self._all.remove(socket)
        socket.close()

    def close(self) -> None:
        """Close every socket (call once the threads that used them are done)."""
        with self._lock:
            sockets, self._all = self._all, []
        for socket in sockets:
            with contextlib.suppress(zmq.ZMQError):
                socket.close()


def send(socket: zmq.Socket, frames: list[bytes]) -> None:
    """Fire and forget on a DEALER (a heartbeat, a release): never blocks the engine's
    thread; answers are drained and ignored (`drain`)."""
    with contextlib.suppress(zmq.ZMQError):
        socket.send_multipart(frames, flags=zmq.NOBLOCK)


def drain(socket: zmq.Socket) -> None:
    """Discard the answers waiting on `socket`."""
    with contextlib.suppress(zmq.ZMQError):
        while socket.poll(0):
            socket.recv_multipart(zmq.NOBLOCK)
