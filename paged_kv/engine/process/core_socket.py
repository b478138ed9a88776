"""`CoreListener`: the engine core's end of its Unix socket. Every API server process
connects once; each connection is a `Front`, and the core's loop polls them all between
steps (a selector, no thread: the core stays single-threaded).

Writes never block the core: what a socket does not take at once waits in that front's
buffer and leaves as the socket drains, so an API server that reads slowly delays only
its own messages, never a step. (ZMQ's ROUTER dropped a slow peer's messages past its
high-water mark instead; a front that stops reading for good is one whose process has hung,
and its sentinel stops the server.)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable

from .frames import FrameReader, frame, unix_path

logger = logging.getLogger("paged_kv.server.core")
_READ_SIZE = 1 << 18  # one recv takes up to this much (a step's outputs fit many times over)


class Front:
    """One API server's connection at the core: its socket, the frames it has half sent,
    and what the core has written to it that the socket has not taken yet."""

    __slots__ = ("closed", "name", "out", "reader", "sock")

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock, self.name = sock, name
        self.reader = FrameReader()
        self.out = bytearray()
        self.closed = False


class CoreListener:
    """Listens on a Unix socket and serves its connections with three callbacks.

    Parameters
    ----------
    address : str
        The socket's path (or ``ipc://PATH``); a file left there by a dead core is removed.
    joined : callable
        ``joined(front)``: an API server connected.
    received : callable
        ``received(front, payload)``: one whole frame from it.
    left : callable
        ``left(front)``: it closed its end (or broke it); nothing more is sent to it.
    """

    def __init__(self, address: str, joined: Callable[[Front], None],
                 received: Callable[[Front, bytes], None],
                 left: Callable[[Front], None]) -> None:
        self.path = unix_path(address)
        self._joined, self._received, self._left = joined, received, left
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._fronts: set[Front] = set()
        self._gone: list[Front] = []  # dropped, `left` not called yet (called from `poll`)
        self._names = itertools.count()

    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` seconds (0: just look) for connections, frames and room to
        write, and hand what came to the callbacks. (`left` is called from here only: a
        send that finds its front gone may come from inside an engine step.)"""
        for key, events in self._selector.select(timeout):
            front = key.data
            if front is None:
                self._accept()
                continue
            if front.closed:  # dropped by an earlier event of this same poll
                continue
            if events & selectors.EVENT_WRITE:
                self._write_out(front)
            if events & selectors.EVENT_READ and not front.closed:
                self._read(front)
        while self._gone:
            self._left(self._gone.pop(0))

    def send(self, front: Front, payload: bytes) -> None:
        """Write one frame to `front` now, or as soon as its socket takes it (never blocks);
        dropped once `front` has left."""
        if front.closed:
            return
        data = frame(payload)
        if front.out:  # earlier frames still wait: behind them
            front.out += data
            return
        try:
            sent = front.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(front)
            return
        if sent < len(data):
            front.out += memoryview(data)[sent:]
            self._selector.modify(front.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                  front)

    def close(self, linger: float = 5.0) -> None:
        """Write out what waits (for at most `linger` seconds: the last outputs and Bye
        leave before the core exits), then close every socket and remove the file."""
        deadline = time.monotonic() + linger
        while any(f.out for f in self._fronts) and time.monotonic() < deadline:
            for key, events in self._selector.select(deadline - time.monotonic()):
                if key.data is not None and events & selectors.EVENT_WRITE:
                    self._write_out(key.data)
        for front in list(self._fronts):
            self._drop(front)
        self._selector.close()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        front = Front(sock, f"api-connection-{next(self._names)}")
        self._fronts.add(front)
        self._selector.register(sock, selectors.EVENT_READ, front)
        self._joined(front)

    def _read(self, front: Front) -> None:
        try:
            data = front.sock.recv(_READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            payloads = front.reader.feed(data) if data else None
        except ValueError:
            logger.exception("%s sent a broken frame; closing it", front.name)
            payloads = None
        if payloads is None:
            self._drop(front)
            return
        for payload in payloads:
            self._received(front, payload)

    def _write_out(self, front: Front) -> None:
        try:
            sent = front.sock.send(front.out)
        except BlockingIOError:
            return
        except OSError:
            self._drop(front)
            return
        del front.out[:sent]
        if not front.out:
            self._selector.modify(front.sock, selectors.EVENT_READ, front)

    def _drop(self, front: Front) -> None:
        if front.closed:
            return
        front.closed = True
        front.out.clear()
        self._fronts.discard(front)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(front.sock)
        front.sock.close()
        self._gone.append(front)
