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

from ..serving import Engine

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

    def start(self) -> None:
        """Start stepping."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step (running requests are dropped, not finished)."""
        self._stopping.set()
        self._inbox.put((lambda: None, concurrent.futures.Future()))  # wake an idle loop
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the stepping thread runs."""
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued for the engine plus waiting inside it."""
        return self._inbox.qsize() + self.engine.num_waiting_requests

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine's thread before its next step; returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
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
        while not self._stopping.is_set():
            self._drain(block=not self.engine.has_unfinished_requests)
            self._flush()
            if self.engine.has_unfinished_requests and not self._stopping.is_set():
                try:
                    self.engine.step()
                except Exception:  # a model error fails the running requests, not the server
                    logger.exception("engine step failed; aborting the running requests")
                    self._abort_all()
                self._flush()

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

    def _abort_all(self) -> None:
        scheduler = self.engine.scheduler
        ids = {seq.request.request_id for seq in
               (*scheduler.running, *scheduler.waiting, *scheduler.swapped)}
        for request_id in ids:
            self.engine.abort(request_id)


def _run_all(calls: list[tuple[Callable[[Any], Any], Any]]) -> None:
    for fn, arg in calls:
        fn(arg)
