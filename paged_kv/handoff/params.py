"""The hand-off's parameters (``kv_transfer_params``, vLLM's name; the engine's flags are
`config.HandoffConfig`).

A request to a prefill engine carries ``{"do_remote_decode": true}``; its response carries
where its pages are leased (``remote_engine``, ``lease``, ``block_keys``, ``first_token``,
``num_prompt_tokens``, ``lease_seconds``; a hybrid layout's also ``group_starts``, see
`HandoffParams`), and its ``signature`` of them (`trust.HandoffTrust.sign_params`). The
decode engine gets those back with ``do_remote_prefill: true`` and pulls nothing unless
the signature verifies. A field of the wrong type is the client's error (400 naming
``kv_transfer_params.FIELD``); a field missing on a decode engine is a hand-off that
could not load (`config.MISSING_PARAMS`), never a silent re-prefill.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from ..core.groups.rules import group_key

_HEX = re.compile(r"^[0-9a-f]+$")
# a host name, an IPv4 address or a bracketed IPv6 one, and a port: what ZMQ can connect to
# (anything else fails inside ``connect``, on the engine's thread)
_ENDPOINT = re.compile(r"^tcp://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\])"
                       r":(?:[1-9][0-9]{0,4})$")
MAX_LEASE_SECONDS = 86400.0  # a lease longer than a day is no lease
_NEEDED = ("remote_engine", "lease", "block_keys", "num_prompt_tokens")


class HandoffParams(msgspec.Struct, omit_defaults=True):
    """One request's ``kv_transfer_params``, as the API server parsed them (carried to the
    engine core in `messages.Add`).

    ``block_keys`` are the leading layer group's keys (the chained keys of the prompt's
    full blocks: what the decode engine checks against its own, tenant salt included).
    A hybrid layout (layer groups, `paged_kv.core.groups`) leases each other group's blocks
    too, under their `paged_kv.core.groups.rules.group_key`: ``group_starts[i - 1]`` is the
    first column of ``block_keys`` whose block of group ``i`` is leased, every column
    from there to the end of ``block_keys`` is (a window group's last window only: what
    a prefix hit at the prompt's end reads). Absent for a uniform layout.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine: str | None = None
    lease: str | None = None
    block_keys: list[str] | None = None
    first_token: int | None = None
    num_prompt_tokens: int | None = None
    lease_seconds: float | None = None
    group_starts: list[int] | None = None
    signature: str | None = None

    @property
    def missing(self) -> list[str]:
        """The fields a decode engine needs that these lack."""
        return [name for name in _NEEDED if getattr(self, name) is None]

    def key_bytes(self) -> list[bytes]:
        """``block_keys`` as bytes."""
        return [bytes.fromhex(key) for key in self.block_keys or ()]

    def lacks(self, num_groups: int) -> list[str]:
        """`missing`, for an engine of `num_groups` layer groups (0 or 1: uniform); a
        hybrid one also needs ``group_starts``, one per group after the leading one."""
        missing = self.missing
        if num_groups > 1 and len(self.group_starts or ()) != num_groups - 1:
            missing.append("group_starts")
        return missing

    def leased_keys(self) -> list[bytes]:
        """Every key the lease holds: ``block_keys``, then each other group's leased
        blocks under its `group_key` (``group_starts``)."""
        keys = self.key_bytes()
        return keys + [group_key(key, index) for index, start
                       in enumerate(self.group_starts or (), start=1) for key in keys[start:]]


def _check(name: str, value: Any, kind: type | tuple, test=lambda v: True,
           expected: str = "") -> None:
    if value is None:
        return
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind) \
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
           lambda v: bool(_ENDPOINT.match(v)) and int(v.rpartition(":")[2]) < 65536,
           "tcp://HOST:PORT")
    _check("lease", value.get("lease"), str, lambda v: bool(_HEX.match(v)) and len(v) <= 64,
           "a hex string")
    _check("block_keys", value.get("block_keys"), list,
           lambda v: all(isinstance(k, str) and len(k) == 64 and _HEX.match(k) for k in v),
           "a list of 64-character hex keys")
    for name in ("first_token", "num_prompt_tokens"):
        _check(name, value.get(name), int, lambda v: 0 <= v < 2**63, "an int >= 0")
    _check("group_starts", value.get("group_starts"), list,
           lambda v: len(v) < 256 and all(isinstance(s, int) and not isinstance(s, bool)
                                          and 0 <= s < 2**31 for s in v),
           "a list of ints >= 0, one per layer group after the first")
    _check("lease_seconds", value.get("lease_seconds"), (int, float),
           lambda v: math.isfinite(v) and 0 < v <= MAX_LEASE_SECONDS,
           f"seconds in (0, {MAX_LEASE_SECONDS:.0f}]")
    _check("signature", value.get("signature"), str,
           lambda v: len(v) == 64 and bool(_HEX.match(v)), "64 hex characters")
    fields = {f: value[f] for f in HandoffParams.__struct_fields__ if value.get(f) is not None}
    return HandoffParams(**fields)
