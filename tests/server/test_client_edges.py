"""What real clients meet at ``paged-kv serve``'s edges (issue 38): Prometheus scraping
``/metrics`` on a server with tenants, benchmark clients (guidellm, vLLM's ``bench serve``)
asking for ``stream_options.continuous_usage_stats`` and naming a model, the openai package
reading a 404 or a 429.

One real server process (`running_server`, stopped by its fixture) with a TOML tenants file
(an admin key, two tenants) and two served model names; the rest in process (`make_client`).
"""

from __future__ import annotations

import pytest

from .test_server import httpx, make_prompt, openai, running_server, sse_events

TENANTS = """
admin_keys = ["sk-admin"]
[tenants.acme]
keys = ["sk-acme"]
[tenants.beta]
keys = ["sk-beta"]
"""
NAMES = ("served-a", "served-b")  # --served-model-name: the first is the one reported


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """Two tenants, each with one request done (so each has tenant-labelled series)."""
    path = tmp_path_factory.mktemp("edges")
    (path / "tenants.toml").write_text(TENANTS)
    with running_server("--api-keys", str(path / "tenants.toml"), "--memory-mib", "8",
                        "--served-model-name", *NAMES, log=path / "log") as (_, url):
        for seed, key in enumerate(("sk-acme", "sk-beta")):
            done = _post(url, key, {"prompt": make_prompt(40, 60 + seed), "max_tokens": 2})
            assert done.status_code == 200, done.text
        yield url


def _post(url: str, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def _scrape(url: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/metrics", headers=headers, timeout=30)


def _tenants_in(text: str) -> set[str]:
    """Every ``tenant`` label value of the exposition's samples."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.labels["tenant"] for family in text_string_to_metric_families(text)
            for sample in family.samples if "tenant" in sample.labels}


# -- /metrics: tenants' numbers need a key ---------------------------------------------------
def test_metrics_without_a_key_has_the_pool_but_no_tenant(keyed_server):
    """Fault: anyone could read every tenant's blocks, prefix tokens and misses."""
    answer = _scrape(keyed_server)
    assert answer.status_code == 200, answer.text
    assert _tenants_in(answer.text) == set(), "a tenant's series shown without a key"
    for sample in ('paged_kv_blocks{state="free"}', "paged_kv_running_requests ",
                   "paged_kv_prefix_query_tokens_total "):
        assert sample in answer.text, f"{sample}: a pool-level series is gone"
    assert _tenants_in(_scrape(keyed_server, "sk-admin").text) >= {"acme", "beta"}


def test_metrics_with_a_tenant_key_show_its_own_series_only(keyed_server):
    text = _scrape(keyed_server, "sk-acme").text
    assert _tenants_in(text) == {"acme"}
    assert 'paged_kv_tenant_prefix_query_tokens_total{tenant="acme"} 40.0' in text
    assert 'paged_kv_blocks{state="free"}' in text


def test_metrics_with_an_unknown_key_is_a_401(keyed_server):
    answer = _scrape(keyed_server, "sk-nobody")
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["type"] == "authentication_error"


# -- the served model names ------------------------------------------------------------------
def test_models_lists_every_served_name(keyed_server):
    answer = httpx.get(f"{keyed_server}/v1/models", timeout=30,
                       headers={"Authorization": "Bearer sk-acme"})
    assert [model["id"] for model in answer.json()["data"]] == list(NAMES)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("named", [{"model": "served-b"}, {"model": "served-a"}, {}],
                         ids=["alias", "first", "missing"])
def test_a_served_name_or_none_is_answered_under_the_first(keyed_server, path, named):
    """Any listed name is accepted; a request without ``model`` gets the default (vLLM)."""
    body = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    answer = _post(keyed_server, "sk-acme", {**body, **named, "max_tokens": 2}, path)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == NAMES[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_not_served_is_a_404_naming_it(keyed_server, stream):
    """vLLM's answer (and the openai package's NotFoundError); it was served as if named."""
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="sk-acme", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2, stream=stream)
    error = caught.value.body
    assert error["message"] == "The model `gpt-4` does not exist."
    assert error["type"] == "not_found_error" and error["param"] == "model"


# -- stream_options.continuous_usage_stats ---------------------------------------------------
def test_continuous_usage_in_every_chat_chunk(keyed_server):
    """vLLM's: with ``include_usage`` and ``continuous_usage_stats`` every chunk carries the
    usage so far (the role chunk: no completion token yet), then the whole usage once.
    Fault: the option was ignored, usage came only in the last chunk."""
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="sk-acme", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    *running, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    prompt = last.usage.prompt_tokens
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
            for c in running] == [(prompt, k, prompt + k) for k in range(6)]


@pytest.mark.parametrize("options", [{"include_usage": True},
                                     {"include_usage": False, "continuous_usage_stats": True}])
def test_usage_only_at_the_end_without_continuous_usage(keyed_server, options):
    """vLLM: ``continuous_usage_stats`` counts only with ``include_usage``."""
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": options}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{keyed_server}/v1/completions", json=body,
            headers={"Authorization": "Bearer sk-acme"}) as answer:
        events = [e for e in sse_events(answer.iter_lines()) if e != "DONE"]
    assert [e.get("usage") is not None for e in events] == \
        [False] * (len(events) - 1) + [options["include_usage"]]


def test_continuous_usage_in_every_completion_chunk():
    from .test_openai_semantics import PROMPT, make_client, sse

    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with make_client() as client:
        events = sse(client.post("/v1/completions", json=body))
    *running, last, done = events
    assert done == "DONE" and last["choices"] == []
    assert [e["usage"] for e in running] == [
        {"prompt_tokens": 7, "completion_tokens": k, "total_tokens": 7 + k}
        for k in range(1, 5)]


def test_scoping_reads_labels_not_text():
    """A tenant named with quotes, commas or backslashes is still its own (prometheus-client
    escapes them), and tenant-like text inside another label's value is no tenant label."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from paged_kv.server.http.metrics_scope import scoped_exposition

    registry = CollectorRegistry()
    gauge = Gauge("g", "by tenant", ["reason", "tenant"], registry=registry)
    odd = 'a",tenant="b\\\n'
    gauge.labels(reason='x,tenant="b"', tenant=odd).set(1)
    gauge.labels(reason="y", tenant="b").set(2)
    plain = Gauge("pool", "no tenant", ["reason"], registry=registry)
    plain.labels(reason='tenant="b"').set(3)
    text = generate_latest(registry).decode()
    assert _tenants_in(scoped_exposition(text, odd)) == {odd}
    assert _tenants_in(scoped_exposition(text, "b")) == {"b"}
    assert _tenants_in(scoped_exposition(text, None)) == set()
    assert "pool{" in scoped_exposition(text, None), "a sample without a tenant label stays"
