"""``GET /dashboard`` in a real headless browser: Debian's chromium driven by Playwright
(its own browser download is not reachable). The page must show the numbers ``/metrics``
shows, follow a request, show a tenant only its share, and load nothing from outside the
server. Skipped without chromium or Playwright; failed under CI, where .ci/run installs them.

The screenshot is kept at ``tests/artifacts/dashboard.png`` (git-ignored) and, with
``PAGED_KV_SCREENSHOT`` set, copied to ``docs/img/dashboard.png`` for the README.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from paged_kv.server.http.dashboard import dashboard_state, plotly_bundle  # noqa: E402

from ..conftest import ROOT, prometheus_value  # noqa: E402
from .test_server import make_prompt, running_server  # noqa: E402

ARTIFACT = ROOT / "tests" / "artifacts" / "dashboard.png"
WAIT_S = 20.0  # bound on the page catching up with /metrics (it polls every second)


def _missing(what: str) -> None:
    """Fail in CI (where .ci/run installs everything), skip elsewhere."""
    message = f"the dashboard's browser test needs {what}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser():
    """A headless system chromium under Playwright, closed after the module."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        _missing("Debian's chromium (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright (pip install playwright; never `playwright install`)")
    if plotly_bundle() is None:
        _missing("the plotly package (its bundled plotly.min.js draws the charts)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """No API keys: one tenant, and the whole page for everyone."""
    path = tmp_path_factory.mktemp("dash-open")
    with running_server("--memory-mib", "8", log=path / "log") as (_, url):
        yield url


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """Two tenants' keys: each key sees its own tenant's share."""
    path = tmp_path_factory.mktemp("dash-keys")
    (path / "keys").write_text("key-a alice\nkey-b bob\n")
    with running_server("--api-keys", str(path / "keys"), "--memory-mib", "8",
                        log=path / "log") as (_, url):
        yield url


def _page(browser, url: str):
    """A new page on `url`'s dashboard that records every URL it requests."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.requested = []
    page.on("request", lambda request: page.requested.append(request.url))
    page.goto(url)
    return page


def _complete(url: str, prompt: list[int], key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                          json={"model": "paged-kv-tiny-llama", "prompt": prompt,
                                "max_tokens": 2})
    assert response.status_code == 200, response.text
    return response.json()


def _shown(page) -> dict[str, float]:
    """The page's cards: pool blocks by state, requests, prefix tokens."""
    ids = ("pool-live", "pool-cached", "pool-free", "req-running", "req-waiting",
           "prefix-query", "prefix-hit")
    return {i: float(page.locator(f"#{i}").inner_text()) for i in ids
            if page.locator(f"#{i}").inner_text() not in ("", "–")}


def _until_equal(page, expected) -> dict[str, float]:
    """Wait (bounded) until the page's cards equal `expected()` (read again each time: an
    idle server's metrics settle, the page catches up within a poll); the last pair."""
    deadline = time.monotonic() + WAIT_S
    while True:
        want, shown = expected(), _shown(page)
        if shown == want or time.monotonic() > deadline:
            assert shown == want, "the page's numbers are not /metrics'"
            return shown
        page.wait_for_timeout(250)


def _from_metrics(url: str, tenant: str | None = None, key: str | None = None,
                  ) -> dict[str, float]:
    """The cards' numbers from /metrics (a tenant's with its `key`: without one, /metrics
    has no tenant's series)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    value = lambda name, labels="": prometheus_value(text, name, labels)  # noqa: E731
    if tenant is None:
        prefix = (value("paged_kv_prefix_query_tokens_total"),
                  value("paged_kv_prefix_hit_tokens_total"))
    else:
        prefix = (value("paged_kv_tenant_prefix_query_tokens_total", f'{{tenant="{tenant}"}}'),
                  value("paged_kv_tenant_prefix_hit_tokens_total", f'{{tenant="{tenant}"}}'))
    return {"pool-live": value("paged_kv_blocks", '{state="live"}'),
            "pool-cached": value("paged_kv_blocks", '{state="cached"}'),
            "pool-free": value("paged_kv_blocks", '{state="free"}'),
            "req-running": value("paged_kv_running_requests"),
            "req-waiting": value("paged_kv_waiting_requests"),
            "prefix-query": prefix[0], "prefix-hit": prefix[1]}


def _screenshot(page) -> None:
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACT), full_page=True)
    if os.environ.get("PAGED_KV_SCREENSHOT"):
        docs = ROOT / "docs" / "img" / "dashboard.png"
        docs.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ARTIFACT, docs)


def test_the_page_shows_what_metrics_shows_and_follows_a_request(browser, open_server):
    """Fault: a number on the page that is not /metrics', a page that stops updating, or a
    page that needs the internet (plotly from a CDN)."""
    url = open_server
    prompt = make_prompt(80, 1)
    _complete(url, prompt)
    page = _page(browser, f"{url}/dashboard")
    before = _until_equal(page, lambda: _from_metrics(url))
    assert before["pool-cached"] > 0, "the first request left its prompt's blocks cached"
    _complete(url, prompt)  # the same prompt again: a prefix hit
    after = _until_equal(page, lambda: _from_metrics(url))
    assert after["prefix-query"] > before["prefix-query"]
    assert after["prefix-hit"] >= before["prefix-hit"] + 64, "its 4 full blocks hit"
    assert page.locator(".js-plotly-plot").count() == 6, "every chart drawn"
    assert page.locator("#misses tr[data-reason=cold]").count() == 1
    assert all(u.startswith(url) for u in page.requested), page.requested
    polled = httpx.get(f"{url}/metrics", timeout=30).text
    assert prometheus_value(polled, "paged_kv_http_requests_total",
                            '{endpoint="/dashboard/state",status="200"}') > 1, \
        "the page's polls are counted under their own path, not as 'other'"
    assert page.locator("#auth").is_hidden(), "no API keys: no key asked"
    lines = page.locator("#chart-hit .scatterlayer")  # the hit rates move with the traffic
    drawn = lines.inner_html()
    for seed in range(3):  # a few seconds of traffic, so the kept picture has a history
        _complete(url, make_prompt(40, 10 + seed))
        _complete(url, prompt)
        page.wait_for_timeout(1000)
    assert lines.inner_html() != drawn, "the time series is redrawn as it grows"
    _screenshot(page)
    page.close()


def test_a_tenant_key_sees_only_its_share(browser, keyed_server):
    """Fault: a tenant shown another tenant's rows or counters, or the page shown without
    a key."""
    url = keyed_server
    _complete(url, make_prompt(60, 2), key="key-a")
    _complete(url, make_prompt(60, 3), key="key-b")
    _complete(url, make_prompt(60, 3), key="key-b")
    assert httpx.get(f"{url}/dashboard/state", timeout=30).status_code == 401
    page = _page(browser, f"{url}/dashboard")
    page.locator("#auth").wait_for(state="visible", timeout=WAIT_S * 1000)
    assert page.locator("#pool-free").inner_text() == "–", "no numbers without a key"
    page.goto(f"{url}/dashboard?key=key-a")
    shown = _until_equal(page, lambda: _from_metrics(url, "alice", "key-a"))
    assert shown["prefix-query"] == 60 and shown["prefix-hit"] == 0
    assert page.locator("#tenants tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.tenant)") == ["alice"]
    # a wrong key brings the form back; bob's key typed into it shows bob's share
    page.evaluate("sessionStorage.setItem('paged_kv_dashboard_key', 'wrong')")
    page.locator("#auth").wait_for(state="visible", timeout=WAIT_S * 1000)
    page.fill("#key", "key-b")
    page.click("#auth button")
    shown = _until_equal(page, lambda: _from_metrics(url, "bob", "key-b"))
    assert shown["prefix-hit"] >= 48, "bob's second request hit its first"
    assert page.locator("#tenants tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.tenant)") == ["bob"]
    page.close()


def test_the_state_is_parsed_from_the_metrics_text_and_filtered_by_tenant():
    """Fault: a tenant's row leaking into another's state, or misses summed across tenants
    for a tenant."""
    text = "\n".join([
        'paged_kv_blocks{state="live"} 3', 'paged_kv_blocks{state="cached"} 5',
        'paged_kv_blocks{state="free"} 7',
        "# TYPE paged_kv_prefix_misses counter",
        'paged_kv_prefix_misses_total{reason="cold",tenant="a"} 2',
        'paged_kv_prefix_misses_total{reason="cold",tenant="b"} 4',
        'paged_kv_tenant_blocks{state="live",tenant="a"} 1',
        'paged_kv_tenant_blocks{state="live",tenant="b"} 2',
        'paged_kv_tier_blocks{tier="host"} 9', ""])
    whole, own = dashboard_state(text), dashboard_state(text, "a")
    assert whole["pool"] == own["pool"] == {"live": 3, "cached": 5, "free": 7}
    assert whole["misses"] == {"cold": 6} and own["misses"] == {"cold": 2}
    assert set(whole["tenants"]) == {"a", "b"} and own["tenants"] == {"a": {"live": 1}}
    assert own["tiers"] == {"host": {"blocks": 9}}


def test_the_page_is_in_the_package():
    """Fault: the page left out of the installed package (package-data)."""
    assert (Path(__file__).parents[2] / "paged_kv/server/http/static/dashboard.html").is_file()
    assert "[tool.setuptools.package-data]" in (ROOT / "pyproject.toml").read_text()


def test_an_admin_key_sees_every_tenant_and_a_bad_key_nothing(monkeypatch):
    """Fault: an admin key filtered to a tenant, a tenant key shown another's row, a
    missing plotly answered with a 500 rather than a 404 naming the package."""
    from starlette.testclient import TestClient

    from paged_kv.engine import Engine, TinyLlama, TinyLlamaConfig
    from paged_kv.engine.config import EngineConfig
    from paged_kv.server import ByteTokenizer, InprocClient
    from paged_kv.server.http import dashboard
    from paged_kv.server.http.app import create_app

    model = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=64,
                                      vocab_size=300, num_heads=4, num_kv_heads=2,
                                      head_dim=16, max_position=512))
    engine = Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=8)))
    app = create_app(InprocClient(engine), ByteTokenizer(), model_name="tiny",
                     api_keys={"key-a": "alice", "key-b": "bob"})
    app.state.service.admin_keys = {"root"}  # as the tenants file's admin_keys will set it
    with TestClient(app) as client:
        for key in ("key-a", "key-b"):
            assert client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"prompt": list(range(20)), "max_tokens": 1}).is_success
        state = lambda key: client.get(  # noqa: E731
            "/dashboard/state", headers={"Authorization": f"Bearer {key}"})
        assert state("nope").status_code == 401
        whole = state("root").json()
        assert whole["scope"] == "all" and set(whole["tenants"]) == {"alice", "bob"}
        own = state("key-b").json()
        assert own["scope"] == "tenant" and set(own["tenants"]) == {"bob"}
        assert own["misses"] == {"cold": 1} and whole["misses"] == {"cold": 2}
        monkeypatch.setattr(dashboard, "plotly_bundle", lambda: None)
        missing = client.get("/dashboard/plotly.min.js")
        assert missing.status_code == 404 and "plotly" in missing.json()["error"]["message"]
        assert "chart-pool" in client.get("/dashboard").text
