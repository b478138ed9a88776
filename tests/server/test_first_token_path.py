"""The engine core sends a request's first token the moment the engine hands it over, in a
message of its own (issue 42, item 4): not in the step's one `Outputs` message behind the
tokens of every other running request. Driven over the core's own Unix socket from a plain
socket standing in for an API server, the core on a thread of this process."""

from __future__ import annotations

import socket
import time

import pytest

from paged_kv.engine import SamplingParams
from paged_kv.engine.process import messages
from paged_kv.engine.process.frames import FrameReader, frame, unix_path

from .test_queue_count import core_on_thread


class _Front:
    """A blocking Unix socket that speaks the core's frames (an API server's stand-in)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 30
        while True:  # the core's thread may not be listening yet
            try:
                self.sock.connect(unix_path(address))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self.sock.settimeout(0.1)
        self.reader, self.ready = FrameReader(), []

    def send(self, message) -> None:
        self.sock.sendall(frame(messages.encode(message)))

    def recv(self) -> bytes | None:
        """The next frame's payload, or None when none came within 0.1 s."""
        while not self.ready:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                return None
            assert data, "the engine core closed the connection"
            self.ready += self.reader.feed(data)
        return self.ready.pop(0)


@pytest.fixture
def front(tmp_path):
    """A socket connected to an `EngineCoreProc` (two running slots) on a thread."""
    with core_on_thread(tmp_path, max_num_seqs=2) as (address, _):
        connection = _Front(address)
        try:
            yield connection
        finally:
            connection.sock.close()


def _next(front: _Front, timeout: float = 30.0) -> messages.Outputs:
    """The next `Outputs` message from the core."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        payload = front.recv()
        if payload is not None:
            message = messages.decode_from_core(payload)
            if isinstance(message, messages.Outputs):
                return message
    raise TimeoutError("no Outputs from the engine core")


def _add(front: _Front, request_id: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    front.send(messages.Add(request_id, [5, 6, 7, 8, 9], params, None))


def test_a_first_token_leaves_alone_before_the_steps_other_tokens(front):
    _next(front)  # the queue's count, told once the core knows this API server
    _add(front, 0, 200)  # request 0 runs (its first message may carry the new counts)
    while not any(request_id == 0 for request_id, _ in _next(front).outputs):
        pass
    _add(front, 1, 3)  # request 1's prefill shares a step with request 0's decode
    while True:
        message = _next(front)
        ids = [request_id for request_id, _ in message.outputs]
        if 1 in ids:
            break
    # its first token came alone, before anything else that step made
    assert ids == [1], message.outputs
    first = message.outputs[0][1]
    assert len(first.new_token_ids) == 1 and first.output is None
    # and the rest of request 1 still arrives, in order, ending with its last output
    tokens = list(first.new_token_ids)
    while True:
        outs = [out for request_id, out in _next(front).outputs if request_id == 1]
        tokens += [t for out in outs for t in out.new_token_ids]
        if any(out.output is not None for out in outs):
            break
    assert len(tokens) == 3
    front.send(messages.Abort(0))
