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

from prometheus_client import CollectorRegistry, generate_latest

from .. import EngineDeadError, SamplingParams, StepOutput
from ..limits import EngineLimits
from . import messages
from .frames import FrameReader, frame, unix_path
from .processes import describe_exit

# a peer's exit codes when it was asked to stop: drained, Ctrl-C, a signal's default action
_ASKED = frozenset({0, 130, -signal.SIGTERM, -signal.SIGINT})
logger = logging.getLogger("paged_kv.server")
_LAST_WORDS_S = 0.2  # after the core exits, how long its last messages may take to arrive
_DEAD_EXIT_S = 1.0  # a dead core: answer 503 this long, then exit non-zero for a supervisor
_REAP_S = 5.0  # at most this long for an exited peer to become reapable
_CONNECT_RETRY_S = 0.005  # a core not listening yet (still starting): connect again this often
# what may wait in this side's write buffer before sends wait for room (the core not
# reading, e.g. inside a long step): any one message fits; a burst of them is held back
_HIGH_WATER = 4 << 20
_ARRIVING = frame(messages.encode(messages.Arriving()))


class CoreClient:
    """Requests to the engine core over its Unix socket (`frames.py`); its step outputs back
    to each request's callback.

    Parameters
    ----------
    address : str
        The core's socket path (or ``ipc://PATH``). A core that is not listening yet is
        connected to once it is; what was sent meanwhile waits for it.
    identity : bytes
        This API server's name in log lines (one per API server process).
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
        # a plain Unix socket under an asyncio protocol: a frame is dispatched from the
        # loop's own callback for the readable socket, no future and no extra turn of the
        # loop on the way of every first token (and every step's outputs)
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._early: list[bytes] = []  # frames sent before the connection was made
        self._room: asyncio.Event | None = None  # cleared while the write buffer is full
        self._closed = False  # stopped, or the connection was lost: nothing more is sent
        self._connecting: asyncio.Task | None = None
        self._backlog: set[asyncio.Task] = set()  # aborts waiting for room in a full queue
        self._peers = list(peers or ())

    def start(self) -> None:
        """Connect and listen (on the running event loop)."""
        loop = asyncio.get_running_loop()
        self._room = asyncio.Event()
        self._room.set()
        self._connecting = loop.create_task(self._connect())
        loop.add_reader(self._sentinel, self._core_gone)
        for peer in self._peers:
            loop.add_reader(peer.sentinel, self._peer_gone, peer)

    def stop(self) -> None:
        """Stop listening and close the connection (what was sent leaves first)."""
        self._closed = True
        with contextlib.suppress(Exception):
            loop = asyncio.get_running_loop()
            for fd in (self._sentinel, *(peer.sentinel for peer in self._peers)):
                loop.remove_reader(fd)
        for task in (*self._backlog, *(t for t in (self._connecting,) if t is not None)):
            task.cancel()
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()

    async def _connect(self) -> None:
        """Connect to the core's socket, again every few ms while it is not there yet."""
        loop, path = asyncio.get_running_loop(), unix_path(self._address)
        while not self._closed:
            try:
                await loop.create_unix_connection(lambda: _Connection(self), path)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(_CONNECT_RETRY_S)
            except OSError as exc:  # not a core still starting: one that cannot be reached
                logger.error("cannot connect to the engine core at %s: %s", path, exc)
                self._lost()
                return

    def _made(self, transport: asyncio.Transport) -> None:
        """Connected: what was sent before goes out first."""
        if self._closed:
            transport.close()
            return
        transport.set_write_buffer_limits(high=_HIGH_WATER)
        self._transport = transport
        if self._early:
            transport.write(b"".join(self._early))
            self._early.clear()

    def _data(self, data: bytes) -> None:
        """Dispatch every message `data` completes (the loop calls this as bytes arrive)."""
        try:
            payloads = self._reader.feed(data)
        except ValueError:
            logger.exception("the engine core's stream is out of step; closing it")
            self._transport.close()
            return
        for payload in payloads:
            try:
                self._dispatch(messages.decode_from_core(payload))
            except Exception:  # one bad message must not stop the reading of the rest
                logger.exception("a message from the engine core could not be handled")

    def _lost(self) -> None:
        """The connection closed: ours (`stop`), or the core's end (it exited or broke),
        in which case the core is as good as dead unless it said Bye first."""
        stopped, self._closed, self._transport = self._closed, True, None
        self._room.set()  # (a send waiting for room finds the connection closed)
        if not stopped and self.exit_code is None:
            asyncio.get_running_loop().call_later(_LAST_WORDS_S, self._core_died)

    def _pause(self, paused: bool) -> None:
        (self._room.clear if paused else self._room.set)()

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

    def announce(self) -> None:
        """Tell the core a generation request has arrived (`messages.Arriving`), before its
        route reads and checks it: a step about to start waits for its `Add` (briefly).
        A hint: skipped while the connection is not up or its buffer is full."""
        if self._transport is not None and not self._closed and self._room.is_set():
            self._transport.write(_ARRIVING)

    def abort(self, request_id: int) -> None:
        """Ask the core to stop a request (does not wait)."""
        if request_id in self._requests and self._connected and not self._closed:
            frame = messages.encode(messages.Abort(request_id))
            if not self._post(frame):  # a full queue: it leaves once there is room
                task = asyncio.get_running_loop().create_task(self._send_later(frame))
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

    def _post(self, payload: bytes) -> bool:
        """Send `payload` now (before the connection is made: as soon as it is); False
        while the write buffer is full (past `_HIGH_WATER`: the core is not reading)."""
        if self._closed:
            raise EngineDeadError(self.dead or "the connection to the engine core is closed")
        if self._transport is None:
            self._early.append(frame(payload))
        elif not self._room.is_set():
            return False
        else:
            self._transport.write(frame(payload))
        return True

    async def _send(self, payload: bytes) -> None:
        """Send `payload`, waiting while the buffer to the core is full; without a wait (no
        turn of the event loop) when it is not, as nearly always."""
        while not self._post(payload):
            await self._room.wait()

    async def _send_later(self, payload: bytes) -> None:
        """`_send` for a message no one waits on (an abort): a core gone meanwhile has
        nothing left to stop."""
        with contextlib.suppress(EngineDeadError):
            await self._send(payload)

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
        if self.exit_code is not None or self.dead is not None:
            return  # it said Bye (or its socket and its sentinel both told)
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


class _Connection(asyncio.Protocol):
    """The event loop's side of a `CoreClient`'s socket: each callback hands over to it."""

    def __init__(self, client: CoreClient) -> None:
        self._client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._client._made(transport)

    def data_received(self, data: bytes) -> None:
        self._client._data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client._lost()

    def pause_writing(self) -> None:
        self._client._pause(True)

    def resume_writing(self) -> None:
        self._client._pause(False)
