"""``paged-kv bench --quick --workloads tenants``: a noisy neighbour on a real `serve`. The
hit rates it reports are counts from the responses' usage, not timings, so they are
asserted: without a policy the quiet tenant's prefix is evicted, with a quota on the noisy
tenant or a reservation for the quiet one it keeps at least 0.9 of its solo hit rate."""

from __future__ import annotations

import json

import pytest
import tomllib

from paged_kv.bench.cli import OPTIONAL_WORKLOADS, WORKLOADS
from paged_kv.bench.scale import QUICK
from paged_kv.bench.workloads import tenants
from paged_kv.cli import main


def test_tenants_runs_only_when_named():
    assert "tenants" in OPTIONAL_WORKLOADS and "tenants" not in WORKLOADS


@pytest.mark.parametrize("policy", ["none", "quota", "reservation"])
def test_each_run_has_the_tenants_file_it_names(policy):
    shape = tenants._shape(QUICK)
    parsed = tomllib.loads(tenants.tenants_file(policy, shape))["tenants"]
    assert parsed["noisy"]["keys"] == ["sk-noisy"] and parsed["quiet"]["keys"] == ["sk-quiet"]
    assert parsed["noisy"].get("quota") == (shape["quota"] if policy == "quota" else None)
    assert parsed["quiet"].get("reservation") == (shape["reservation"]
                                                  if policy == "reservation" else None)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tenants"
    assert main(["bench", "--quick", "--out", str(out), "--workloads", "tenants"]) == 0
    [found] = json.loads((out / "results.json").read_text(encoding="utf-8"))["workloads"]
    assert (out / "tenants.png").exists()
    return found


def test_a_policy_keeps_the_quiet_tenants_hit_rate_and_none_does_not(workload):
    rate = {f["name"].split(":")[0]: f for f in workload["figures"]
            if f["name"].endswith("quiet tenant's hit rate")}
    solo = rate["none"]["baseline_median"]
    assert solo > 0.9  # the system prompt is nearly all of each prompt
    assert rate["none"]["median"] < 0.5 * solo
    assert rate["quota"]["median"] >= 0.9 * solo
    assert rate["reservation"]["median"] >= 0.9 * solo
