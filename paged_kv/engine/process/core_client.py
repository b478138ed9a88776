"""`CoreClient`: an API server process's handle on the engine-core process, with the surface
of `InprocClient` (`engine_client.EngineClient`), so the service and generations run
unchanged on it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
from collections.abc import Callable

import zmq
from prometheus_client import CollectorRegistry, generate_latest

from .. import EngineDeadError, SamplingParams, StepOutput
from ..limits import EngineLimits
from . import messages
from .processes import describe_exit

# a peer's exit codes when it was asked to stop: drained, Ctrl-C, a signal's default action
_ASKED = frozenset({0, 130, -signal.SIGTERM, -signal.SIGINT})
logger = logging.getLogger("paged_kv.server")
_LAST_WORDS_S = 0.2  # after the core exits, how long its last messages may take to arrive
_DEAD_EXIT_S = 1.0  # a dead core: answer 503 this long, then exit non-zero for a supervisor
_REAP_S = 5.0  # at most this long for an exited peer to become reapable
_FULL_RETRY_S = 0.001  # a send to a full queue (the core not reading) tries again this often


class CoreClient:
    """Requests to the engine core over ZMQ; its step outputs back to each request's callback.

    Parameters
    ----------
    address : str
        The core's ZMQ address.
    identity : bytes
        This API server's name at the core (one per API server process).
    limits : EngineLimits
        The engine's, as the core sent them at startup.
    core_sentinel : int
        A file descriptor that turns readable when the core process ends.
    on_exit : callable, optional
        Called with the exit code the server should stop with once the core has stopped:
        0 after a clean drain (`messages.Bye`), 1 when it died (or a peer did).
    peers : list of multiprocessing.Process, optional
        The other API server processes (the first one's forks): one that dies unasked
        stops this server with exit code 1, as a dead core does, so a supervisor restarts
        the whole server instead of it running on with fewer front processes.
    """

    def __init__(self, address: str, identity: bytes, limits: EngineLimits, core_sentinel: int,
                 on_exit: Callable[[int], None] | None = None, peers: list | None = None,
                 ) -> None:
        self.limits, self.registry = limits, CollectorRegistry()
        self.dead: str | None = None
        self.draining = False  # the core said it drains: new requests get 503
        self.exit_code: int | None = None
        self.on_exit = on_exit
        self._address, self._identity, self._sentinel = address, identity, core_sentinel
        self._requests: dict[int, tuple[Callable[[StepOutput], None], int]] = {}
        self._fresh: set[int] = set()  # requests still waiting for their first output
        self._metrics: dict[int, asyncio.Future] = {}  # metrics and other queries' answers
        self._ids = itertools.count()
        # the core's queue as it last told (an idle engine until it does: minus its slots),
        # and the `Add`s sent to it, of which it had taken `_received` by then
        self._waiting, self._sent, self._received = -limits.max_num_seqs, 0, 0
        # a plain socket read from the event loop's own reader, not zmq.asyncio's: its
        # futures cost an extra turn of the loop and some 20 µs a message on the way of
        # every first token (and every step's outputs)
        self._socket: zmq.Socket | None = None
        self._fd: int | None = None
        self._backlog: set[asyncio.Task] = set()  # aborts waiting for room in a full queue
        self._peers = list(peers or ())

    def start(self) -> None:
        """Connect and listen (on the running event loop)."""
        loop = asyncio.get_running_loop()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self._identity)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self._address)
        self._fd = self._socket.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self._read)
        self._socket.send(messages.encode(messages.Hello()))  # (the queue is empty: no wait)
        loop.call_soon(self._read)  # whatever came before the reader (the FD is edge-triggered)
        loop.add_reader(self._sentinel, self._core_gone)
        for peer in self._peers:
            loop.add_reader(peer.sentinel, self._peer_gone, peer)

    def stop(self) -> None:
        """Stop listening and close the socket."""
        with contextlib.suppress(Exception):
            loop = asyncio.get_running_loop()
            for fd in (self._sentinel, *(peer.sentinel for peer in self._peers), self._fd):
                if fd is not None:
                    loop.remove_reader(fd)
        for task in self._backlog:
            task.cancel()
        if self._socket is not None:
            self._socket.close()
            self._context.term()

    @property
    def is_alive(self) -> bool:
        """Whether the core takes requests (not dead, not draining, not stopped)."""
        return self.dead is None and self.exit_code is None and not self.draining

    @property
    def _connected(self) -> bool:
        """Whether the core still answers (draining included)."""
        return self.dead is None and self.exit_code is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a running slot as of the core's last step (every API
        server's), plus those this one sent that the core had not taken by then."""
        return self._waiting + self._sent - self._received

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, salt: str | None,
                  on_output: Callable[[StepOutput], None], *, priority: int | None = None,
                  retention_seconds: float | None = None, handoff=None) -> int:
        """Send a request to the core; returns this server's id for it."""
        if not self.is_alive:
            raise EngineDeadError(self.dead or ("the engine core is draining (SIGTERM): send "
                                                "new requests elsewhere" if self.draining
                                                else "the engine core has stopped"))
        request_id = next(self._ids)
        frame = messages.encode(messages.Add(request_id, prompt_token_ids, params, salt,
                                             priority, retention_seconds, handoff))
        # counted while sent, uncounted if the send fails: a request that never reached
        # the core must leave no entry and no count behind (the count would never heal)
        self._requests[request_id] = (on_output, params.n)
        self._fresh.add(request_id)
        self._sent += 1
        try:
            await self._send(frame)
        except BaseException:
            self._requests.pop(request_id, None)
            self._fresh.discard(request_id)
            self._sent -= 1
            raise
        return request_id

    def abort(self, request_id: int) -> None:
        """Ask the core to stop a request (does not wait)."""
        if request_id in self._requests and self._connected:
            frame = messages.encode(messages.Abort(request_id))
            if not self._post(frame):  # a full queue: it leaves once there is room
                task = asyncio.get_running_loop().create_task(self._send(frame))
                self._backlog.add(task)
                task.add_done_callback(self._backlog.discard)

    async def metrics_text(self) -> str:
        """The engine's exposition (from the core) followed by this server's counters."""
        if not self._connected:
            raise EngineDeadError(self.dead or "the engine core has stopped")
        token = next(self._ids)
        future = self._metrics[token] = asyncio.get_running_loop().create_future()
        await self._send(messages.encode(messages.MetricsQuery(token)))
        try:
            text = await asyncio.wait_for(future, timeout=30)
        finally:
            self._metrics.pop(token, None)
        return text + generate_latest(self.registry).decode()

    async def flush_tenant(self, tenant: str | None, retention_only: bool = False) -> int:
        """`EngineCore.flush_tenant` in the core; raises its ValueError."""
        return await self._ask(lambda token: messages.Flush(token, tenant, retention_only))

    async def cached_tokens(self, prompt_token_ids: list[int], salt: str | None) -> int:
        """`EngineCore.cached_tokens` in the core."""
        return await self._ask(lambda token: messages.CachedQuery(token, prompt_token_ids,
                                                                  salt))

    async def _ask(self, make: Callable[[int], messages.ToCore]) -> int:
        """Send the query `make(token)` builds and wait for its `messages.Reply`."""
        if not self._connected:
            raise EngineDeadError(self.dead or "the engine core has stopped")
        token = next(self._ids)
        future = self._metrics[token] = asyncio.get_running_loop().create_future()
        await self._send(messages.encode(make(token)))
        try:
            reply = await asyncio.wait_for(future, timeout=30)
        finally:
            self._metrics.pop(token, None)
        if reply.error is not None:
            raise ValueError(reply.error)
        return reply.value

    def _post(self, frame: bytes) -> bool:
        """Send `frame` now; False when the socket's queue is full (its high-water mark)."""
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        # zmq's FD is edge-triggered, and a send may take in the edge of a message that
        # arrived meanwhile: read it on the loop's next turn, or it would wait for the next
        if self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            asyncio.get_running_loop().call_soon(self._read)
        return True

    async def _send(self, frame: bytes) -> None:
        """Send `frame`, waiting while the queue to the core is full; without a wait (no
        turn of the event loop) when it is not, as nearly always."""
        while not self._post(frame):
            await asyncio.sleep(_FULL_RETRY_S)

    def _read(self) -> None:
        """Dispatch every message waiting on the socket (the event loop calls this when its
        FD turns readable; an edge-triggered FD, so until none is left)."""
        socket = self._socket
        while socket is not None and not socket.closed:
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._dispatch(messages.decode_from_core(frame))
            except Exception:  # one bad message must not stop the reading of the rest
                logger.exception("a message from the engine core could not be handled")

    def _dispatch(self, message: messages.FromCore) -> None:
        if isinstance(message, messages.Outputs):
            self._waiting, self._received = message.waiting, message.received
            requests = self._requests
            for request_id, out in self._first_tokens_first(message.outputs):
                entry = requests.get(request_id)
                if entry is not None:
                    entry[0](out)
                    if out.output is not None:
                        del requests[request_id]
        elif isinstance(message, messages.MetricsText | messages.Reply):
            future = self._metrics.get(message.token)
            if future is not None and not future.done():
                future.set_result(message.text if isinstance(message, messages.MetricsText)
                                  else message)
        elif isinstance(message, messages.Draining):
            logger.info("the engine core drains: new requests get 503")
            self.draining = True
        elif self.exit_code is None:  # Bye: the core drained and stops
            logger.info("the engine core stopped cleanly; so does this API server")
            self._finish(0)

    def _first_tokens_first(self, outputs: list[tuple[int, StepOutput]],
                            ) -> list[tuple[int, StepOutput]]:
        """`outputs` with those of requests that had none before moved to the front (each
        request's own order kept): every callback wakes a stream that writes its chunk, so
        the first token, which a client waits on with nothing to read, goes out before the
        step's other tokens instead of behind them."""
        fresh = self._fresh
        if not fresh:
            return outputs
        first = [pair for pair in outputs if pair[0] in fresh]
        if not first:
            return outputs
        fresh.difference_update(request_id for request_id, _ in first)
        started = {request_id for request_id, _ in first}
        return first + [pair for pair in outputs if pair[0] not in started]

    def _peer_gone(self, peer) -> None:
        asyncio.get_running_loop().remove_reader(peer.sentinel)
        # reaped, so its exit code is known: the sentinel turns readable as the process
        # closes its files, a moment before it can be reaped (join(0) read None)
        peer.join(_REAP_S)
        if peer.exitcode in _ASKED or self.exit_code is not None:
            return  # stopped with the rest of the server (SIGTERM drained, Ctrl-C)
        logger.error("API server process %s exited with %s; stopping (exit 1) so that a "
                     "supervisor restarts the whole server", peer.name,
                     describe_exit(peer.exitcode))
        self._finish(1)

    def _core_gone(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sentinel)
        loop.call_later(_LAST_WORDS_S, self._core_died)

    def _core_died(self) -> None:
        if self.exit_code is not None:
            return  # it said Bye
        self.dead = "the engine core process died"
        logger.error("%s; failing %d requests, then exiting", self.dead, len(self._requests))
        requests, self._requests = self._requests, {}
        self._fresh.clear()
        for request_id, (on_output, n) in requests.items():
            for out in messages.failed_outputs(request_id, n, self.dead):
                on_output(out)
        for future in self._metrics.values():
            if not future.done():
                future.set_exception(EngineDeadError(self.dead))
        asyncio.get_running_loop().call_later(_DEAD_EXIT_S, self._finish, 1)

    def _finish(self, code: int) -> None:
        self.exit_code = code
        if self.on_exit is not None:
            self.on_exit(code)
