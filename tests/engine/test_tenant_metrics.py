"""The per-tenant metrics an engine's /metrics text carries: blocks by tenant and state
(`paged_kv_tenant_blocks`), misses by reason and tenant (`paged_kv_prefix_misses_total`) and
prefix tokens by tenant. Each test names the fault it catches."""

from __future__ import annotations

import pytest

from paged_kv.engine import Engine, SamplingParams
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.model import TinyLlamaConfig
from paged_kv.tenants import TenantLimits, TenantPolicy

from ..conftest import prometheus_value
from .conftest import prompt

pytest.importorskip("prometheus_client")

CONFIG = TinyLlamaConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         hidden_size=64, intermediate_size=128, vocab_size=256,
                         max_position=1024)
BLOCK = 16
PARAMS = SamplingParams(max_tokens=2)


def _engine(model, policy: TenantPolicy | None) -> Engine:
    return Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=64, block_size=BLOCK, tenants=policy)))


def _value(text: str, name: str, **labels: str) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return prometheus_value(text, name, "{" + inner + "}" if inner else "")


def _serve(engine: Engine, prompts: list[tuple[list[int], str | None]]) -> list:
    """Run each (prompt, salt) to completion, one after another; their outputs."""
    outputs = []
    for tokens, salt in prompts:
        engine.add_request(tokens, PARAMS, salt=salt)
        while engine.has_unfinished_requests:
            outputs += engine.step()
    return outputs


def test_cached_blocks_by_tenant_are_the_ledgers_and_add_up_to_the_pool(model):
    """Fault: a tenant's cached / retained gauge not its ledger count, or a tenant's count
    given to another."""
    engine = _engine(model, TenantPolicy({"A": TenantLimits(quota=6), "B": TenantLimits()}))
    _serve(engine, [(prompt(200, 1, 256), "A"), (prompt(70, 2, 256), "B"),
                    (prompt(40, 3, 256), None)])
    text = engine.metrics_text()
    usage = {u.tenant or "": u for u in engine.cache.allocator.tenants.usage()}
    assert usage["A"].cached == 6, "A flooded past its quota: it keeps exactly its quota"
    for tenant in ("A", "B", ""):
        assert _value(text, "paged_kv_tenant_blocks", tenant=tenant,
                      state="cached") == usage[tenant].cached
        assert _value(text, "paged_kv_tenant_blocks", tenant=tenant,
                      state="retained") == usage[tenant].retained
    assert sum(u.cached for u in usage.values()) == _value(text, "paged_kv_blocks",
                                                           state="cached")


def test_live_blocks_by_tenant_split_the_pools_live_blocks_and_drop_to_zero(model):
    """Fault: live blocks counted under the wrong tenant, a shared block counted twice, or
    a finished tenant's last count left standing."""
    engine = _engine(model, None)  # no policy: live by salt still
    engine.add_request(prompt(50, 4, 256), SamplingParams(max_tokens=4, n=2), salt="A")
    engine.add_request(prompt(20, 5, 256), PARAMS, salt="B")
    engine.step()
    text = engine.metrics_text()
    live = {t: _value(text, "paged_kv_tenant_blocks", tenant=t, state="live")
            for t in ("A", "B")}
    # A's 50 prompt tokens fill 4 blocks its two samples share until they write: once each
    assert live == {"A": 4.0, "B": 2.0}
    assert sum(live.values()) == _value(text, "paged_kv_blocks", state="live")
    while engine.has_unfinished_requests:
        engine.step()
    text = engine.metrics_text()
    assert _value(text, "paged_kv_tenant_blocks", tenant="A", state="live") == 0
    assert "state=\"cached\"" not in text.split("paged_kv_tenant_blocks", 1)[1].split(
        "# HELP", 1)[0], "no policy: no cached-by-tenant gauge"


def test_a_single_tenant_engine_has_no_tenant_gauges(model):
    """Fault: the per-tenant pass run (and a label made) without tenants."""
    engine = _engine(model, None)
    _serve(engine, [(prompt(40, 6, 256), None)])
    text = engine.metrics_text()
    assert "paged_kv_tenant_blocks{" not in text
    assert _value(text, "paged_kv_tenant_prefix_query_tokens_total", tenant="") > 0


def test_misses_and_prefix_tokens_count_each_request_once_by_tenant(model):
    """Fault: a miss counted under the wrong reason or tenant, or counted again at every
    scrape (counters must catch up by what is new)."""
    engine = _engine(model, TenantPolicy({"A": TenantLimits(), "B": TenantLimits()}))
    shared = prompt(70, 7, 256)
    diverged = shared[:40] + prompt(30, 8, 256)  # differs inside the third block
    outputs = _serve(engine, [(shared, "A"), (shared, "A"), (diverged, "A"), (shared, "B")])
    reasons = [o.miss and o.miss["reason"] for o in outputs]
    assert reasons == ["cold", None, "diverged", "cold"]
    for _ in range(2):  # a second scrape adds nothing
        text = engine.metrics_text()
        assert _value(text, "paged_kv_prefix_misses_total", reason="cold", tenant="A") == 1
        assert _value(text, "paged_kv_prefix_misses_total", reason="diverged",
                      tenant="A") == 1
        assert _value(text, "paged_kv_prefix_misses_total", reason="cold", tenant="B") == 1
        assert _value(text, "paged_kv_tenant_prefix_query_tokens_total",
                      tenant="A") == 3 * 70
        assert _value(text, "paged_kv_tenant_prefix_hit_tokens_total", tenant="A") == sum(
            o.prefix_hit_tokens for o in outputs[:3]) == 64 + 32
        assert _value(text, "paged_kv_tenant_prefix_hit_tokens_total", tenant="B") == 0
    _serve(engine, [(shared, "B")])
    text = engine.metrics_text()
    assert _value(text, "paged_kv_tenant_prefix_hit_tokens_total", tenant="B") == 64
    assert _value(text, "paged_kv_prefix_misses_total", reason="cold", tenant="B") == 1
