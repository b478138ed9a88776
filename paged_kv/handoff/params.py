"""The hand-off's parameters (``kv_transfer_params``, vLLM's name), the engine's hand-off
flags (`HandoffConfig`), and the fallback reasons.

A request to a prefill engine carries ``{"do_remote_decode": true}``; its response carries
where its pages are leased (``remote_engine``, ``lease``, ``block_keys``, ``first_token``,
``num_prompt_tokens``, ``lease_seconds``). The decode engine gets those back with
``do_remote_prefill: true``. A field of the wrong type is the client's error (400 naming
``kv_transfer_params.FIELD``); a field missing on a decode engine is a hand-off that
could not load (`MISSING_PARAMS`), never a silent re-prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import msgspec

ROLES = ("both", "prefill", "decode")
POLICIES = ("recompute", "fail")
# every reason a decode engine fell back (paged_kv_handoff_fallbacks_total{reason})
MISSING_PARAMS, ENGINE_GONE, LEASE_EXPIRED = "missing_params", "engine_gone", "lease_expired"
TRANSFER_FAILED, VERIFY_FAILED, TENANT_MISMATCH = ("transfer_failed", "verify_failed",
                                                   "tenant_mismatch")
REASONS = (MISSING_PARAMS, ENGINE_GONE, LEASE_EXPIRED, TRANSFER_FAILED, VERIFY_FAILED,
           TENANT_MISMATCH)
# the error message of a request failed by the `fail` policy starts so (HTTP 502)
ERROR_PREFIX = "kv hand-off failed"
_HEX = re.compile(r"^[0-9a-f]+$")
_NEEDED = ("remote_engine", "lease", "block_keys", "num_prompt_tokens")


class HandoffParams(msgspec.Struct, omit_defaults=True):
    """One request's ``kv_transfer_params``, as the API server parsed them (carried to the
    engine core in `messages.Add`)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine: str | None = None
    lease: str | None = None
    block_keys: list[str] | None = None
    first_token: int | None = None
    num_prompt_tokens: int | None = None
    lease_seconds: float | None = None

    @property
    def missing(self) -> list[str]:
        """The fields a decode engine needs that these lack."""
        return [name for name in _NEEDED if getattr(self, name) is None]

    def keys(self) -> list[bytes]:
        """``block_keys`` as bytes."""
        return [bytes.fromhex(key) for key in self.block_keys or ()]


def _check(name: str, value: Any, kind: type | tuple, test=lambda v: True,
           expected: str = "") -> None:
    if value is None:
        return
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind) \
            or not test(value):
        raise ValueError(f"kv_transfer_params.{name}: expected {expected or kind.__name__}, "
                         f"got {value!r}")


def parse_params(value: Any) -> HandoffParams | None:
    """``kv_transfer_params`` of a request body (None: absent).

    Raises
    ------
    ValueError
        Naming ``kv_transfer_params.FIELD`` for a field of the wrong type or form.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_params: expected an object, got {value!r}")
    for name in ("do_remote_decode", "do_remote_prefill"):
        _check(name, value.get(name), bool)
    _check("remote_engine", value.get("remote_engine"), str,
           lambda v: v.startswith("tcp://"), "tcp://HOST:PORT")
    _check("lease", value.get("lease"), str, lambda v: bool(_HEX.match(v)) and len(v) <= 64,
           "a hex string")
    _check("block_keys", value.get("block_keys"), list,
           lambda v: all(isinstance(k, str) and len(k) == 64 and _HEX.match(k) for k in v),
           "a list of 64-character hex keys")
    for name in ("first_token", "num_prompt_tokens"):
        _check(name, value.get(name), int, lambda v: 0 <= v < 2**63, "an int >= 0")
    _check("lease_seconds", value.get("lease_seconds"), (int, float), lambda v: v > 0,
           "seconds > 0")
    fields = {f: value[f] for f in HandoffParams.__struct_fields__ if value.get(f) is not None}
    return HandoffParams(**fields)


@dataclasses.dataclass(frozen=True)
class HandoffConfig:
    """An engine's part in a hand-off (the ``--role`` / ``--handoff-*`` flags).

    Parameters
    ----------
    role : {"both", "prefill", "decode"}
        ``both``: no hand-off (today's engine); ``prefill``: requests with
        ``do_remote_decode`` keep their prompt's pages under a lease, served on
        `host`:`port`; ``decode``: requests are expected to carry the prefill's parameters.
    host, port : str, int
        Where a prefill engine serves its leased pages (port 0: a free one).
    secret : str
        Shared by the engines: a pull without it is refused.
    lease_s : float
        Seconds a lease lives without a heartbeat.
    failure : {"recompute", "fail"}
        What a decode engine does with a hand-off it cannot load.
    max_lease_mib : float
        Host bytes the leases may hold (the oldest leases go first).
    """

    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 0
    secret: str = ""
    lease_s: float = 30.0
    failure: str = "recompute"
    max_lease_mib: float = 1024.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")
        if self.failure not in POLICIES:
            raise ValueError(f"failure: expected one of {POLICIES}, got {self.failure!r}")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s: expected seconds > 0, got {self.lease_s!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: expected 0..65535, got {self.port!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HandoffConfig | None:
        """The config of ``paged-kv serve``'s flags; None for role ``both``."""
        role = getattr(args, "role", "both")
        if role == "both":
            return None
        return cls(role, args.handoff_host, args.handoff_port or 0, args.handoff_secret or "",
                   args.handoff_lease_s, args.handoff_failure)


def add_handoff_flags(parser: argparse.ArgumentParser) -> None:
    """``paged-kv serve``'s hand-off flags (prefill on one engine, decode on another)."""
    group = parser.add_argument_group("prefill/decode hand-off between engines")
    group.add_argument("--role", choices=ROLES, default="both",
                       help="both: today's engine; prefill: lease each do_remote_decode "
                            "request's pages; decode: pull them from the prefill engine")
    group.add_argument("--handoff-host", default="127.0.0.1",
                       help="the address a prefill engine serves its pages on")
    group.add_argument("--handoff-port", type=int, default=0,
                       help="the ZMQ port a prefill engine serves its pages on (0: a free one)")
    group.add_argument("--handoff-secret", default="",
                       help="shared by the engines: pulls without it are refused")
    group.add_argument("--handoff-lease-s", type=float, default=30.0,
                       help="seconds a prefill engine keeps a request's pages unclaimed "
                            "(a decode engine's heartbeat extends it)")
    group.add_argument("--handoff-failure", choices=POLICIES, default="recompute",
                       help="a hand-off a decode engine cannot load: prefill locally "
                            "(counted, logged) or fail the request (HTTP 502)")
