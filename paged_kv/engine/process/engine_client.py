"""`EngineClient`: what the HTTP room needs of an engine, met by `InprocClient` (the engine
core on a thread of this process) and by `CoreClient` (the engine core in a process of its
own); both report `EngineCore.num_waiting`, the one count of waiting requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .. import SamplingParams, StepOutput
from ..limits import EngineLimits


class EngineClient(Protocol):
    """The engine as `OpenAIService` and `Generation` use it."""

    @property
    def dead(self) -> str | None:
        """Why the engine cannot serve any more (health: 503); None while it can."""

    @property
    def is_alive(self) -> bool:
        """Whether requests can be served."""

    @property
    def num_waiting(self) -> int:
        """Requests that would wait for a running slot."""

    @property
    def limits(self) -> EngineLimits:
        """What requests are checked against before they reach the engine."""

    @property
    def registry(self):
        """The prometheus registry for the server's own counters."""

    def start(self) -> None:
        """Start serving (with the app)."""

    def stop(self) -> None:
        """Stop serving (with the app)."""

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, salt: str | None,
                  on_output: Callable[[StepOutput], None], *, priority: int | None = None,
                  retention_seconds: float | None = None, handoff=None) -> int:
        """Queue a request; `on_output` runs on the calling event loop per step output;
        `priority` and `retention_seconds`: its blocks' soft retention once finished;
        `handoff`: its ``kv_transfer_params`` (`paged_kv.handoff.HandoffParams`)."""

    async def flush_tenant(self, tenant: str | None, retention_only: bool = False) -> int:
        """An admin's flush (or unretain) of a tenant's cached blocks; how many (ValueError
        for a tenant the engine refuses)."""

    async def cached_tokens(self, prompt_token_ids: list[int], salt: str | None) -> int:
        """Tokens of the prompt's full blocks cached for `salt` now (changes nothing)."""

    def announce(self) -> None:
        """A generation request has arrived and its `add` follows once it is read and
        checked (or never, when refused): a hint that lets a step wait for it."""

    def abort(self, request_id: int) -> None:
        """Free a request's blocks (does not wait), while the engine drains too; nothing
        once it is gone."""

    async def metrics_text(self) -> str:
        """Prometheus exposition: the engine's gauges and the server's counters."""

