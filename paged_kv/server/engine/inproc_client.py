"""`EngineLoop`: the engine on a thread of its own, stepping while requests come and go."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ...serving import Engine, EngineDeadError, SamplingParams, StepOutput
from ...serving.limits import EngineLimits
from .engine_client import waiting_count

logger = logging.getLogger(__name__)


class EngineLoop:
    """Runs `engine` on one thread; other threads hand it work as callables.

    The engine is not thread-safe, so every call into it (add, abort, metrics) travels
    through one queue and runs on the loop's thread between steps; results come back as
    futures. The thread blocks on the queue while the engine is idle.

    Parameters
    ----------
    engine : Engine
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = \
            queue.Queue()
        self._stopping = threading.Event()
        # replies of one step, handed to each event loop in one wake-up rather than one a token
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any]]] = {}
        self._thread = threading.Thread(target=self._run, name="paged-kv-engine", daemon=True)
        self.dead: str | None = None  # why the engine cannot step any more (health: 503)

    def start(self) -> None:
        """Start stepping (once; later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step (running requests are dropped, not finished)."""
        self._stopping.set()
        self._inbox.put((lambda: None, concurrent.futures.Future()))  # wake an idle loop
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the engine can serve: the stepping thread runs and the engine is not dead."""
        return self._thread.is_alive() and self.dead is None

    @property
    def num_waiting(self) -> int:
        """Requests that would wait for a running slot: those queued for the engine and
        waiting inside it, less the slots free now (so an idle server has none)."""
        return self._inbox.qsize() + waiting_count(self.engine)

    # -- the surface the server uses (shared with `CoreClient`, the engine-core process's) -----
    @property
    def limits(self) -> EngineLimits:
        """What requests are checked against before they reach the engine."""
        return EngineLimits.of(self.engine)

    @property
    def registry(self):
        """The prometheus registry the server adds its HTTP counters to (the engine's)."""
        return self.engine.metrics.registry

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, salt: str | None,
                  on_output: Callable[[StepOutput], None]) -> int:
        """Queue a request; `on_output` runs on the calling event loop for each step output.
        Returns the request's id (raises what `Engine.add_request` raises)."""
        event_loop = asyncio.get_running_loop()

        def forward(out: StepOutput) -> None:  # on the engine's thread
            self.post(event_loop, on_output, out)

        future = self.submit(lambda: self.engine.add_request(
            prompt_token_ids, params, salt=salt, on_output=forward))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: int) -> None:
        """Free a request's blocks before the next step (does not wait; nothing once the
        engine is gone)."""
        if self.is_alive:
            self.submit(lambda: self.engine.abort(request_id))

    async def metrics_text(self) -> str:
        """Prometheus exposition, the engine's gauges as of now and the server's counters."""
        return await asyncio.wrap_future(self.submit(self.engine.metrics_text))

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine's thread before its next step; returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            future.set_exception(EngineDeadError(self.dead))
        else:
            self._inbox.put((fn, future))
        return future

    def post(self, event_loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any],
             arg: Any) -> None:
        """From the engine's thread: run ``fn(arg)`` on `event_loop` once this step is done."""
        self._outbox.setdefault(event_loop, []).append((fn, arg))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for event_loop, calls in outbox.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody listens
                event_loop.call_soon_threadsafe(_run_all, calls)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_unfinished_requests)
                self._flush()
                if self.engine.has_unfinished_requests and not self._stopping.is_set():
                    self._step()
                    self._flush()
        except BaseException as exc:  # the loop itself broke: nothing can be served
            self.dead = self.dead or f"the engine loop stopped: {exc!r}"
            raise
        finally:
            if self.dead is not None:
                self._fail_all(self.dead)
                self._flush()
                self._refuse_queued(self.dead)

    def _step(self) -> None:
        try:
            self.engine.step()
        except EngineDeadError as exc:
            logger.error("engine dead: %s", exc)
            self.dead = str(exc)
            self._stopping.set()
        except Exception as exc:  # fails the requests it could have touched, not the server
            logger.exception("engine step failed; failing the requests in the engine")
            self._fail_all(f"the engine step failed: {exc!r}")

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _refuse_queued(self, message: str) -> None:
        """Answer every call still queued with `EngineDeadError` (nobody will run it)."""
        while True:
            try:
                _, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(message))

    def _fail_all(self, message: str) -> None:
        """Fail every request in the engine with `message` (its clients get an error)."""
        for request_id in self.engine.unfinished_request_ids():
            with contextlib.suppress(Exception):  # a dead engine may fail to free too
                self.engine.abort(request_id, error=message)


def _run_all(calls: list[tuple[Callable[[Any], Any], Any]]) -> None:
    for fn, arg in calls:
        fn(arg)
