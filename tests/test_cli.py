"""The main job runs and reports consistent accounting."""

from __future__ import annotations

import json

from paged_kv.cli import main


def test_demo_json_report(capsys):
    assert main(["demo", "--num-requests", "6", "--memory-mib", "4", "--num-layers", "1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    peak, final = report["peak"], report["final"]
    assert report["num_tokens_written"] > 0 and report["num_steps"] > 0
    for stats in (peak, final):
        assert (stats["num_live_blocks"] + stats["num_cached_blocks"] + stats["num_free_blocks"]
                == stats["num_blocks"] - 1)
    assert final["num_live_blocks"] == 0 and final["num_sequences"] == 0
    assert peak["num_live_blocks"] > 0 and 0 <= peak["waste_fraction"] < 1


def test_demo_table(capsys):
    assert main(["demo", "--num-requests", "4", "--memory-mib", "2", "--num-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory accounting at the busiest step" in out and "cached (reusable prefixes)" in out
