"""OpenAI response bodies: whole completions and server-sent event streams."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from .generation import Generation


def final_body(generation: Generation, body, kind: str, response_id: str,
               model_name: str) -> dict:
    """The whole (non-streamed) response: OpenAI's completion or chat completion."""
    choices = []
    for c in generation.choices:
        choice = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        if body.return_token_ids:
            choice.update(prompt_token_ids=generation.prompt_token_ids,
                          token_ids=c.token_ids)
        choices.append(choice)
    return {"id": response_id, "object": "chat.completion" if kind == "chat"
            else "text_completion", "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": generation.usage()}

async def stream_events(generation: Generation, body, kind: str, response_id: str,
                        model_name: str, observe: Callable[[Generation], None]
                        ) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, usage if asked, then ``data: [DONE]``."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    head = {"id": response_id, "object": obj, "created": int(time.time()),
            "model": model_name}

    def chunk(index: int, delta: str, reason: str | None, extra: dict) -> str:
        if kind == "chat":
            choice = {"index": index, "delta": {"content": delta} if delta else {},
                      "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": delta, "finish_reason": reason,
                      "logprobs": None}
        choice.update(extra)
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    try:
        if kind == "chat":
            for c in generation.choices:
                role = {"index": c.index, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None}
                yield f"data: {json.dumps({**head, 'choices': [role]})}\n\n"
        async for choice, delta, _ in generation.updates():
            extra = {}
            if choice.finish_reason and body.return_token_ids:
                extra = {"prompt_token_ids": generation.prompt_token_ids,
                         "token_ids": choice.token_ids}
            # one chunk per token, text or not, so clients can time every token
            yield chunk(choice.index, delta, choice.finish_reason, extra)
        observe(generation)
        if body.stream_options and body.stream_options.get("include_usage"):
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': generation.usage()})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        generation.abort()  # the client left mid-stream: free the request's blocks
