"""`InprocClient`: the engine core on a thread of this process, stepping while requests come
and go (vLLM's in-process client; ``paged-kv serve`` uses `CoreClient` instead)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from .. import Engine, EngineDeadError, SamplingParams, StepOutput
from ..limits import EngineLimits
from .engine_core import EngineCore


class InprocClient:
    """Drives an `EngineCore` over `engine` on one thread; other threads hand it work as
    callables.

    The engine is not thread-safe, so every call into it (add, abort, metrics) travels
    through one queue and runs on the core's thread between steps; results come back as
    futures. The thread blocks on the queue while the engine is idle. Steps, their failures
    and the waiting count are the core's (`EngineCore`), as in the engine-core process.

    Parameters
    ----------
    engine : Engine
    """

    def __init__(self, engine: Engine) -> None:
        self.core = EngineCore(engine)
        self._inbox: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = \
            queue.Queue()
        self._stopping = threading.Event()
        # replies of one step, handed to each event loop in one wake-up rather than one a token
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any]]] = {}
        self._thread = threading.Thread(target=self._run, name="paged-kv-engine", daemon=True)
        self._broken: str | None = None  # why the thread itself stopped, if it did

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
    def engine(self) -> Engine:
        """The engine the core steps (not thread-safe: call into it through `submit`)."""
        return self.core.engine

    @property
    def dead(self) -> str | None:
        """Why the engine cannot serve any more (health: 503): it died, or its thread broke."""
        return self.core.dead or self._broken

    @property
    def is_alive(self) -> bool:
        """Whether the engine can serve: the stepping thread runs and the engine is not dead."""
        return self._thread.is_alive() and self.dead is None

    @property
    def num_waiting(self) -> int:
        """Requests that would wait for a running slot: those queued for the engine and
        waiting inside it, less the slots free now (so an idle server has none)."""
        return self._inbox.qsize() + self.core.num_waiting

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
                  on_output: Callable[[StepOutput], None], *, priority: int | None = None,
                  retention_seconds: float | None = None, handoff=None) -> int:
        """Queue a request; `on_output` runs on the calling event loop for each step output.
        Returns the request's id (raises what `Engine.add_request` raises)."""
        event_loop = asyncio.get_running_loop()

        def forward(out: StepOutput) -> None:  # on the engine's thread
            self.post(event_loop, on_output, out)

        future = self.submit(lambda: self.engine.add_request(
            prompt_token_ids, params, salt=salt, priority=priority,
            retention_seconds=retention_seconds, on_output=forward, handoff=handoff))
        return await asyncio.wrap_future(future)

    async def flush_tenant(self, tenant: str | None, retention_only: bool = False) -> int:
        """`EngineCore.flush_tenant`, between steps."""
        return await asyncio.wrap_future(self.submit(
            lambda: self.core.flush_tenant(tenant, retention_only)))

    async def cached_tokens(self, prompt_token_ids: list[int], salt: str | None) -> int:
        """`EngineCore.cached_tokens`, between steps."""
        return await asyncio.wrap_future(self.submit(
            lambda: self.core.cached_tokens(prompt_token_ids, salt)))

    def announce(self) -> None:
        """Nothing: this core's steps do not wait for announced requests (an `add` joins
        the step after the one it was made in, as before)."""

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
        core = self.core
        try:
            while not self._stopping.is_set():
                self._run_calls(block=not core.has_unfinished_requests)
                self._flush()
                if core.has_unfinished_requests and not self._stopping.is_set():
                    if not core.step():  # dead: every request failed, nothing more to step
                        self._stopping.set()
                    self._flush()
        except BaseException as exc:  # the thread itself broke: nothing can be served
            self._broken = f"the engine loop stopped: {exc!r}"
            raise
        finally:
            if self.dead is not None:
                core.fail_all(self.dead)
                self._flush()
                self._refuse_queued(self.dead)

    def _run_calls(self, block: bool) -> None:
        """Run the calls queued for the engine (waiting up to 0.5 s for one if `block`)."""
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


def _run_all(calls: list[tuple[Callable[[Any], Any], Any]]) -> None:
    for fn, arg in calls:
        fn(arg)
