"""Proof that a hand-off's parts come from the engines and the router that share the hand-off
secret, without the secret ever leaving a process (standard library only: the router
imports it without the serve extra).

Every key is derived from the secret under a label of its own (HMAC-SHA256), so a MAC made
for one purpose never passes for another:

- the prefill engine signs the ``kv_transfer_params`` it answers with (`sign_params`): the
  endpoint, the lease, the block keys (the tenant's salt is inside them), the group starts
  and the counts. A decode engine checks the signature before it contacts anything
  (`params_signed`), so no client can name the endpoint it pulls from;
- every ZMQ message to a prefill engine carries a MAC of its verb, lease and keys
  (`request_mac`), never the secret: an endpoint that receives one learns nothing it can
  reuse for another message;
- every value a prefill engine serves comes with a MAC of its lease, key and bytes
  (`value_mac`): a value from another lease, from an engine without the secret, or
  changed on the wire fails, however well its own header and checksum are forged. It is
  Poly1305 under a one-time key derived (HMAC-SHA256) from the lease and the key: a lease
  holds one value per key, so each one-time key only ever tags that one value, as
  Poly1305 requires; and it runs at ~8 GB/s a core where HMAC-SHA256 runs at ~1.7 (the
  wire moves pages at ~1.3 GB/s: HMAC-SHA256 on both sides cut it to ~0.5);
- the router signs each body it sends to a role engine, with the time (`router_header`);
  an engine takes ``do_remote_decode`` / ``do_remote_prefill`` only in a body so signed
  (`router_error`), so a client can neither make a prefill engine lease pages nor hand a
  decode engine parameters.

What this does not give: secrecy of the pages on the wire (they travel in clear, as the
tiers' values do: keep the engines' network private), and freshness past `MAX_SKEW_S` (a
router body seen on the wire can be replayed that long).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from collections.abc import Iterable, Mapping
from typing import Any

try:  # the serve extra's; only the engines' page MACs need it (the router does not)
    from cryptography.hazmat.primitives.poly1305 import Poly1305
except ImportError:  # pragma: no cover - the serve extra installs it
    Poly1305 = None

HEADER = "x-paged-kv-handoff"  # the router's signature of a body: "TIME:HEX"
MAX_SKEW_S = 300.0  # a router signature older (or further ahead) than this is refused
MAC_BYTES = 16  # a value's Poly1305 tag
# the fields of kv_transfer_params a prefill engine signs, in the order they are signed
SIGNED_FIELDS = ("remote_engine", "lease", "block_keys", "first_token", "num_prompt_tokens",
                 "lease_seconds", "group_starts")
_LABELS = ("params", "request", "value", "router")


def _framed(parts: Iterable[bytes | memoryview]) -> Iterable[bytes | memoryview]:
    """Each part behind its length, so no two sequences of parts read alike."""
    for part in parts:
        yield struct.pack("<Q", len(part))
        yield part


class HandoffTrust:
    """The MACs of one hand-off secret (see the module docstring).

    Parameters
    ----------
    secret : str
        Shared by the router and the engines (non-empty).

    Raises
    ------
    ValueError
        For an empty secret: every MAC would be forgeable by anyone.
    """

    def __init__(self, secret: str) -> None:
        if not isinstance(secret, str) or not secret:
            raise ValueError("hand-off secret: expected a non-empty string shared by the "
                             "router and the engines (--handoff-secret or "
                             "$PAGED_KV_HANDOFF_SECRET)")
        master = secret.encode()
        self._keys = {label: hmac.digest(master, b"paged-kv hand-off " + label.encode(),
                                         "sha256") for label in _LABELS}

    def _mac(self, label: str, parts: Iterable[bytes | memoryview]) -> bytes:
        mac = hmac.new(self._keys[label], digestmod=hashlib.sha256)
        for part in _framed(parts):
            mac.update(part)  # (hashlib lets other threads run over a large part)
        return mac.digest()

    # -- kv_transfer_params ---------------------------------------------------------------
    def sign_params(self, params: Mapping[str, Any]) -> str:
        """The signature (hex) of a prefill engine's ``kv_transfer_params``."""
        fields = [params.get(name) for name in SIGNED_FIELDS]
        canonical = json.dumps(fields, separators=(",", ":"), allow_nan=False)
        return self._mac("params", [canonical.encode()]).hex()

    def params_signed(self, params: Any) -> bool:
        """Whether `params` (a `HandoffParams`) carry this secret's signature of their
        fields."""
        signature = getattr(params, "signature", None)
        if not isinstance(signature, str):
            return False
        try:
            expected = self.sign_params({name: getattr(params, name)
                                         for name in SIGNED_FIELDS})
        except ValueError:  # a float json cannot write (nan, inf): never signed
            return False
        return hmac.compare_digest(expected, signature)

    # -- the wire between the engines -----------------------------------------------------
    def request_mac(self, verb: bytes, lease: bytes, keys: Iterable[bytes]) -> bytes:
        """The MAC a message to a prefill engine carries in place of the secret."""
        return self._mac("request", [verb, lease, *keys])

    def request_ok(self, mac: bytes, verb: bytes, lease: bytes,
                   keys: Iterable[bytes]) -> bool:
        """Whether a message's `mac` is this secret's for its verb, lease and keys."""
        return hmac.compare_digest(self.request_mac(verb, lease, keys), mac)

    def value_mac(self, lease: bytes, key: bytes, value: bytes | memoryview) -> bytes:
        """The MAC of one served value: Poly1305 of its bytes under the one-time key of its
        lease and key (see the module docstring)."""
        if Poly1305 is None:
            raise ImportError("the hand-off's page MACs need the cryptography package: "
                              "pip install 'paged_kv[serve]'")
        return Poly1305.generate_tag(self._mac("value", [lease, key]), value)

    def values_ok(self, macs: bytes | memoryview, lease: bytes, keys: list[bytes],
                  values: list[bytes | memoryview]) -> list[bool]:
        """For each value, whether its MAC (``macs``: `MAC_BYTES` per value, in order) is
        right; all False when ``macs`` is not one per value."""
        macs = bytes(macs)
        if len(macs) != MAC_BYTES * len(values) or len(keys) != len(values):
            return [False] * len(values)
        return [hmac.compare_digest(self.value_mac(lease, key, value),
                                    macs[i * MAC_BYTES:(i + 1) * MAC_BYTES])
                for i, (key, value) in enumerate(zip(keys, values, strict=True))]

    # -- the router's bodies --------------------------------------------------------------
    def router_header(self, body: bytes, now: float | None = None) -> str:
        """The value of `HEADER` for a body the router sends to a role engine."""
        stamp = str(int(time.time() if now is None else now))
        return f"{stamp}:{self._router_mac(stamp, body)}"

    def _router_mac(self, stamp: str, body: bytes) -> str:
        return self._mac("router", [stamp.encode(), body]).hex()

    def router_error(self, header: str | None, body: bytes,
                     now: float | None = None) -> str | None:
        """Why `header` does not prove the router sent `body` (None: it does)."""
        if not header:
            return f"no {HEADER} header (only the router, holding the hand-off secret, " \
                   f"may send it)"
        stamp, _, mac = header.partition(":")
        if not stamp.isdigit():
            return f"{HEADER}: expected TIME:HMAC, got {header[:80]!r}"
        skew = abs((time.time() if now is None else now) - int(stamp))
        if skew > MAX_SKEW_S:
            return f"{HEADER}: signed {skew:.0f} s from now, past {MAX_SKEW_S:.0f} s " \
                   f"(a replay, or the clocks of router and engine disagree)"
        if not hmac.compare_digest(self._router_mac(stamp, body), mac):
            return f"{HEADER}: the signature does not match this engine's hand-off secret"
        return None
