"""Who sees which tenant's numbers on ``GET /metrics``.

Some series are labelled by tenant (``paged_kv_tenant_blocks``, ``paged_kv_prefix_misses``,
``paged_kv_tenant_prefix_*_tokens``, ``paged_kv_tier_tenant_blocks``): a tenant's blocks,
prefix tokens and misses, which say what it sends. With ``--api-keys`` they are the same
secret the dashboard keeps (``dashboard.viewer``), so ``/metrics`` shows them by key:

- an admin key (or a server without ``--api-keys``): every series;
- a tenant's key: the pool's series and that tenant's own;
- no key: the pool's series only, no tenant's, so a Prometheus scrape without credentials
  keeps working (blocks by state, running and waiting requests, prefix hits in all, HTTP
  counters and latencies);
- an unknown key: 401, as on ``/v1`` (a scraper given the wrong key should hear it).

One port, the API's, rather than a metrics port of its own: a scraper's bearer token
(Prometheus' ``authorization`` in a scrape config) is all an operator adds to see tenants.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .service import OpenAIService

# one label of a sample's label set: name="value", the value with \\, \" and \n escaped
_LABEL = re.compile(r'\s*([A-Za-z_]\w*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPED = re.compile(r"\\(.)")


def metrics_viewer(svc: OpenAIService, authorization: str) -> tuple[str | None, bool]:
    """``(tenant, sees every tenant)`` of a ``/metrics`` request's ``Authorization`` header:
    every tenant without API keys or for an admin key; a tenant's key its own (tenant,
    False); no key none (None, False).

    Raises
    ------
    ApiError
        401 for a key that is neither a tenant's nor an admin's.
    """
    if svc.api_keys is None:
        return None, True
    if not authorization.partition(" ")[2].strip():
        return None, False
    return svc.authenticate(authorization)


def scoped_exposition(text: str, tenant: str | None) -> str:
    """Prometheus exposition `text` without the samples labelled with a tenant other than
    `tenant` (None: without any tenant's). Comments (``# HELP``, ``# TYPE``) stay, so a
    family whose samples all left is still declared, with no samples (valid exposition).

    Examples
    --------
    >>> text = ('paged_kv_blocks{state="free"} 9.0\\n'
    ...         'paged_kv_tenant_blocks{tenant="acme",state="live"} 2.0\\n'
    ...         'paged_kv_tenant_blocks{tenant="beta",state="live"} 5.0\\n')
    >>> print(scoped_exposition(text, None), end="")
    paged_kv_blocks{state="free"} 9.0
    >>> print(scoped_exposition(text, "acme"), end="")
    paged_kv_blocks{state="free"} 9.0
    paged_kv_tenant_blocks{tenant="acme",state="live"} 2.0
    """
    return "".join(line for line in text.splitlines(keepends=True)
                   if (found := sample_tenant(line)) is None or found == tenant)


def sample_tenant(line: str) -> str | None:
    """The ``tenant`` label's value of an exposition line; None for a comment or a sample
    without one. The label set is read label by label, so a tenant-like text inside
    another label's value is never taken for the label."""
    brace = line.find("{")
    if line.startswith("#") or brace < 0 or " " in line[:brace]:
        return None
    at = brace + 1
    while (label := _LABEL.match(line, at)) is not None:
        if label[1] == "tenant":
            return _ESCAPED.sub(lambda m: "\n" if m[1] == "n" else m[1], label[2])
        at = label.end()
    return None
