"""Tenants on ``paged-kv serve``: a TOML tenants file, the ``priority`` / ``retention_seconds``
request fields, where cached tokens came from and why a block missed (usage), an admin's
flush and unretain, and the warm-up call, through the engine-core process.

The server is a real subprocess on a free 127.0.0.1 port (`running_server`), stopped by its
fixture; the no-keys case runs in process (`make_client`).
"""

from __future__ import annotations

import pytest

from .test_server import httpx, make_prompt, running_server, sse_events

TENANTS = """
admin_keys = ["sk-admin"]
[tenants.acme]
keys = ["sk-acme"]
quota = 100
reservation = 20
[tenants.beta]
keys = ["sk-beta"]
quota = 3
[tenants.gamma]
keys = ["sk-gamma"]
quota = 60
retention_budget = 30
[default]
quota = 50
"""
BLOCK = 16  # serve's default --block-size


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants")
    (path / "tenants.toml").write_text(TENANTS)
    with running_server("--api-keys", str(path / "tenants.toml"), "--memory-mib", "8",
                        log=path / "log") as (_, url):
        yield url


def _post(url: str, path: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def _details(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]


# -- request fields ---------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("priority", 100), ("priority", -1), ("priority", "high"), ("priority", True),
    ("priority", 1.5), ("retention_seconds", -0.5), ("retention_seconds", "long"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_priority_or_retention_is_a_400_naming_the_field(tenant_server, path, field,
                                                              value):
    body = ({"prompt": "hello"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hello"}]})
    response = _post(tenant_server, path, "sk-acme", {**body, "max_tokens": 1, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_good_priority_and_retention_are_served(tenant_server):
    response = _post(tenant_server, "/v1/completions", "sk-acme",
                     {"prompt": make_prompt(40, seed=50), "max_tokens": 2, "priority": 99,
                      "retention_seconds": 0})
    assert response.status_code == 200, response.text


# -- usage: where cached tokens came from, why a block missed ---------------------------------
def test_usage_says_cold_then_hit_with_the_source(tenant_server):
    prompt = make_prompt(4 * BLOCK + 6, seed=51)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = _details(_post(tenant_server, "/v1/completions", "sk-acme", body))
    assert first["cached_tokens"] == 0
    assert first["miss"]["reason"] == "cold" and first["miss"]["block"] == 0
    assert sum(first["cached_tokens_by_source"].values()) == 0
    second = _details(_post(tenant_server, "/v1/completions", "sk-acme", body))
    assert second["cached_tokens"] == 4 * BLOCK
    assert second["cached_tokens_by_source"] == {"device": 4 * BLOCK}
    assert second["miss"] is None


def test_streamed_usage_has_the_same_fields(tenant_server):
    prompt = make_prompt(3 * BLOCK + 1, seed=52)
    body = {"prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    _post(tenant_server, "/v1/completions", "sk-acme", {**body, "stream": False,
                                                        "stream_options": None})
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{tenant_server}/v1/completions", json=body,
            headers={"Authorization": "Bearer sk-acme"}) as response:
        events = sse_events(response.iter_lines())
    usage = [e for e in events if e != "DONE" and e.get("usage")][-1]["usage"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == 3 * BLOCK
    assert details["cached_tokens_by_source"] == {"device": 3 * BLOCK}
    assert details["miss"] is None


# -- admin: flush and unretain ----------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/cache/flush", "/v1/cache/unretain"])
def test_admin_endpoints_refuse_a_tenant_key(tenant_server, path):
    response = _post(tenant_server, path, "sk-gamma", {"tenant": "gamma"})
    assert response.status_code == 403, response.text
    assert response.json()["error"]["type"] == "permission_error"
    assert _post(tenant_server, path, "nope", {"tenant": "gamma"}).status_code == 401


@pytest.mark.parametrize("body", [{"tenant": "nobody"}, {}, {"tenant": 3}])
def test_admin_flush_names_a_bad_tenant(tenant_server, body):
    response = _post(tenant_server, "/v1/cache/flush", "sk-admin", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tenant"


def test_admin_flush_evicts_the_tenants_cached_blocks(tenant_server):
    body = {"prompt": make_prompt(4 * BLOCK + 3, seed=53), "max_tokens": 1}
    _details(_post(tenant_server, "/v1/completions", "sk-gamma", body))
    assert _details(_post(tenant_server, "/v1/completions", "sk-gamma", body))[
        "cached_tokens"] == 4 * BLOCK
    acme = {"prompt": make_prompt(2 * BLOCK + 3, seed=54), "max_tokens": 1}
    _details(_post(tenant_server, "/v1/completions", "sk-acme", acme))
    flushed = _post(tenant_server, "/v1/cache/flush", "sk-admin", {"tenant": "gamma"})
    assert flushed.status_code == 200, flushed.text
    assert flushed.json()["tenant"] == "gamma" and flushed.json()["blocks"] >= 4
    after = _details(_post(tenant_server, "/v1/completions", "sk-gamma", body))
    assert after["cached_tokens"] == 0 and after["miss"] is not None
    assert _details(_post(tenant_server, "/v1/completions", "sk-acme", acme))[
        "cached_tokens"] == 2 * BLOCK, "another tenant's cache is untouched"


def test_admin_unretain_ends_a_requests_retention(tenant_server):
    body = {"prompt": make_prompt(4 * BLOCK + 3, seed=55), "max_tokens": 1, "priority": 90,
            "retention_seconds": 600}
    _details(_post(tenant_server, "/v1/completions", "sk-gamma", body))
    unretained = _post(tenant_server, "/v1/cache/unretain", "sk-admin", {"tenant": "gamma"})
    assert unretained.status_code == 200, unretained.text
    assert unretained.json() == {"tenant": "gamma", "blocks": unretained.json()["blocks"]}
    assert unretained.json()["blocks"] >= 4
    again = _post(tenant_server, "/v1/cache/flush", "sk-admin",
                  {"tenant": "gamma", "retention_only": True})
    assert again.json()["blocks"] == 0, "nothing is retained any more"


# -- warm-up ----------------------------------------------------------------------------------
def test_warm_then_a_request_hits(tenant_server):
    prompt = make_prompt(5 * BLOCK + 7, seed=56)
    warmed = _post(tenant_server, "/v1/cache/warm", "sk-acme", {"prompt": prompt})
    assert warmed.status_code == 200, warmed.text
    assert warmed.json() == {"prompt_tokens": len(prompt), "cached_tokens": 5 * BLOCK}
    details = _details(_post(tenant_server, "/v1/completions", "sk-acme",
                             {"prompt": [*prompt, 7, 8, 9], "max_tokens": 2}))
    assert details["cached_tokens"] >= warmed.json()["cached_tokens"]
    # another tenant's warm-up is not this tenant's
    other = _details(_post(tenant_server, "/v1/completions", "sk-gamma",
                           {"prompt": [*prompt, 7, 8, 9], "max_tokens": 1}))
    assert other["cached_tokens"] == 0


def test_warm_counts_against_the_tenants_quota(tenant_server):
    warmed = _post(tenant_server, "/v1/cache/warm", "sk-beta",
                   {"prompt": make_prompt(10 * BLOCK, seed=57)})
    assert warmed.status_code == 200, warmed.text
    assert warmed.json()["prompt_tokens"] == 10 * BLOCK
    assert warmed.json()["cached_tokens"] <= (3 + 1) * BLOCK, "quota 3 blocks (+1 slack)"


def test_chat_warm_then_the_next_turn_hits(tenant_server):
    history = [{"role": "system", "content": "You answer in one word. " * 6},
               {"role": "user", "content": "What is the colour of the sky on a clear day?"}]
    warmed = _post(tenant_server, "/v1/cache/warm", "sk-acme", {"messages": history})
    assert warmed.status_code == 200, warmed.text
    assert warmed.json()["cached_tokens"] >= BLOCK
    turn = [*history, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And at night?"}]
    details = _details(_post(tenant_server, "/v1/chat/completions", "sk-acme",
                             {"messages": turn, "max_tokens": 1}))
    assert details["cached_tokens"] >= warmed.json()["cached_tokens"]


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ({"prompt": ""}, "prompt"), ({"prompt": "x", "priority": 100}, "priority"),
    ({"prompt": "x", "colour": "red"}, "colour"),
])
def test_bad_warm_is_a_400_naming_the_field(tenant_server, body, param):
    response = _post(tenant_server, "/v1/cache/warm", "sk-acme", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_warm_for_another_tenant_needs_an_admin_key(tenant_server):
    prompt = make_prompt(3 * BLOCK, seed=58)
    refused = _post(tenant_server, "/v1/cache/warm", "sk-acme", {"prompt": prompt,
                                                                 "tenant": "gamma"})
    assert refused.status_code == 403, refused.text
    warmed = _post(tenant_server, "/v1/cache/warm", "sk-admin", {"prompt": prompt,
                                                                 "tenant": "gamma"})
    assert warmed.status_code == 200 and warmed.json()["cached_tokens"] == 3 * BLOCK
    assert _details(_post(tenant_server, "/v1/completions", "sk-gamma",
                          {"prompt": [*prompt, 1], "max_tokens": 1}))["cached_tokens"] \
        == 3 * BLOCK


# -- without --api-keys: one tenant, admin endpoints open (in process) -------------------------
def test_without_api_keys_admin_endpoints_are_open():
    from .test_openai_semantics import make_client

    with make_client() as client:  # block size 8
        prompt = [t % 256 for t in make_prompt(4 * 8 + 3, seed=59)]  # the model's vocabulary
        warmed = client.post("/v1/cache/warm", json={"prompt": prompt})
        assert warmed.json() == {"prompt_tokens": len(prompt), "cached_tokens": 32}
        hit = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert hit.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        flushed = client.post("/v1/cache/flush", json={})
        assert flushed.json() == {"tenant": None, "blocks": flushed.json()["blocks"]}
        assert flushed.json()["blocks"] >= 4
        assert client.post("/v1/cache/unretain", json={}).json()["blocks"] == 0
        named = client.post("/v1/cache/flush", json={"tenant": "acme"})
        assert named.status_code == 400 and named.json()["error"]["param"] == "tenant"
        cold = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_cache_routes_are_counted_under_their_own_paths():
    from ..conftest import prometheus_value
    from .test_openai_semantics import make_client

    with make_client(api_keys={"sk-t": "t"}, admin_keys=["sk-admin"]) as client:
        admin = {"Authorization": "Bearer sk-admin"}
        assert client.post("/v1/cache/flush", json={"tenant": "t"}, headers=admin
                           ).status_code == 200
        assert client.post("/v1/cache/unretain", json={"tenant": "t"},
                           headers={"Authorization": "Bearer sk-t"}).status_code == 403
        assert client.post("/v1/cache/warm", json={"prompt": "hi"},
                           headers={"Authorization": "Bearer sk-t"}).status_code == 200
        assert client.get("/v1/models", headers=admin).status_code == 200
        text = client.get("/metrics").text
    for path, status in (("/v1/cache/flush", 200), ("/v1/cache/unretain", 403),
                         ("/v1/cache/warm", 200)):
        labels = f'{{endpoint="{path}",status="{status}"}}'
        assert prometheus_value(text, "paged_kv_http_requests_total", labels) == 1
