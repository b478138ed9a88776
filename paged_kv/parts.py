"""`EnginePart`: what an optional part of an engine (the tiers, the KV-event publisher, a
hand-off role, or the caller's own) may hook, each hook a no-op until a part overrides it.
The engine builds the parts its `paged_kv.engine.config.EngineConfig` names, each from a
`PartContext`, holds them in a list and calls each hook on every part, in their order, so a
new part is one class (and a field of the config, or an entry of its ``parts``) and no edit
of the engine.

Dependency-free, at the package's root: the parts live on lower floors than the engine
(``tiers``, ``events``, ``handoff``) and import this, never the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
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


@dataclasses.dataclass(frozen=True)
class PartContext:
    """What a part is built from (a part factory's one argument).

    Parameters
    ----------
    cache : PagedKVCache
        The engine's cache (its ``config``: the block size, the pool).
    model : torch.nn.Module
        The engine's model (this rank's, with tensor parallelism).
    parts : Mapping[str, EnginePart]
        The parts built before this one, by name (``"tiers"``, ``"events"``, ``"handoff"``,
        ``"parts[i]"``): e.g. the publisher and a decode role use the tiers.
    """

    cache: Any
    model: Any
    parts: Mapping[str, EnginePart]


def build_parts(factories: Mapping[str, Callable[[PartContext], EnginePart | None]],
                cache: Any, model: Any) -> dict[str, EnginePart]:
    """Each of `factories` called in order with a `PartContext` holding the parts built
    before it; the parts by name (a factory's None: no part). When one fails, those built
    already are closed (`close_parts`) before its exception goes on.

    Raises
    ------
    TypeError
        A factory returned something other than an `EnginePart` or None, naming it.
    """
    built: dict[str, EnginePart] = {}
    try:
        for name, factory in factories.items():
            part = factory(PartContext(cache, model, dict(built)))
            if part is not None and not isinstance(part, EnginePart):
                raise TypeError(f"{name}: its factory returned {type(part).__name__}, "
                                f"not an EnginePart")
            if part is not None:
                built[name] = part
    except BaseException:
        close_parts(built.values())
        raise
    return built


def close_parts(parts: Iterable[EnginePart]) -> None:
    """Close `parts`, the last built first (a later part may use an earlier one)."""
    for part in reversed(list(parts)):
        part.close()
