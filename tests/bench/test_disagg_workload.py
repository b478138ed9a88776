"""``paged-kv bench --quick --workloads disagg``: a prefill and a decode engine behind the
router against two colocated replicas, on a mixed trace. Timings are not asserted (2 shared
cores); what is counted is: every request's pages were handed off and loaded, none fell
back, and every figure is a positive number with its same-run baseline."""

from __future__ import annotations

import json
import math

import pytest

from paged_kv.bench.cli import OPTIONAL_WORKLOADS, WORKLOADS
from paged_kv.bench.scale import QUICK
from paged_kv.bench.workloads import disagg
from paged_kv.cli import main


def test_disagg_runs_only_when_named():
    assert "disagg" in OPTIONAL_WORKLOADS and "disagg" not in WORKLOADS


def test_the_trace_mixes_long_prompts_into_decoding_requests():
    shape = disagg._shape(QUICK)
    requests = disagg.trace(shape, seed=0)
    longs = [r for r in requests if r["kind"] == "long"]
    decodes = [r for r in requests if r["kind"] == "decode"]
    assert len(longs) == shape["longs"] and len(decodes) == shape["decoders"]
    assert all(shape["long_lo"] <= len(r["prompt"]) <= shape["long_hi"] for r in longs)
    assert [r["at"] for r in requests] == sorted(r["at"] for r in requests)
    # the long prompts arrive while the decoding requests are still decoding
    assert longs[0]["at"] > decodes[0]["at"] and longs[0]["at"] < decodes[-1]["at"] + 1.0
    assert disagg.trace(shape, seed=0) == requests  # seeded


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "disagg"
    assert main(["bench", "--quick", "--out", str(out), "--workloads", "disagg"]) == 0
    [found] = json.loads((out / "results.json").read_text(encoding="utf-8"))["workloads"]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Disaggregated prefill and decode against colocated replicas" in report
    assert (out / "disagg.png").exists()
    return found


def test_every_request_was_handed_off_and_none_fell_back(workload):
    shape = disagg._shape(QUICK)
    warmup = 2 + 1  # two decoding requests and one long prompt before the measured trace
    after = shape["transfers"]  # long prompts one at a time after it
    assert workload["info"]["fallbacks (decode engine, all reasons)"] == 0
    assert workload["info"]["hand-offs loaded (decode engine)"] == (
        warmup + shape["decoders"] + shape["longs"] + after)


def test_every_figure_is_positive_against_its_baseline(workload):
    names = {f["name"] for f in workload["figures"]}
    assert {"disaggregated: decode inter-token latency, p99",
            "disaggregated: time to first token, p50",
            "disaggregated: throughput (prompt + generated tokens)",
            "hand-off wire at 64 KiB pages, reused socket",
            "hand-off bandwidth in the engines, during the trace (decode metrics)"} <= names
    for figure in workload["figures"]:
        for key in ("median", "baseline_median", "ratio"):
            assert math.isfinite(figure[key]) and figure[key] > 0, (figure["name"], key)
