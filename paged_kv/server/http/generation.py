"""One HTTP request's generation: engine step outputs in, OpenAI choices (text, stop strings,
finish reasons, usage) out, on the server's event loop."""

from __future__ import annotations

import asyncio
import dataclasses

from ...engine import RequestOutput, SamplingParams, StepOutput
from ...engine.misses import miss_seen_by
from ...engine.process.engine_client import EngineClient


@dataclasses.dataclass
class Choice:
    """One sample as the client sees it: tokens, the text decoded so far, how it ended.

    ``text`` grows only by appending (incremental detokenization), so the text a client
    gets streamed and the text of the whole response are the same string.
    """

    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    # incremental detokenization (vLLM's offsets): tokens[prefix:read] were decoded last
    prefix_offset: int = 0
    read_offset: int = 0


class Generation:
    """Submits one request to the engine (an `EngineClient`), turns its step outputs into
    choices.

    Stop strings are the server's (the engine knows tokens): when one appears, the text is cut
    before it, the choice finishes with "stop", and once every choice has finished the
    request is aborted in the engine, freeing its blocks. A choice the engine could not
    finish ends with "error" and `error` says why.
    """

    def __init__(self, engine: EngineClient, tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams, stops: list[str], salt: str | None, *,
                 priority: int | None = None, retention_seconds: float | None = None,
                 handoff=None) -> None:
        self._engine, self._tokenizer = engine, tokenizer
        self.prompt_token_ids, self.params, self.stops, self.salt = (
            prompt_token_ids, params, stops, salt)
        # passed only when asked, so an engine client without retention still serves
        self.retention = {k: v for k, v in (("priority", priority),
                                            ("retention_seconds", retention_seconds),
                                            ("handoff", handoff))
                          if v is not None}
        self.choices = [Choice(i) for i in range(params.n)]
        self.output: RequestOutput | None = None
        self.request_id: int | None = None
        self.error: str | None = None
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._holdback = max((len(s) for s in stops), default=1) - 1

    async def start(self) -> None:
        """Queue the request in the engine (raises what `Engine.add_request` raises)."""
        self.request_id = await self._engine.add(self.prompt_token_ids, self.params, self.salt,
                                               self._queue.put_nowait, **self.retention)

    @property
    def is_finished(self) -> bool:
        """Whether every choice has finished (the engine may still be winding down)."""
        return all(c.finish_reason for c in self.choices)

    @property
    def failed(self) -> bool:
        """Whether the engine failed this request (an error, never a success)."""
        return self.error is not None or any(c.finish_reason == "error" for c in self.choices)

    def abort(self) -> None:
        """Free the request's blocks in the engine (idempotent; does not wait). Also while the
        engine drains (not `is_alive`, yet finishing what it has): the client's `abort`
        itself skips an engine that is gone."""
        if self.request_id is not None and self.output is None:
            self._engine.abort(self.request_id)

    async def updates(self):
        """Yield ``(choice, delta_text, new_token_ids)`` as tokens arrive, until done."""
        while self.output is None:
            out = await self._queue.get()
            if out.output is not None:
                self.output = out.output
                self.error = self.error or getattr(out.output, "error", None)
            choice = self.choices[out.index]
            if choice.finish_reason is not None:
                continue  # already stopped by a stop string; the engine is catching up
            yield choice, self._accept(choice, out), out.new_token_ids
            if self.is_finished and self.output is None:
                self.abort()  # stop strings ended every choice before the engine did

    def _accept(self, choice: Choice, out: StepOutput) -> str:
        """Append the step's tokens and text; returns the text that may be streamed now."""
        choice.token_ids += out.new_token_ids
        reason = out.finish_reason
        start = max(len(choice.text) - self._holdback - 1, 0)
        choice.text += self._decode_new(choice, final=reason is not None)
        cut = min((i for i in (choice.text.find(s, start) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            choice.text, reason = choice.text[:cut], "stop"
        choice.finish_reason = reason
        # hold back a possible start of a stop string until it is decided
        stable = len(choice.text) if reason else max(len(choice.text) - self._holdback,
                                                     choice.sent)
        delta = choice.text[choice.sent:stable]
        choice.sent += len(delta)
        return delta

    def _decode_new(self, choice: Choice, final: bool) -> str:
        """Text the tokens since the last decode add (vLLM's incremental detokenization):
        decoding a window that starts at already-emitted tokens keeps their context (spaces,
        clean-up rules), and a trailing U+FFFD (a partial character) waits for more tokens."""
        tokens, decode = choice.token_ids, self._tokenizer.decode
        prefix = decode(tokens[choice.prefix_offset:choice.read_offset])
        full = decode(tokens[choice.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            choice.prefix_offset, choice.read_offset = choice.read_offset, len(tokens)
            return full[len(prefix):]
        return ""

    def usage(self) -> dict:
        """OpenAI's usage, with the prompt tokens the prefix cache served, where they came
        from (``cached_tokens_by_source``: device, host, disk, remote) and why the first
        uncached full block missed (``miss``: `paged_kv.tenants.Miss.as_dict`, null when
        every full block hit; under a tenant's key without ``by``, another tenant's name:
        `paged_kv.engine.misses.miss_seen_by`)."""
        completion = sum(len(c.token_ids) for c in self.choices)
        output = self.output
        cached = output.prefix_hit_tokens if output else 0
        prompt = len(self.prompt_token_ids)
        details = {"cached_tokens": cached,
                   "cached_tokens_by_source": dict((output and output.cached_by_source) or {}),
                   # another tenant's name only for an admin's (or keyless) request
                   "miss": miss_seen_by(output.miss if output else None, self.salt)}
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": details}
