"""``paged-kv bench --quick --workloads hybrid``: its report, and the counts it rests on
(bytes per sequence, sequences per pool), which are deterministic. No timing is asserted:
the speed figures are only checked to be there and positive."""

from __future__ import annotations

import json
import math

import pytest
import torch

from paged_kv.bench.cli import OPTIONAL_WORKLOADS, WORKLOADS
from paged_kv.bench.scale import QUICK
from paged_kv.bench.workloads import hybrid, hybrid_models
from paged_kv.cli import main

GEMMA3, GPT_OSS = hybrid_models.GEMMA3, hybrid_models.GPT_OSS


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "hybrid"
    assert main(["bench", "--quick", "--out", str(out), "--workloads", "hybrid"]) == 0
    [workload] = json.loads((out / "results.json").read_text(encoding="utf-8"))["workloads"]
    return out, workload


def figure(workload: dict, shape: str, start: str) -> dict:
    [found] = [f for f in workload["figures"] if f["name"].startswith(f"{shape}: {start}")]
    return found


def test_hybrid_runs_only_when_named():
    assert "hybrid" in OPTIONAL_WORKLOADS and "hybrid" not in WORKLOADS


def test_report_has_the_section_its_plot_and_positive_figures(report):
    out, workload = report
    text = (out / "report.md").read_text(encoding="utf-8")
    assert f"## {workload['title']}" in text and "--workloads hybrid" in text
    assert (out / "hybrid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for shape in (GEMMA3, GPT_OSS):
        for start in ("KV MiB per sequence", "decode", "prefill"):
            found = figure(workload, shape.key, start)
            assert found["baseline"] == hybrid.ALL_FULL, found
            assert all(math.isfinite(found[k]) and found[k] > 0
                       for k in ("median", "baseline_median", "ratio")), found


def test_gemma3_shape_meets_the_memory_targets(report):
    """Gemma-3 shape: <= 0.25 of the all-full bytes per sequence, >= 4x the sequences per
    pool by arithmetic and resident in the engine (the all-full pool holds exactly its
    FULL_SEQS); the measured bytes within a block per window group of the formula."""
    _, workload = report
    assert figure(workload, "gemma3", "KV MiB per sequence")["ratio"] >= 4
    fits = figure(workload, "gemma3", "2,048-token sequences that fit")
    assert fits["ratio"] >= 4 and fits["baseline_median"] == hybrid.FIT_SEQS
    resident = figure(workload, "gemma3", "2,048-token sequences resident")
    assert resident["baseline_median"] == hybrid.FULL_SEQS
    assert resident["median"] >= 4 * hybrid.FULL_SEQS, resident
    info = workload["info"]
    measured = info["gemma3: KV bytes per sequence, hybrid / all-full (measured)"]
    formula = info["gemma3: the same by blocks_for_sequence(2048, 1)"]
    full_bytes = figure(workload, "gemma3", "KV MiB per sequence")["baseline_median"] * 2**20
    block = int(info["gemma3: bytes per block, hybrid / all-full"].split(" / ")[0].replace(",",
                                                                                           ""))
    assert abs(measured - formula) <= 5 * block / full_bytes  # 5 window groups


def test_gpt_oss_shape_holds_about_half_the_bytes(report):
    """Alternating window / full layers: about half the bytes, so about twice the sequences
    (the window's blocks on top of the full layers' keep it under 2x)."""
    _, workload = report
    assert 1.8 < figure(workload, "gpt-oss", "KV MiB per sequence")["ratio"] < 2
    assert 1.8 < figure(workload, "gpt-oss", "2,048-token sequences that fit")["ratio"] <= 2
    assert not [f for f in workload["figures"] if "resident" in f["name"]
                and f["name"].startswith("gpt-oss")]


def test_the_engine_is_compared_with_generate_on_each_checkpoint(report):
    """Both shapes' transformers checkpoints went through generate, and their tokens were
    equal to the engine's (the run raises otherwise)."""
    pytest.importorskip("transformers")
    _, workload = report
    for shape in ("gemma3", "gpt-oss"):
        found = figure(workload, shape, "generated tokens/s")
        assert found["baseline"] == hybrid.GENERATE and found["repeats"] >= 2, found
        assert "tokens equal" in found["name"]


def test_a_differing_token_refuses_the_comparison():
    hybrid.check_same_tokens([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], "same")
    with pytest.raises(RuntimeError, match=r"gen: prompt 1 differs .* at token 2"):
        hybrid.check_same_tokens([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]], "gen")


def test_without_transformers_tinyllama_twins_share_weights(monkeypatch, tmp_path):
    monkeypatch.setattr(hybrid_models, "has_transformers", lambda: False)
    pair = hybrid_models.build_pair(GPT_OSS, QUICK, tmp_path)
    assert pair.checkpoint is None and "TinyLlama" in pair.description
    assert [str(k) for k in pair.hybrid.config.kinds] == ["sliding:32", "full"] * 2
    assert pair.all_full.config.kinds == () and pair.all_full.config.sinks
    for mine, twin in zip(pair.hybrid.parameters(), pair.all_full.parameters(), strict=True):
        assert torch.equal(mine, twin)
    blocks = hybrid.pool_blocks(pair, 2, 1000)
    full = pair.all_full.cache_config(num_blocks=blocks[hybrid.ALL_FULL]).total_bytes
    mixed = pair.hybrid.cache_config(num_blocks=blocks[hybrid.HYBRID])
    assert 0 <= full - mixed.total_bytes < mixed.bytes_per_block  # one byte budget
