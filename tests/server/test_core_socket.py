"""The API server <-> engine core hop over a plain Unix socket (issue 42, item 4): frames cut
right however the stream splits them, the core's listener never blocks on a slow reader,
an API server's sends wait while the core does not read, a closed connection is a dead
core to the API server and aborts that server's requests at the core, and the socket file
goes with the listener."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from paged_kv.engine import SamplingParams
from paged_kv.engine.limits import EngineLimits
from paged_kv.engine.process import core_client, messages
from paged_kv.engine.process.core_client import CoreClient
from paged_kv.engine.process.core_socket import CoreListener
from paged_kv.engine.process.frames import MAX_FRAME, FrameReader, frame, unix_path

from .test_queue_count import core_on_thread

_LIMITS = EngineLimits(model_config=None, max_num_seqs=1, cache_config=None)


def test_frames_come_out_whole_however_the_stream_is_cut():
    payloads = [b"", b"a", b"xyz" * 1000, bytes(range(256))]
    stream = b"".join(frame(p) for p in payloads)
    for cut in (1, 3, 4, 5, 7, 4096, len(stream)):
        reader, got = FrameReader(), []
        for start in range(0, len(stream), cut):
            got += reader.feed(stream[start:start + cut])
        assert got == payloads, cut
    assert FrameReader().feed(frame(b"one")) == [b"one"]  # the one-whole-frame fast path


def test_a_length_past_the_limit_is_a_broken_stream():
    with pytest.raises(ValueError, match="out of step"):
        FrameReader().feed((MAX_FRAME + 1).to_bytes(4, "little") + b"x")


@pytest.mark.parametrize("address", ["ipc:///tmp/x/core", "unix:///tmp/x/core", "/tmp/x/core"])
def test_the_address_may_be_spelled_as_zmq_did(address):
    assert unix_path(address) == "/tmp/x/core"


class _Core:
    """A `CoreListener` polled from the test's event loop (a stand-in for the core that
    takes frames only when told to)."""

    def __init__(self, path: str) -> None:
        self.fronts, self.frames, self.left = [], [], []
        self.listener = CoreListener(path, self.fronts.append,
                                     lambda front, p: self.frames.append(p), self.left.append)

    async def poll_until(self, done, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.listener.poll(0)
            await asyncio.sleep(0.005)


def _client(path: str, **kwargs) -> CoreClient:
    never, _ = os.pipe()  # no core process here: only the connection can tell
    return CoreClient(path, b"api-0", _LIMITS, never, **kwargs)


def test_sends_wait_while_the_core_does_not_read_then_all_arrive(tmp_path, monkeypatch):
    monkeypatch.setattr(core_client, "_HIGH_WATER", 1 << 16)
    core = _Core(str(tmp_path / "core.sock"))
    prompt = list(range(50_000))  # ~150 KB a message: the kernel's buffer fills in a few

    async def run() -> None:
        client = _client(core.listener.path)
        client.start()
        try:
            await core.poll_until(lambda: core.fronts and client._transport is not None)
            sends = [asyncio.ensure_future(client.cached_tokens(prompt, None))
                     for _ in range(40)]
            await asyncio.sleep(0.2)
            assert not client._room.is_set(), "40 big messages never filled the buffer"
            await core.poll_until(lambda: len(core.frames) == 40)  # the core reads: all go
            assert all(messages.decode_to_core(p).prompt_token_ids == prompt
                       for p in core.frames)
            for send in sends:
                send.cancel()
        finally:
            client.stop()
            core.listener.close()

    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_closed_connection_is_a_dead_core(tmp_path):
    """The core's end closing (it exited) fails the API server's requests and stops it
    with exit 1, as its sentinel would (here there is no process to watch)."""
    core = _Core(str(tmp_path / "core.sock"))
    codes, outs = [], []

    async def run() -> None:
        client = _client(core.listener.path, on_exit=codes.append)
        client.start()
        try:
            await client.add([5, 6], SamplingParams(max_tokens=2), None, outs.append)
            await core.poll_until(lambda: core.frames)
            core.listener.close()
            deadline = time.monotonic() + 10
            while not codes and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert client.dead and codes == [1]
            assert outs and outs[-1].finish_reason == "error"
            with pytest.raises(Exception, match="died"):
                await client.add([5], SamplingParams(max_tokens=2), None, outs.append)
        finally:
            client.stop()

    asyncio.run(asyncio.wait_for(run(), 60))
    assert not os.path.exists(core.listener.path), "the socket file outlived its listener"


def test_an_api_server_that_leaves_has_its_requests_aborted_at_the_core(tmp_path):
    with core_on_thread(tmp_path, max_num_seqs=2) as (address, engine):
        aborted, abort = [], engine.abort
        engine.abort = lambda request_id, **kw: (aborted.append(request_id),
                                                 abort(request_id, **kw))

        async def run() -> None:
            client = _client(address)
            client.start()
            started = asyncio.Event()
            try:
                await client.add([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True),
                                 None, lambda out: out.finish_reason or started.set())
                await asyncio.wait_for(started.wait(), 30)
            finally:
                client.stop()

        asyncio.run(asyncio.wait_for(run(), 60))
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.has_unfinished_requests, "the gone server's request kept running"
        assert len(aborted) == 1, "aborted by the core when its API server left, not finished"
