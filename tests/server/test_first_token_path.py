"""The engine core sends a request's first token the moment the engine hands it over, in a
message of its own (issue 42, item 4): not in the step's one `Outputs` message behind the
tokens of every other running request. Driven over the core's own socket from a DEALER
standing in for an API server, the core on a thread of this process."""

from __future__ import annotations

import time

import pytest
import zmq

from paged_kv.engine import SamplingParams
from paged_kv.engine.process import messages

from .test_queue_count import core_on_thread


@pytest.fixture
def front(tmp_path):
    """A DEALER connected to an `EngineCoreProc` (two running slots) on a thread."""
    with core_on_thread(tmp_path, max_num_seqs=2) as (address, _):
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        try:
            yield socket
        finally:
            socket.close()
            context.term()


def _next(socket, timeout: float = 30.0) -> messages.Outputs:
    """The next `Outputs` message from the core."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if socket.poll(100):
            message = messages.decode_from_core(socket.recv())
            if isinstance(message, messages.Outputs):
                return message
    raise TimeoutError("no Outputs from the engine core")


def _add(socket, request_id: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    socket.send(messages.encode(messages.Add(request_id, [5, 6, 7, 8, 9], params, None)))


def test_a_first_token_leaves_alone_before_the_steps_other_tokens(front):
    front.send(messages.encode(messages.Hello()))
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
    front.send(messages.encode(messages.Abort(0)))
