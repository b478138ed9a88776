"""OpenAI response bodies: whole completions, server-sent event streams, errors, logprobs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from starlette.responses import StreamingResponse

from ...handoff.config import ERROR_PREFIX as HANDOFF_ERROR
from .generation import Generation

if TYPE_CHECKING:
    from .service import Job


def error_body(generation: Generation) -> dict:
    """OpenAI's error body for a request the engine failed (HTTP 500, or an SSE event; 502
    for a hand-off the ``fail`` policy failed: the prefill engine's fault, not ours)."""
    message = generation.error or "the engine failed this request"
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": str(error_status(generation))}}


def error_status(generation: Generation) -> int:
    """The HTTP status of a request the engine failed: 502 for a failed hand-off, else 500."""
    return 502 if (generation.error or "").startswith(HANDOFF_ERROR) else 500


def final_body(job: Job, model_name: str, tokenizer) -> dict:
    """The whole (non-streamed) response: OpenAI's completion or chat completion."""
    generation, body, kind = job.generation, job.body, job.kind
    outputs = generation.output.outputs if generation.output else []
    choices = []
    for c in generation.choices:
        logprobs = outputs[c.index].logprobs if c.index < len(outputs) else None
        choice = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
            if body.logprobs and logprobs is not None:
                choice["logprobs"] = chat_logprobs(tokenizer, c.token_ids, logprobs,
                                                   body.top_logprobs or 0)
        else:
            prefix = tokenizer.decode(generation.prompt_token_ids) if body.echo else ""
            choice["text"] = prefix + c.text
            if body.logprobs is not None and logprobs is not None:
                choice["logprobs"] = completion_logprobs(
                    tokenizer, generation, c.token_ids, logprobs, body.logprobs, body.echo)
        if body.return_token_ids:
            choice.update(prompt_token_ids=generation.prompt_token_ids,
                          token_ids=c.token_ids)
        choices.append(choice)
    out = {"id": job.response_id, "object": "chat.completion" if kind == "chat"
           else "text_completion", "created": int(time.time()), "model": model_name,
           "choices": choices, "usage": generation.usage()}
    if generation.output is not None and generation.output.kv_transfer_params is not None:
        out["kv_transfer_params"] = generation.output.kv_transfer_params  # a prefill's
    if body.prompt_logprobs is not None:  # where vLLM puts them: per choice, or the chat's
        rows = prompt_logprobs(tokenizer, generation, body.prompt_logprobs)
        for choice in choices if kind == "text" else [out]:
            choice["prompt_logprobs"] = rows
    return out


def _top(entries: dict[int, float], num: int) -> list[tuple[int, float]]:
    return sorted(entries.items(), key=lambda item: -item[1])[:num]


def prompt_logprobs(tokenizer, generation: Generation, num: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for it and the `num` likeliest.

    The engine sent its `computed` likeliest (at least `num`, more when ``echo`` asked for
    more) and the prompt's token, so a rank (1: the likeliest) is known within those; the
    prompt's token outside them has ``rank`` null (the whole vocabulary is not ranked)."""
    rows = generation.output.prompt_logprobs if generation.output else None
    computed = generation.params.prompt_logprobs or 0
    texts: dict[int, str] = {}  # a prompt's top tokens repeat: decode each once

    def text(token: int) -> str:
        if token not in texts:
            texts[token] = tokenizer.decode([token])
        return texts[token]

    out: list[dict | None] = []
    for token, entries in zip(generation.prompt_token_ids, rows or [None], strict=False):
        if entries is None:
            out.append(None)
            continue
        likeliest = _top({t: lp for t, lp in entries.items() if t != token}
                         if len(entries) > computed else entries, computed)
        ranks = {t: rank for rank, (t, _) in enumerate(likeliest, 1)}
        row = {str(token): {"logprob": entries[token], "rank": ranks.get(token),
                            "decoded_token": text(token)}}
        row.update((str(t), {"logprob": lp, "rank": ranks[t], "decoded_token": text(t)})
                   for t, lp in likeliest[:num])
        out.append(row)
    return out


def completion_logprobs(tokenizer, generation: Generation, token_ids: list[int],
                        logprobs: list[dict[int, float]], num: int, echo: bool) -> dict:
    """OpenAI's completions ``logprobs``: tokens, their log-probabilities, the `num` likeliest
    at each position, and each token's offset in the returned text (with `echo`, the
    prompt's tokens first, the first of them without a log-probability)."""
    rows: list[tuple[int, dict[int, float] | None]] = []
    if echo:
        prompt_rows = (generation.output.prompt_logprobs or [None]) if generation.output else []
        rows += list(zip(generation.prompt_token_ids, prompt_rows, strict=False))
    rows += list(zip(token_ids, logprobs, strict=False))
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, entries in rows:
        text = tokenizer.decode([token])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entries is None else entries[token])
        out["top_logprobs"].append(None if entries is None else {
            tokenizer.decode([t]): lp for t, lp in _top(entries, num)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  num: int) -> dict:
    """OpenAI's chat ``logprobs``: per generated token its text, bytes, log-probability and
    the `num` likeliest alternatives."""

    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(token, entries[token]),
                         "top_logprobs": [entry(t, lp) for t, lp in _top(entries, num)]}
                        for token, entries in zip(token_ids, logprobs, strict=False)]}


_HOLE = "\x00delta\x00"  # where a chunk template takes its text (no real text is this)
_DONE = "data: [DONE]\n\n"


def _chunk_encoder(head: dict, kind: str,
                   ) -> Callable[[int, str, str | None, dict, dict | None], str]:
    """``encode(index, delta, reason, extra, usage)``: the SSE event of one token's chunk
    (`usage`: the chunk's own, with ``continuous_usage_stats``; None: none).

    A chunk mid-stream differs from the last only in its text, so it is a template made
    once per choice with the JSON-escaped text put in; the same bytes as dumping the whole
    object, for a fraction of the per-token cost. Final chunks, chat's empty deltas and
    chunks with usage are dumped whole."""
    hole = json.dumps(_HOLE)
    templates: dict[int, list[str]] = {}

    def whole(index: int, delta: str, reason: str | None, extra: dict,
              usage: dict | None = None) -> str:
        if kind == "chat":
            choice = {"index": index, "delta": {"content": delta} if delta else {},
                      "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": delta, "finish_reason": reason,
                      "logprobs": None}
        choice.update(extra)
        chunk = {**head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def encode(index: int, delta: str, reason: str | None, extra: dict,
               usage: dict | None = None) -> str:
        if reason is not None or extra or usage is not None or (kind == "chat" and not delta):
            return whole(index, delta, reason, extra, usage)
        parts = templates.get(index)
        if parts is None:
            parts = templates[index] = whole(index, _HOLE, None, {}).split(hole)
        return json.dumps(delta).join(parts)

    return encode


async def stream_events(job: Job, model_name: str, observe: Callable[[Generation], None]
                        ) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, usage if asked, then ``data: [DONE]``; a
    request the engine fails ends with an error event instead of a finish reason."""
    generation, body, kind = job.generation, job.body, job.kind
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    head = {"id": job.response_id, "object": obj, "created": int(time.time()),
            "model": model_name}

    chunk = _chunk_encoder(head, kind)
    options = body.stream_options
    usage_so_far = _usage_so_far(generation) if options and options.continuous else None
    try:
        if kind == "chat":
            for event in _role_chunks(head, generation, usage_so_far):
                yield event
        tail = ""  # the request's last chunk leaves with the end of the stream: one write
        async for choice, delta, _ in generation.updates():
            if choice.finish_reason == "error":
                break
            extra = {}
            if choice.finish_reason and body.return_token_ids:
                extra = {"prompt_token_ids": generation.prompt_token_ids,
                         "token_ids": choice.token_ids}
            # one chunk per token, text or not, so clients can time every token
            event = chunk(choice.index, delta, choice.finish_reason, extra,
                          usage_so_far and usage_so_far(len(choice.token_ids)))
            if generation.output is None:
                yield event
            else:
                tail += event
        observe(generation)
        if generation.failed:
            tail += f"data: {json.dumps(error_body(generation))}\n\n"
        elif options and options.include_usage:
            tail += f"data: {json.dumps({**head, 'choices': [], 'usage': generation.usage()})}\n\n"
        yield tail + _DONE
    finally:
        generation.abort()  # the client left mid-stream: free the request's blocks


def _usage_so_far(generation: Generation) -> Callable[[int], dict]:
    """``usage(completion_tokens)``: vLLM's usage of a chunk with ``continuous_usage_stats``,
    where `completion_tokens` are those of the chunk's choice so far."""
    prompt = len(generation.prompt_token_ids)
    return lambda completion: {"prompt_tokens": prompt, "completion_tokens": completion,
                               "total_tokens": prompt + completion}


def _role_chunks(head: dict, generation: Generation,
                 usage_so_far: Callable[[int], dict] | None) -> list[str]:
    """A chat stream's first chunk of each choice: the assistant's role, no text yet (with
    continuous usage, no completion token yet)."""
    events = []
    for c in generation.choices:
        role = {"index": c.index, "delta": {"role": "assistant", "content": ""},
                "finish_reason": None}
        chunk = {**head, "choices": [role]}
        if usage_so_far is not None:
            chunk["usage"] = usage_so_far(0)
        events.append(f"data: {json.dumps(chunk)}\n\n")
    return events


class EventStream(StreamingResponse):
    """``text/event-stream`` of `stream_events`, as `StreamingResponse` sends it but for
    less per request: no task group (one watcher task cancels this one if the client
    leaves, freeing the request as before), and the event ending in ``data: [DONE]`` goes
    out with the end of the body, in one write rather than two."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._ended = False  # the last body message is sent: a disconnect now is no news

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, task))
        try:
            await self._stream(send)
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # not the client leaving: someone else's cancel
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+
            if uncancel is not None:
                uncancel()
        finally:
            watcher.cancel()

    async def _watch(self, receive, task: asyncio.Task) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._ended:
            task.cancel()

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self.body_iterator:
            self._ended = event.endswith(_DONE)
            await send({"type": "http.response.body", "body": event.encode(),
                        "more_body": not self._ended})
        if not self._ended:
            self._ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
