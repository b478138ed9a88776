"""A step waits, briefly, for requests an API server has announced (`messages.Arriving`,
issue 42 item 4): a request that reached the server just before a step boundary joins the
step as it would in-process, instead of waiting a whole step more while its route reads
it. Bounded: an announcement that never turns into an `Add` expires, and a stream of them
holds no step longer than the hold. Driven over the core's own Unix socket, the core on a
thread of this process; the API server's side (`_FastPath` announcing, `CoreClient`
writing the frame) with stand-ins."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time

import pytest

from paged_kv.engine import Engine, SamplingParams, TinyLlama
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.process import messages
from paged_kv.engine.process.engine_core import EngineCoreProc

from .test_first_token_path import _Front, _next
from .test_openai_semantics import CONFIG

pytest.importorskip("fastapi")
from starlette.testclient import TestClient

HOLD = 0.4  # s: long against a step of the test model (a few ms), so a held step shows
LONG = dataclasses.replace(CONFIG, max_position=4096)  # request 0 runs for seconds


class _TimedCore(EngineCoreProc):
    """An `EngineCoreProc` that notes when each step began and when it took each
    announcement (`time.monotonic()`, on the core's thread). Counting the steps that began
    after the core took an announcement measures the hold itself: counting the outputs the
    front reads after sending one also counts steps that ended before the core took it,
    whose outputs still sat in the socket."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_starts: list[float] = []
        self.announced_at: list[float] = []

    def _take(self, front, frame: bytes) -> None:
        if isinstance(messages.decode_to_core(frame), messages.Arriving):
            self.announced_at.append(time.monotonic())
        super()._take(front, frame)

    def step(self) -> bool:
        self.step_starts.append(time.monotonic())
        return super().step()

    def steps_begun(self, after: float, within: float) -> int:
        """Steps that began in the `within` s after `after` s past the first announcement."""
        start = self.announced_at[0] + after
        return sum(start < t <= start + within for t in list(self.step_starts))


def _announce(front: _Front, core: _TimedCore) -> None:
    """Send one announcement and wait (bounded) until the core has taken it."""
    front.send(messages.Arriving())
    deadline = time.monotonic() + 30
    while not core.announced_at:
        assert time.monotonic() < deadline, "the core never took the announcement"
        front.recv()  # (reads the outputs meanwhile: a full socket would stall the core)


@contextlib.contextmanager
def _core(tmp_path, hold: float):
    """A front socket on a `_TimedCore` (two running slots, `hold` s of arrival hold)
    stepping on a thread; yields both."""
    model = TinyLlama(LONG, seed=1)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=600, block_size=8),
                                        max_num_seqs=2))
    core = _TimedCore(engine, f"ipc://{tmp_path}/core", os.getppid(), arrival_hold_s=hold)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    front = _Front(f"ipc://{tmp_path}/core")
    try:
        yield front, core
    finally:
        front.sock.close()
        core.drain()
        thread.join(60)
        engine.close()
        assert not thread.is_alive()


def _add(front: _Front, request_id: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    front.send(messages.Add(request_id, [5, 6, 7, 8, 9], params, None))


def _steps_within(front: _Front, seconds: float, request_id: int = 0) -> int:
    """`Outputs` messages carrying `request_id`'s tokens (a step each) within `seconds`."""
    count, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        payload = front.recv()
        if payload is None:
            continue
        message = messages.decode_from_core(payload)
        if isinstance(message, messages.Outputs):
            count += any(rid == request_id and out.new_token_ids
                         for rid, out in message.outputs)
    return count


def _running(front: _Front) -> None:
    """Request 0 (long) runs: its decode steps are coming (the first one may compile)."""
    _next(front)  # the queue's count, told once the core knows this API server
    _add(front, 0, 4000)
    tokens = 0
    while tokens < 3:
        tokens += any(rid == 0 for rid, _ in _next(front, timeout=120).outputs)


@pytest.mark.parametrize("hold", [0.0, HOLD])
def test_a_step_waits_for_an_announced_request(tmp_path, hold):
    with _core(tmp_path, hold) as (front, core):
        _running(front)
        _announce(front, core)
        _steps_within(front, HOLD / 2)  # the route is still reading it
        steps = core.steps_begun(0, HOLD / 2)
        if hold:  # the step in progress finishes; the next waits
            assert steps == 0, f"{steps} steps began while an announced request was on its way"
        else:
            assert steps >= 3, f"without a hold the steps go on: {steps}"
        _add(front, 1, 2)
        message = _next(front)  # request 1 joins the step that waited
        while not any(rid == 1 for rid, _ in message.outputs):
            message = _next(front)
        front.send(messages.Abort(0))


@pytest.mark.parametrize("hold", [0.0, HOLD])
def test_without_a_hold_announcements_are_not_kept(tmp_path, hold):
    """Fault: a core that never holds a step (``--arrival-hold-ms 0``) still queues each
    announcement, and those of refused requests (no `Add` ever takes them back) pile up:
    with no hold, nothing expires them."""
    model = TinyLlama(CONFIG, seed=1)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=8),
                                        max_num_seqs=2))
    core = EngineCoreProc(engine, f"ipc://{tmp_path}/core", os.getppid(), arrival_hold_s=hold)
    try:
        for _ in range(3):
            core._take(None, messages.encode(messages.Arriving()))
        assert len(core._arriving) == (3 if hold else 0)
    finally:
        core._listener.close()
        engine.close()


def test_an_announcement_never_followed_expires(tmp_path):
    with _core(tmp_path, HOLD) as (front, core):
        _running(front)
        _announce(front, core)  # (its route refused it: no Add comes)
        _steps_within(front, HOLD * 3)
        held, resumed = core.steps_begun(0, HOLD / 2), core.steps_begun(HOLD, HOLD * 2)
        assert held == 0 and resumed >= 3, (held, resumed)
        front.send(messages.Abort(0))


def test_a_stream_of_announcements_holds_a_step_no_longer_than_the_hold(tmp_path):
    with _core(tmp_path, HOLD) as (front, _):
        _running(front)
        stop = threading.Event()

        def announce() -> None:  # faster than the hold: one always pending
            while not stop.wait(HOLD / 8):
                front.send(messages.Arriving())

        announcer = threading.Thread(target=announce)
        announcer.start()
        try:
            _steps_within(front, HOLD)  # (the steps before the first announcement)
            steps = _steps_within(front, HOLD * 5)
        finally:
            stop.set()
            announcer.join()
        assert 3 <= steps <= 7, f"{steps} steps in {HOLD * 5} s with a hold of {HOLD} s each"
        front.send(messages.Abort(0))


class _Engine:
    """An engine client that records announcements and adds, in order, and refuses adds
    (the route's 400 path is enough: the announcement came before the body was read)."""

    dead, is_alive, num_waiting, draining = None, True, 0, False

    def __init__(self, limits) -> None:
        from prometheus_client import CollectorRegistry

        self.registry, self.limits, self.calls = CollectorRegistry(), limits, []

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def announce(self) -> None:
        self.calls.append("announce")

    async def add(self, *args, **kwargs) -> int:
        self.calls.append("add")
        raise ValueError("refused here")

    def abort(self, request_id: int) -> None: ...


def test_the_fast_path_announces_generation_requests_only():
    from paged_kv.engine.limits import EngineLimits
    from paged_kv.server.http.app import create_app
    from paged_kv.server.http.tokenizer import ByteTokenizer

    model = TinyLlama(CONFIG, seed=1)
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=8),
                                        max_num_seqs=2))
    client_engine = _Engine(EngineLimits.of(engine))
    app = create_app(client_engine, ByteTokenizer(), model_name="m",
                     api_keys={"key": "tenant"})
    with TestClient(app) as http:
        http.get("/v1/models", headers={"Authorization": "Bearer key"})
        assert client_engine.calls == []
        response = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 401 and client_engine.calls == []  # no key: no hint
        response = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                             headers={"Authorization": "Bearer key"})
        assert response.status_code == 400 and client_engine.calls == ["announce", "add"]
        response = http.post("/v1/completions", json={"prompt": [], "max_tokens": 2},
                             headers={"Authorization": "Bearer key"})
        assert response.status_code == 400  # refused before the engine: announced only
        assert client_engine.calls == ["announce", "add", "announce"]
