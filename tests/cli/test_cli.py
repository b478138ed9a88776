"""The main job runs and reports consistent accounting."""

from __future__ import annotations

import json

from paged_kv.cli import main

SERVING_FIELDS = [
    "throughput_tokens_per_s", "ttft_median_ms", "ttft_p99_ms", "token_latency_median_ms",
    "token_latency_p99_ms", "peak_live_blocks", "peak_cached_blocks", "peak_free_blocks",
    "peak_waste_percent", "peak_bytes_saved_by_sharing", "prefix_hit_rate", "preemptions",
    "contiguous_fits_requests", "generated_tokens",
]


def test_serving_demo_json_report(capsys):
    assert main(["demo", "--num-requests", "10", "--memory-mib", "1", "--num-layers", "1",
                 "--hidden-size", "64", "--vocab-size", "256", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    missing = [f for f in SERVING_FIELDS if f not in report]
    assert not missing, f"report lacks {missing}"
    assert report["num_requests"] == 10 and report["generated_tokens"] > 0
    assert report["throughput_tokens_per_s"] > 0 and report["final_live_blocks"] == 0
    assert report["prefix_hit_tokens"] > 0, "half the requests share a system prompt"
    assert report["peak_bytes_saved_by_sharing"] > 0, "n = 4 samples share their prompt"


def test_serving_demo_table_with_swap(capsys):
    assert main(["demo", "--num-requests", "6", "--memory-mib", "0.5", "--num-layers", "1",
                 "--hidden-size", "64", "--vocab-size", "256", "--preemption", "swap"]) == 0
    out = capsys.readouterr().out
    assert "throughput" in out and "a contiguous max-length cache" in out


def test_synthetic_demo_json_report(capsys):
    assert main(["demo", "--synthetic", "--num-requests", "6", "--memory-mib", "4",
                 "--num-layers", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    peak, final = report["peak"], report["final"]
    assert report["num_tokens_written"] > 0 and report["num_steps"] > 0
    for stats in (peak, final):
        assert (stats["num_live_blocks"] + stats["num_cached_blocks"] + stats["num_free_blocks"]
                == stats["num_blocks"] - 1)
    assert final["num_live_blocks"] == 0 and final["num_sequences"] == 0
    assert peak["num_live_blocks"] > 0 and 0 <= peak["waste_fraction"] < 1


def test_synthetic_demo_table(capsys):
    assert main(["demo", "--synthetic", "--num-requests", "4", "--memory-mib", "2",
                 "--num-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory accounting at the busiest step" in out and "cached (reusable prefixes)" in out
