"""The ``state`` workload: ``paged-kv bench --quick --workloads state`` writes its rows
(each sane: counts within their totals, ratios in range, every target judged) after the
engine's tokens were checked equal to transformers' ``generate``; and the #45238 replay,
timed, serves every hit with the state of exactly its prefix."""

from __future__ import annotations

import json

import pytest

from paged_kv.bench.cli import OPTIONAL_WORKLOADS, WORKLOADS
from paged_kv.bench.workloads import state_cache as sc
from paged_kv.bench.workloads import state_parts as parts
from paged_kv.cli import main


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "state"
    assert main(["bench", "--quick", "--out", str(out), "--workloads", "state"]) == 0
    [found] = json.loads((out / "results.json").read_text(encoding="utf-8"))["workloads"]
    assert "## Recurrent state" in (out / "report.md").read_text(encoding="utf-8")
    return found


def _figure(workload: dict, start: str) -> dict:
    [found] = [f for f in workload["figures"] if f["name"].startswith(start)]
    return found


def test_state_runs_only_when_named():
    assert "state" in OPTIONAL_WORKLOADS and "state" not in WORKLOADS


def test_every_part_has_its_rows_within_their_totals(workload):
    hits = _figure(workload, "#45238 (64 prompts, 8 groups")
    assert 0 <= hits["median"] <= hits["baseline_median"] == 56  # 8 prompts start a group
    for start in ("#45238 (64 prompts): hit tokens", "480-token prefix",
                  "multi-turn (50 conversations x 3 turns): hit tokens"):
        figure = _figure(workload, start)
        assert 0 <= figure["median"] <= figure["baseline_median"]
        assert 0 <= figure["ratio"] <= 1
    share = _figure(workload, "multi-turn (50 conversations x 3 turns): peak checkpoint")
    assert 0 < share["median"] <= parts.CHECKPOINT_SHARE < share["baseline_median"] <= 1
    assert _figure(workload, "bytes per checkpoint")["ratio"] == pytest.approx(1.0)
    for start in ("1,000-token sequences per", "1,000-token sequences admitted"):
        figure = _figure(workload, start)
        assert figure["median"] > 0 and figure["baseline_median"] > 0
        assert 0.5 < figure["ratio"] < 4  # at most the 4:1 of layers that keep K/V
    targets = [key for key in workload["info"] if key.startswith("target ")]
    assert len(targets) == 5
    assert all(workload["info"][key].startswith(("met: ", "MISSED: ")) for key in targets)
    # with a slot for every boundary the same cache reaches the ideal
    assert workload["info"]["#45238: the same, every block checkpointed, unlimited "
                            "slots"].startswith("56/64 (100%")


def test_tokens_were_checked_equal_before_the_speeds(workload):
    pytest.importorskip("transformers")
    figure = _figure(workload, "tiny Qwen3-Next: generated tokens/s")
    assert figure["name"].endswith("tokens equal") and figure["median"] > 0
    assert figure["baseline_median"] > 0
    assert any(key.startswith("tiny Qwen3-Next: tokens checked equal")
               for key in workload["info"])


@pytest.mark.benchmark(group="state: #45238 replay, 64 prompts, 128 state slots")
def test_issue_replay(benchmark):
    groups, per_group, prefix, suffix = parts.ISSUE
    requests = parts._grouped(groups, per_group, prefix, suffix, seed=1)
    blocks = parts._pool_blocks(40 * parts.GIB, parts.DEFAULT_SLOTS)
    run = benchmark.pedantic(parts._serve, args=(requests, parts.DEFAULT_SLOTS, blocks),
                             rounds=1, iterations=1)
    benchmark.extra_info.update(prompts_hit=sum(h > 0 for h in run.hits),
                                hit_tokens=sum(run.hits))
    # every hit is block-aligned and within the shared prefix (the replay checked its state)
    assert all(h % sc.BLOCK_SIZE == 0 and 0 <= h <= prefix for h in run.hits)
    assert run.peak_checkpoints < parts.DEFAULT_SLOTS
