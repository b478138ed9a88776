"""Streaming a step's outputs: each sample's new tokens handed to its request's listener
(`Request.on_output`) as a `StepOutput`, the request's whole `RequestOutput` on its last."""

from __future__ import annotations

import collections
import itertools
import operator
import time
from collections import abc

from .draw import Sample
from .outputs import RequestOutput, StepOutput
from .request import Request, Sequence


def emit_samples(samples: list[Sample], finished: list[Request],
                 plain: tuple[list, list[int], list[int], abc.Sequence[int], list[int]]
                 | None = None, outputs: dict[int, RequestOutput] | None = None) -> None:
    """Stream each sample's new token, in order; a request this step finished (`finished`,
    as `Scheduler.update_from_output` returned it) carries its whole `RequestOutput` on the
    output of the sample that finished it (its last finished sample here), as if each
    sample had been updated and emitted in turn.

    `plain`: ``(listeners, request ids, sample indexes, tokens, checked)`` of the samples
    when every request has a listener and one sample, and every output is plain but those
    at `checked` (`SteadyDecode.outputs`): the plain runs between those are made and
    handed over in C, with no pass over the samples in Python; each of `checked` as
    below.

    `outputs`: each finished request's `RequestOutput` by request id, when the caller made
    them (the engine returns the same objects from its step: one made a request, ~11-45 us
    for a 128-1,024-token answer); None: made here."""
    if outputs is None:
        now = time.perf_counter()
        outputs = {request.request_id: request.output(now) for request in finished}
    if plain is not None:
        listeners, request_ids, indexes, tokens, checked = plain
        if not checked:
            _emit_plain(listeners, request_ids, indexes, tokens)
            return
        start = 0
        for i in checked:  # (ascending)
            _emit_plain(listeners[start:i], request_ids[start:i], indexes[start:i],
                        tokens[start:i])
            seq, token, _ = samples[i]
            request = seq.request  # its one sample: it finished the request, or it is plain
            listeners[i](StepOutput(request.request_id, seq.index, [token], seq.finish_reason,
                                    outputs.get(request.request_id)
                                    if seq.finish_reason is not None else None))
            start = i + 1
        _emit_plain(listeners[start:], request_ids[start:], indexes[start:], tokens[start:])
        return
    last = {}  # request id -> the index of its sample that finished it
    if outputs:  # (keyed by the finished requests' ids)
        last = {seq.request.request_id: i for i, (seq, _, _) in enumerate(samples)
                if seq.finish_reason is not None and seq.request.request_id in outputs}
    make = tuple.__new__  # a StepOutput in 60% of its call's time
    for i, (seq, token, _) in enumerate(samples):
        request = seq.request
        if request.on_output is not None:
            request.on_output(make(StepOutput, (
                request.request_id, seq.index, [token], seq.finish_reason,
                outputs[request.request_id] if last and last.get(request.request_id) == i
                else None)))


def _emit_plain(listeners: list, request_ids: list[int], indexes: list[int],
                tokens: abc.Sequence[int]) -> None:
    """Hand each listener its plain output (one token, no finish reason, no request
    output), made and called in C."""
    outputs = map(tuple.__new__, itertools.repeat(StepOutput), zip(
        request_ids, indexes, map(list, zip(tokens)), itertools.repeat(None),
        itertools.repeat(None)))
    collections.deque(map(operator.call, listeners, outputs), maxlen=0)


def emit(seq: Sequence, new_token_ids: list[int]) -> None:
    """Tell the request's listener about `seq`'s step; the request's last step output
    (all samples finished, or aborted) carries the whole `RequestOutput`."""
    request = seq.request
    if request.on_output is None:
        return
    # only a finished sample can finish its request: most steps skip the scan
    finished = seq.finish_reason is not None and all(s.finish_reason for s in request.samples)
    done = finished and (len(request.samples) == request.params.n
                         or seq.finish_reason in ("abort", "error"))
    request.on_output(StepOutput(request.request_id, seq.index, new_token_ids,
                                 seq.finish_reason,
                                 request.output(time.perf_counter()) if done else None))
