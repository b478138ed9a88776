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

from ..cache import PagedKVCache
from ..tiers import codec
from .params import HandoffConfig, HandoffParams, parse_params
from .peer import DecodeRole, PeerSource
from .prefill import PrefillRole

__all__ = ["DecodeRole", "HandoffConfig", "HandoffParams", "PeerSource", "PrefillRole",
           "open_role", "parse_params"]


def open_role(config: HandoffConfig | None, cache: PagedKVCache,
              fingerprint: codec.Fingerprint) -> PrefillRole | DecodeRole | None:
    """The engine's hand-off role (None for ``both``: no hand-off)."""
    if config is None or config.role == "both":
        return None
    return (PrefillRole if config.role == "prefill" else DecodeRole)(config, cache, fingerprint)
