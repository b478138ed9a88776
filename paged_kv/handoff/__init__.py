"""Prefill on one engine, decode on another: a request's prompt pages handed over.

A prefill engine (``paged-kv serve --role prefill``) runs a ``do_remote_decode`` request's
prompt, copies its full blocks out as self-verifying tier values (`paged_kv.tiers.codec`)
into a lease (`lease.LeaseTable`; the device blocks are freed as usual) and serves them
over ZMQ (`server.HandoffServer`); its response's ``kv_transfer_params`` say where. A
decode engine (``--role decode``) pulls them through the tiers' fetch path (`peer`), which
verifies every value and loads the blocks as cached device blocks; the request computes
only its last block. A hand-off that cannot load falls back (recompute or fail), counted
by reason (`params.REASONS`), never silently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import HandoffConfig, add_handoff_flags

if TYPE_CHECKING:
    import torch

    from ..core.cache import PagedKVCache
    from ..parts import EnginePart
    from ..tiers.manager import TierManager

__all__ = ["HandoffConfig", "add_handoff_flags", "open_role"]


def open_role(config: HandoffConfig | None, cache: PagedKVCache, tiers: TierManager | None,
              model: torch.nn.Module) -> EnginePart | None:
    """The engine's hand-off role: a `prefill.PrefillRole` or a `peer.DecodeRole` (None for
    ``both``: no hand-off). Imported here, as they need the serve extra (pyzmq, msgspec).
    Its blocks' fingerprint is the tiers' (a decode engine always has tiers), else the
    model's (`paged_kv.tiers.identity.model_fingerprint`)."""
    if config is None or config.role == "both":
        return None
    from ..tiers.identity import model_fingerprint

    fingerprint = (tiers.fingerprint if tiers is not None
                   else model_fingerprint(model, cache.config, ""))
    if config.role == "prefill":
        from .prefill import PrefillRole

        return PrefillRole(config, cache, fingerprint)
    from .peer import DecodeRole

    return DecodeRole(config, cache, fingerprint)
