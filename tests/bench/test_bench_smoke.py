"""``paged-kv bench --quick`` writes a complete report; the baselines compute what the paged
cache computes (so the ratios compare equal work). No timing is asserted."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from paged_kv import CacheConfig, PagedKVCache
from paged_kv.bench import (
    ContiguousKVCache,
    ListKVCache,
    SimpleBlockManager,
    TraceSpec,
    load_trace,
    make_trace,
    replay,
    save_trace,
)
from paged_kv.bench.cli import WORKLOADS
from paged_kv.bench.replay import paged_block_ops, simple_block_ops
from paged_kv.bench.scale import QUICK
from paged_kv.bench.trace import (
    LognormalLengths,
    PromptSource,
    PromptSpec,
    UniformLengths,
    make_prompts,
)
from paged_kv.bench.workloads import peers
from paged_kv.cli import main

SMALL_TRACE = TraceSpec(num_requests=40, arrival_rate=4.0, mean_prompt_len=60,
                        max_prompt_len=300, mean_output_len=12, max_output_len=60,
                        system_prompt_len=32)
MACHINE_FIELDS = ("CPU", "cores", "OS", "Python", "torch", "numpy", "date")
NUMBERS = ("median", "min", "max", "baseline_median", "baseline_min", "baseline_max", "ratio")


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text(encoding="utf-8"))


def test_report_has_every_section_header_and_command(quick_report):
    out, data = quick_report
    report = (out / "report.md").read_text(encoding="utf-8")
    assert [w["key"] for w in data["workloads"]] == list(WORKLOADS)
    for number, workload in enumerate(data["workloads"], 1):
        assert workload["title"].startswith(f"{number}. ")
        assert f"## {workload['title']}" in report, f"section {workload['key']} missing"
    assert "## Machine" in report
    for field in MACHINE_FIELDS:
        assert data["machine"][field], f"machine field {field} is empty"
        assert f"| {field} |" in report, f"machine field {field} not in report.md"
    assert data["command"].startswith(f"paged-kv bench --quick --out {out}")
    assert f"`{data['command']}`" in report


def test_every_workload_has_a_png(quick_report):
    out, data = quick_report
    for workload in data["workloads"]:
        png = out / workload["plot"]
        assert png.is_file() and png.stat().st_size > 1000, f"{png} missing or empty"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
        assert f"]({workload['plot']})" in (out / "report.md").read_text(encoding="utf-8")


def test_every_figure_is_a_finite_positive_number(quick_report):
    _, data = quick_report
    for workload in data["workloads"]:
        assert workload["figures"], f"{workload['key']} reports no figure"
        for figure in workload["figures"]:
            where = f"{workload['key']}: {figure['name']} vs {figure['baseline']}"
            for field in NUMBERS:
                value = figure[field]
                assert math.isfinite(value) and value > 0, f"{where}: {field} = {value}"
            assert figure["min"] <= figure["median"] <= figure["max"], where
            assert figure["repeats"] >= 1, where


def test_the_trace_is_saved_for_other_allocators(quick_report):
    out, _ = quick_report
    trace = load_trace(out / "trace.jsonl")
    assert trace == make_trace(TraceSpec(num_requests=len(trace)), seed=0)


def test_trace_round_trip_and_shape(tmp_path):
    trace = make_trace(SMALL_TRACE, seed=3)
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace
    assert all(1 <= len(r.prompt_token_ids) <= 300 and 1 <= r.output_len <= 60 for r in trace)
    shared = {r.prompt_token_ids[:32] for r in trace if r.system_prompt_len}
    assert len(shared) == 1 and 0 < sum(r.system_prompt_len > 0 for r in trace) < len(trace)
    (tmp_path / "bad.jsonl").write_text('{"request_id": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")



def test_prompts_share_the_system_prompt_and_lengths_as_specified():
    """The one prompt source: seeded, ids in range, the system prompt by index (counted in
    the drawn length) or by a draw (the whole prompt at most max_len)."""
    counted = PromptSpec(LognormalLengths.with_median(40, 0.6, low=8, high=64), vocab_size=50,
                         min_token_id=1, system_prompt_len=10, shared_fraction=0.5,
                         length_counts_system=True)
    prompts = make_prompts(counted, 30, seed=2)
    assert prompts == make_prompts(counted, 30, seed=2) != make_prompts(counted, 30, seed=3)
    assert all(p[:10] == prompts[0][:10] for p in prompts[::2])
    assert all(p[:10] != prompts[0][:10] for p in prompts[1::2])
    assert all(8 <= len(p) <= 64 and min(p) >= 1 and max(p) < 50 for p in prompts)
    drawn = PromptSpec(UniformLengths(1, 100), system_prompt_len=30, shared_fraction=0.3,
                       random_share=True, max_len=60)
    source = PromptSource(drawn, np.random.default_rng(0))
    shares = [source.draw() for _ in range(200)]
    assert all(len(p) <= 60 and p[:n] == source.system[:n] for p, n in shares)
    assert 0.15 < sum(n > 0 for _, n in shares) / 200 < 0.45

def test_both_managers_replay_the_same_schedule_and_block_operations():
    trace = make_trace(SMALL_TRACE, seed=1)
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=1, block_size=16,
                                     num_blocks=200))
    manager = SimpleBlockManager(200, 16)
    paged = replay(trace, cache, capacity_blocks=199, block_size=16, max_running=16,
                   count_block_ops=paged_block_ops(cache))
    simple = replay(trace, manager, capacity_blocks=199, block_size=16, max_running=16,
                    count_block_ops=simple_block_ops(manager))
    cache.check()
    assert paged.running == simple.running and max(paged.running) == 16
    assert paged.num_block_ops == simple.num_block_ops > 0
    assert cache.stats().num_live_blocks == 0 and len(manager.free_block_ids) == 199


def test_simple_manager_builds_the_same_step_as_the_paged_cache():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 100, 40).tolist()
    prompts = [system + rng.integers(0, 100, n).tolist() for n in (5, 17, 30)]
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=1, block_size=8,
                                     num_blocks=64))
    manager = SimpleBlockManager(64, 8)
    for seq_id, prompt in enumerate(prompts):  # one at a time, so later ones hit the prefix
        hits = [m.add_sequence(seq_id, prompt) for m in (cache, manager)]
        assert hits[0] == hits[1], f"sequence {seq_id}: prefix hits differ"
        cache.prepare({seq_id: prompt[hits[0]:]})
        manager.prepare({seq_id: prompt[hits[1]:]})
    step = {seq_id: [seq_id] for seq_id in range(len(prompts))}
    paged, simple = cache.prepare(step), manager.prepare(step)
    assert torch.equal(paged.seq_lens, simple.seq_lens)
    assert torch.equal(paged.query_start_loc, simple.query_start_loc)
    assert paged.block_tables.shape == simple.block_tables.shape


@pytest.mark.parametrize("seed_cache", [ListKVCache, ContiguousKVCache])
def test_seed_caches_hand_on_the_same_kv_as_the_paged_gather(seed_cache):
    batch_size, heads, dim, length = 3, 2, 4, 21
    history = torch.randn(batch_size, length, heads, dim)
    cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=heads, head_dim=dim,
                                     block_size=4, num_blocks=32, dtype=torch.float32))
    seeds = seed_cache(num_layers=1)
    for seq_id in range(batch_size):
        cache.add_sequence(seq_id)
    batch = cache.prepare(dict.fromkeys(range(batch_size), length - 1))
    flat = history[:, :-1].reshape(-1, heads, dim)
    cache.write(0, flat, -flat, batch)
    seeds.extend(0, history[:, :-1], -history[:, :-1])
    batch = cache.prepare(dict.fromkeys(range(batch_size), 1))
    cache.write(0, history[:, -1].contiguous(), -history[:, -1], batch)
    seeds.append(0, history[:, -1], -history[:, -1])
    paged_k, paged_v = cache.gather(0, batch)
    seed_k, seed_v = seeds.kv(0)
    assert torch.equal(seed_k[:, :length], paged_k) and torch.equal(seed_v[:, :length], paged_v)
    assert not seed_k[:, length:].any(), "padding past the length must be zeros"


def test_peers_compares_the_engine_with_each_transformers_path(quick_report):
    pytest.importorskip("transformers")
    _, data = quick_report
    [workload] = [w for w in data["workloads"] if w["key"] == "peers"]
    pairs = {(f["name"], f["baseline"]) for f in workload["figures"]}
    for baseline in (peers.GB_TUNED, peers.GENERATE):
        assert ("throughput, generated tokens (serving)", baseline) in pairs, baseline
        assert ("KV cache bytes allocated", baseline) in pairs, baseline
    assert ("time to first token, median", peers.GB_TUNED) in pairs
    assert ("time to first token, median", peers.GENERATE) not in pairs, "generate has no TTFT"
    assert workload["info"]["generated tokens"] == QUICK.peers_requests * QUICK.peers_new_tokens


def test_peers_refuses_to_time_different_answers():
    same = peers.PeerRun(((1, 2, 3), (4, 5)), 1.0, 1.0, None, 1, 1)
    wrong = dataclasses.replace(same, token_ids=((1, 2, 3), (4, 6)))
    peers._check_same_tokens({peers.ENGINE: [same], peers.GENERATE: [same]}, [[0], [0]])
    with pytest.raises(RuntimeError, match=r"generate, DynamicCache .* request 1 .* token 1"):
        peers._check_same_tokens({peers.ENGINE: [same], peers.GENERATE: [wrong]}, [[0], [0]])


def test_peers_is_skipped_without_transformers(monkeypatch, capsys, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real_find_spec(name,
                                                                                             *a))
    assert peers.run(QUICK) is None
    out = tmp_path / "skip"
    assert main(["bench", "--quick", "--out", str(out), "--workloads", "peers"]) == 0
    assert peers.SKIP_REASON in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["workloads"] == []


def test_quantised_pages_hold_twice_the_tokens_and_run_more_requests(quick_report):
    """Counts, not timings: block counts and the engine's schedule are deterministic."""
    _, data = quick_report
    workload = next(w for w in data["workloads"] if w["key"] == "quantised")
    figures = workload["figures"]
    capacity = [f for f in figures if f["name"].startswith("tokens in 1 GiB")]
    running = [f for f in figures if "requests running at once, mean" in f["name"]]
    agreement = [f for f in figures if f["name"].startswith("greedy tokens equal")]
    four_bit = [f for f in capacity if "int4" in f["name"] or "nvfp4" in f["name"]]
    eight_bit = [f for f in capacity if f not in four_bit]
    assert len(eight_bit) == 6 and all(f["ratio"] >= 1.9 for f in eight_bit), eight_bit
    assert len(four_bit) == 2 and all(f["ratio"] >= 3.0 for f in four_bit), four_bit
    assert len(running) == 2 and all(f["ratio"] >= 1.5 for f in running), running
    assert agreement and all(0 < f["median"] <= 1 for f in agreement)
