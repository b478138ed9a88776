"""The wire between the engines: a prefill engine's `HandoffServer` (a ZMQ ROUTER served by a
thread of the engine-core process) and the decode side's `call`.

A message is multipart: ``[verb, mac, lease, key, key, ...]`` (keys raw, 32 bytes each;
``mac`` the secret's MAC of verb, lease and keys, `trust.HandoffTrust.request_mac`: the
secret itself never travels); the answer ``[status, ...]``, a ``get``'s ``[b"ok", macs,
value, value, ...]``. Verbs: ``get`` (the leased values of the keys, in order, raw: no
per-token framing, and ``macs``: each value's `trust.HandoffTrust.value_mac`, 16 bytes
each, binding it to the lease), ``heartbeat`` (extends the lease), ``release`` (drops it:
the decode engine's ack). Statuses: ``ok``; ``refused`` (a wrong MAC, or a malformed
message); ``expired`` / ``unknown`` (no such lease now); ``missing`` (a key not in the
lease). A value is a tier value (`paged_kv.tiers.codec`), so the decode side verifies it
twice: its MAC, then its header and checksum.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import zmq

from .lease import LeaseTable
from .trust import HandoffTrust

logger = logging.getLogger(__name__)
_POLL_MS = 100  # how often the thread sweeps expired leases and looks at its stop flag


class HandoffServer:
    """Serves `leases` on ``tcp://host:port`` (port 0: a free one) from a thread.

    Parameters
    ----------
    leases : LeaseTable
    host : str
    port : int
    trust : HandoffTrust
        Every message must carry its MAC; every value served carries one.
    """

    def __init__(self, leases: LeaseTable, host: str, port: int, trust: HandoffTrust) -> None:
        self.leases, self._trust = leases, trust
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.refused = 0  # messages without the secret's MAC
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="paged-kv-handoff",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(_POLL_MS):
                    frames = self._socket.recv_multipart()
                    try:
                        answer = self._answer(frames[1:])
                    except Exception:  # one message's fault: never the server's end
                        logger.exception("paged_kv hand-off server: a message refused")
                        answer = [b"refused"]
                    self._socket.send_multipart([frames[0], *answer], copy=False)
                self.leases.sweep()
        except Exception:
            logger.exception("paged_kv hand-off server stopped")
        finally:
            self._socket.close()

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 3 or not self._trust.request_ok(frames[1], frames[0], frames[2],
                                                         frames[3:]):
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
        macs = b"".join(self._trust.value_mac(frames[2], key, value)
                        for key, value in zip(frames[3:], values, strict=True))
        return [b"ok", macs, *values]

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
    socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    try:
        socket.connect(endpoint)
        socket.send_multipart(frames, copy=False)
        if not socket.poll(max(1, int(timeout_s * 1000))):
            return None
        return socket.recv_multipart()
    except zmq.ZMQError:  # an endpoint ZMQ cannot connect to, or a send that timed out
        return None
    finally:
        socket.close()


class Channel:
    """Requests to `HandoffServer`s over one DEALER per endpoint and per thread, kept open
    between calls: a fresh socket per call costs a TCP and a ZMTP handshake, which at 64
    blocks of 64 KiB per call halved the loopback bandwidth. Answers are received without
    a copy (their frames' buffers, which `paged_kv.tiers.codec.decode` reads in place).

    A socket whose answer did not come in time is closed and replaced, so that a late
    answer can never be taken for the next call's (one call at a time per socket: an
    answer is the one to the socket's last request). A socket is kept only once it is
    connected, and a send gives up after the call's timeout: a failure is this call's
    alone (None), never a socket left to block the next one.

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
        (memoryview), ...]``, or None when no answer came within `timeout_s` (or ZMQ
        could not connect to `endpoint` or send to it)."""
        sockets = self._local.__dict__.setdefault("sockets", {})
        socket = sockets.get(endpoint) or self._open(endpoint)
        if socket is None:
            return None
        sockets[endpoint] = socket
        wait_ms = max(1, int(timeout_s * 1000))
        try:
            socket.setsockopt(zmq.SNDTIMEO, wait_ms)
            socket.send_multipart(frames, copy=False)
            answered = socket.poll(wait_ms)
        except zmq.ZMQError:
            answered = False
        if not answered:
            self._discard(sockets.pop(endpoint))
            return None
        answer = socket.recv_multipart(copy=False)
        return [answer[0].bytes, *(frame.buffer for frame in answer[1:])]

    def _open(self, endpoint: str) -> zmq.Socket | None:
        """A DEALER connected to `endpoint` (None: ZMQ refused the endpoint)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(endpoint)
        except zmq.ZMQError:
            socket.close()
            return None
        with self._lock:
            self._all.append(socket)
        return socket

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


def send(socket: zmq.Socket | None, frames: list[bytes]) -> None:
    """Fire and forget on a DEALER (a heartbeat, a release): never blocks the engine's
    thread; answers are drained and ignored (`drain`). No socket: nothing sent."""
    if socket is None:
        return
    with contextlib.suppress(zmq.ZMQError):
        socket.send_multipart(frames, flags=zmq.NOBLOCK)


def drain(socket: zmq.Socket) -> None:
    """Discard the answers waiting on `socket`."""
    with contextlib.suppress(zmq.ZMQError):
        while socket.poll(0):
            socket.recv_multipart(zmq.NOBLOCK)
