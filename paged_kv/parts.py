"""`EnginePart`: what an optional part of an engine (the tiers, the KV-event publisher, a
hand-off role) may hook, each hook a no-op until a part overrides it. The engine holds the
parts it has in a list and calls each hook on every part, in their order, so a new part is
one class and no edit of the engine's step.

Dependency-free, at the package's root: the parts live on lower floors than the engine
(``tiers``, ``events``, ``handoff``) and import this, never the engine.
"""

from __future__ import annotations

from typing import Any


class EnginePart:
    """The hooks, in the order a request and a step meet them.

    ``wants_events``: whether `after_step` needs the step's cache events (the engine takes
    them from the cache only when some part does).
    """

    wants_events = False

    def admit(self, request: Any, handoff: Any) -> str | None:
        """A new request (and its ``kv_transfer_params``, or None); an error message fails
        it at once."""
        return None

    def tick(self, scheduler: Any) -> list[tuple[int, str]]:
        """After scheduling, before the model runs: ``(request id, error)`` of the requests
        the engine must fail now."""
        return []

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """The model ran `num_tokens` tokens in `seconds` (the rate of a recompute)."""

    def finished(self, request: Any) -> None:
        """`request` finished (before its last output is emitted)."""

    def after_step(self, events: list) -> None:
        """The step's cache events (only for a part that `wants_events`)."""

    def forget(self, request: Any) -> None:
        """`request` was aborted or failed: release what this part holds for it."""

    def text(self) -> str:
        """This part's Prometheus exposition, appended to the engine's."""
        return ""

    def close(self) -> None:
        """Stop threads, close sockets."""
