"""The ``latent`` workload: ``paged-kv bench --quick --workloads latent`` writes its rows
(bytes per token and sequences per pool against per-head K/V, each ratio the arithmetic's;
decode speeds after the engine's tokens were checked equal to transformers' ``generate``),
every target judged."""

from __future__ import annotations

import json

import pytest

from paged_kv.bench.cli import OPTIONAL_WORKLOADS, WORKLOADS
from paged_kv.bench.workloads import latent_parts as parts
from paged_kv.cli import main


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "latent"
    assert main(["bench", "--quick", "--out", str(out), "--workloads", "latent"]) == 0
    [found] = json.loads((out / "results.json").read_text(encoding="utf-8"))["workloads"]
    assert "## Latent pages" in (out / "report.md").read_text(encoding="utf-8")
    return found


def _figure(workload: dict, start: str) -> dict:
    [found] = [f for f in workload["figures"] if f["name"].startswith(start)]
    return found


def test_latent_runs_only_when_named():
    assert "latent" in OPTIONAL_WORKLOADS and "latent" not in WORKLOADS


@pytest.mark.parametrize(("label", "ratio"), [
    ("tiny DeepSeek V3, 16 heads", 640 / 24), ("tiny DeepSeek V3, 4 heads", 160 / 24),
    ("DeepSeek V3 (61 layers", 40_960 / 576)])
def test_bytes_per_token_are_the_arithmetic(workload, label, ratio):
    figure = _figure(workload, f"bytes per token, {label}")
    assert figure["ratio"] == pytest.approx(ratio)
    seqs = [f for f in workload["figures"] if "sequences per" in f["name"]
            and label in f["name"]]
    assert len(seqs) == 1 and seqs[0]["baseline_median"] >= 1
    # whole blocks and a reserved block or two move the count a little off the bytes' ratio
    assert 0.9 * ratio <= seqs[0]["ratio"] <= 1.2 * ratio


def test_every_target_is_judged(workload):
    targets = [key for key in workload["info"] if key.startswith("target ")]
    assert len(targets) == (3 if parts_ran(workload) else 1)
    assert all(workload["info"][key].startswith(("met: ", "MISSED: ")) for key in targets)
    assert workload["info"][targets[0]].startswith("met: 26.7x")


def parts_ran(workload: dict) -> bool:
    return any(f["name"].startswith("decode tokens/s") for f in workload["figures"])


def test_speeds_follow_equal_tokens(workload):
    pytest.importorskip("transformers")
    assert workload["info"]["bytes per token of HFCausalLM's pool, tiny DeepSeek V3 "
                            "(16 heads)"] == parts.LAYERS * (parts.RANK + parts.ROPE) * 4
    speeds = [f for f in workload["figures"] if "tokens/s" in f["unit"]]
    assert len(speeds) == 3
    assert all(f["median"] > 0 and f["baseline_median"] > 0 for f in speeds)
    assert all(f["name"].endswith("tokens equal") for f in speeds
               if "generate" in f["baseline"])
    assert any(key.startswith("tiny DeepSeek V3: tokens checked equal")
               for key in workload["info"])
