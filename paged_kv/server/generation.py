"""One HTTP request's generation: engine step outputs in, OpenAI choices (text, stop strings,
finish reasons, usage) out, on the server's event loop."""

from __future__ import annotations

import asyncio
import dataclasses

from ..serving import RequestOutput, SamplingParams, StepOutput
from .loop import EngineLoop


@dataclasses.dataclass
class Choice:
    """One sample as the client sees it: tokens, the text sent so far, how it ended."""

    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None


class Generation:
    """Submits one request to the engine loop and turns its step outputs into choices.

    Stop strings are the server's (the engine knows tokens): when one appears, the text is cut
    before it, the choice finishes with "stop", and once every choice has finished the
    request is aborted in the engine, freeing its blocks.
    """

    def __init__(self, loop: EngineLoop, tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams, stops: list[str], salt: str | None) -> None:
        self._loop, self._tokenizer = loop, tokenizer
        self.prompt_token_ids, self.params, self.stops, self.salt = (
            prompt_token_ids, params, stops, salt)
        self.choices = [Choice(i) for i in range(params.n)]
        self.output: RequestOutput | None = None
        self.request_id: int | None = None
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._holdback = max((len(s) for s in stops), default=1) - 1

    async def start(self) -> None:
        """Queue the request in the engine (raises what `Engine.add_request` raises)."""
        event_loop = asyncio.get_running_loop()

        def on_output(out: StepOutput) -> None:  # on the engine's thread
            self._loop.post(event_loop, self._queue.put_nowait, out)

        future = self._loop.submit(lambda: self._loop.engine.add_request(
            self.prompt_token_ids, self.params, salt=self.salt, on_output=on_output))
        self.request_id = await asyncio.wrap_future(future)

    @property
    def is_finished(self) -> bool:
        """Whether every choice has finished (the engine may still be winding down)."""
        return all(c.finish_reason for c in self.choices)

    def abort(self) -> None:
        """Free the request's blocks in the engine (idempotent; does not wait)."""
        if self.request_id is not None and self.output is None:
            request_id = self.request_id
            self._loop.submit(lambda: self._loop.engine.abort(request_id))

    async def updates(self):
        """Yield ``(choice, delta_text, new_token_ids)`` as tokens arrive, until done."""
        while self.output is None:
            out = await self._queue.get()
            if out.output is not None:
                self.output = out.output
            choice = self.choices[out.index]
            if choice.finish_reason is not None:
                continue  # already stopped by a stop string; the engine is catching up
            new = self._accept(choice, out)
            if new is not None:
                yield choice, *new
            if self.is_finished and self.output is None:
                self.abort()  # stop strings ended every choice before the engine did

    def _accept(self, choice: Choice, out: StepOutput) -> tuple[str, list[int]] | None:
        choice.token_ids += out.new_token_ids
        text = self._tokenizer.decode(choice.token_ids)
        reason = out.finish_reason
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        choice.finish_reason = reason
        # hold back a partial UTF-8 character and a possible start of a stop string
        stable = text if reason else text.rstrip("\ufffd")
        if not reason and self._holdback:
            stable = stable[:max(len(stable) - self._holdback, choice.sent)]
        delta = stable[choice.sent:] if stable.startswith(choice.text[:choice.sent]) else ""
        choice.text, choice.sent = text, choice.sent + len(delta)
        return delta, out.new_token_ids

    def usage(self) -> dict:
        """OpenAI's usage, with the prompt tokens the prefix cache served."""
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = self.output.prefix_hit_tokens if self.output else 0
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
