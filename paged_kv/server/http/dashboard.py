"""``GET /dashboard``: a live page of the pool, drawn from the same text ``/metrics`` serves.

The page (``static/dashboard.html``) polls ``/dashboard/state`` about once a second and keeps
its own time series; the charts are plotly's, served from the installed ``plotly`` package
(``/dashboard/plotly.min.js``), so the page needs no internet. ``/dashboard/state`` parses the
server's exposition text with prometheus-client's parser (`dashboard_state`), so the page
shows exactly what ``/metrics`` shows.

Who sees what: without ``--api-keys``, or with an admin key (the service's ``admin_keys``,
when it has them), the whole page; a tenant's key sees the pool's totals and its own rows
only (its tenant's blocks, prefix tokens and misses); no key, or an unknown one, is a 401.
"""

from __future__ import annotations

import collections
import importlib.util
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from prometheus_client.parser import text_string_to_metric_families

from .protocol import error_response
from .routes import service

router = APIRouter()
POOL_STATES = ("live", "cached", "free")
TENANT_STATES = ("live", "cached", "retained")
_Samples = dict[str, list[tuple[dict[str, str], float]]]


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    """The page itself (static: it holds no numbers, so it needs no key)."""
    page = resources.files(__package__).joinpath("static/dashboard.html").read_text("utf-8")
    return HTMLResponse(page, headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/plotly.min.js", include_in_schema=False)
async def plotly_js() -> Response:
    """The installed plotly package's bundled plotly.js; 404 naming the package without it
    (the page then shows its numbers and tables, without charts)."""
    path = plotly_bundle()
    if path is None:
        return error_response(404, "the dashboard's charts need the plotly package: "
                              "pip install 'paged_kv[serve]'", type_="not_found_error")
    return FileResponse(path, media_type="text/javascript",
                        headers={"Cache-Control": "max-age=86400"})


@router.get("/dashboard/state", include_in_schema=False)
async def dashboard_json(request: Request) -> JSONResponse:
    """The page's numbers now, for the caller's key (401 without a good one)."""
    tenant, whole = viewer(request)
    text = await service(request).metrics_text()
    return JSONResponse(dashboard_state(text, None if whole else tenant),
                        headers={"Cache-Control": "no-store"})


def plotly_bundle() -> Path | None:
    """``plotly/package_data/plotly.min.js`` of the installed plotly (found without
    importing it); None when plotly is not installed."""
    spec = importlib.util.find_spec("plotly")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    return None


def viewer(request: Request) -> tuple[str | None, bool]:
    """``(tenant, sees the whole page)`` of the request's ``Authorization`` header: the
    whole page without API keys or for an admin key, else the key's tenant's share.

    Raises
    ------
    ApiError
        401 for a missing or unknown key.
    """
    svc = service(request)
    if svc.api_keys is None:
        return None, True
    authorization = request.headers.get("authorization", "")
    key = authorization.partition(" ")[2].strip()
    if key and key in svc.admin_keys:
        return None, True
    return svc.tenant(authorization), False


def dashboard_state(text: str, tenant: str | None = None) -> dict:
    """The page's numbers from Prometheus exposition `text` (``/metrics``): pool blocks by
    state, blocks and prefix tokens by tenant, each tier's blocks and bytes, the prefix
    cache's query and hit tokens, misses by reason, running and waiting requests.

    Parameters
    ----------
    text : str
        Exposition text, as ``/metrics`` serves it.
    tenant : str, optional
        Only this tenant's rows (its blocks, prefix tokens and misses; the pool's and the
        tiers' totals stay). None: every tenant.
    """
    samples = _parse(text)
    tenants = _tenants(samples, tenant)
    if tenant is None:
        prefix = {"query_tokens": _sum(samples, "paged_kv_prefix_query_tokens_total"),
                  "hit_tokens": _sum(samples, "paged_kv_prefix_hit_tokens_total")}
    else:
        own = tenants.get(tenant, {})
        prefix = {"query_tokens": own.get("query_tokens", 0),
                  "hit_tokens": own.get("hit_tokens", 0)}
    misses: dict[str, float] = collections.Counter()
    for labels, value in samples.get("paged_kv_prefix_misses_total", ()):
        if tenant is None or labels.get("tenant") == tenant:
            misses[labels["reason"]] += value
    tiers: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for field in ("blocks", "bytes"):
        for labels, value in samples.get(f"paged_kv_tier_{field}", ()):
            tiers[labels["tier"]][field] = value
    return {
        "scope": "all" if tenant is None else "tenant", "tenant": tenant,
        "pool": {state: _sum(samples, "paged_kv_blocks", state=state)
                 for state in POOL_STATES},
        "tenants": tenants, "tiers": dict(tiers), "prefix": prefix, "misses": dict(misses),
        "requests": {"running": _sum(samples, "paged_kv_running_requests"),
                     "waiting": _sum(samples, "paged_kv_waiting_requests")},
    }


def _parse(text: str) -> _Samples:
    """Every sample of `text` by its sample name (``..._total`` for counters)."""
    samples: _Samples = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _sum(samples: _Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(value for have, value in samples.get(name, ())
               if all(have.get(k) == v for k, v in labels.items()))


def _tenants(samples: _Samples, only: str | None) -> dict[str, dict[str, float]]:
    """``{tenant: {live, cached, retained, query_tokens, hit_tokens}}`` (what the metrics
    have of each), only `only`'s row when given."""
    rows: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for labels, value in samples.get("paged_kv_tenant_blocks", ()):
        rows[labels["tenant"]][labels["state"]] = value
    for field in ("query_tokens", "hit_tokens"):
        for labels, value in samples.get(f"paged_kv_tenant_prefix_{field}_total", ()):
            rows[labels["tenant"]][field] = value
    return {name: row for name, row in sorted(rows.items()) if only is None or name == only}
