"""An engine's hand-off flags and config (`HandoffConfig`), and the fallback reasons:
no dependency beyond the standard library, so ``paged-kv``'s parser needs no extra."""

from __future__ import annotations

import argparse
import dataclasses
import os

SECRET_ENV = "PAGED_KV_HANDOFF_SECRET"
ROLES = ("both", "prefill", "decode")
POLICIES = ("recompute", "fail")
# every reason a decode engine fell back (paged_kv_handoff_fallbacks_total{reason})
MISSING_PARAMS, ENGINE_GONE, LEASE_EXPIRED = "missing_params", "engine_gone", "lease_expired"
TRANSFER_FAILED, VERIFY_FAILED, TENANT_MISMATCH = ("transfer_failed", "verify_failed",
                                                   "tenant_mismatch")
UNSIGNED = "unsigned"  # parameters the hand-off secret did not sign: nothing contacted
REASONS = (MISSING_PARAMS, ENGINE_GONE, LEASE_EXPIRED, TRANSFER_FAILED, VERIFY_FAILED,
           TENANT_MISMATCH, UNSIGNED)
# the error message of a request failed by the `fail` policy starts so (HTTP 502)
ERROR_PREFIX = "kv hand-off failed"

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
        Shared by the engines and the router (required for a role): the key of every MAC
        of `paged_kv.handoff.trust`; it never leaves the process.
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
        if not 0 < self.lease_s < float("inf"):  # (nan fails too)
            raise ValueError(f"lease_s: expected finite seconds > 0, got {self.lease_s!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: expected 0..65535, got {self.port!r}")
        if self.role != "both" and not self.secret:
            raise ValueError(f"secret: role {self.role} needs the hand-off secret the router "
                             f"and the other engines share (--handoff-secret, or "
                             f"${SECRET_ENV}): without it any client could forge a hand-off")

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
    group.add_argument("--handoff-port", type=_port, default=0,
                       help="the ZMQ port a prefill engine serves its pages on (0: a free one)")
    group.add_argument("--handoff-secret", default=os.environ.get(SECRET_ENV, ""),
                       help=f"shared by the engines and the router (required with --role "
                            f"prefill/decode): it signs the hand-off parameters, the messages "
                            f"and the pages between engines, and never travels (default: "
                            f"${SECRET_ENV}, which keeps it out of the process list)")
    group.add_argument("--handoff-lease-s", type=_seconds, default=30.0,
                       help="seconds a prefill engine keeps a request's pages unclaimed "
                            "(a decode engine's heartbeat extends it)")
    group.add_argument("--handoff-failure", choices=POLICIES, default="recompute",
                       help="a hand-off a decode engine cannot load: prefill locally "
                            "(counted, logged) or fail the request (HTTP 502)")


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value
