"""The ``allocator`` workload at small size: trace replay and a 256-sequence decode step, paged
against the Python-object baseline (``pytest benchmarks/ --benchmark-only``)."""

from __future__ import annotations

import pytest

from paged_kv.bench import SimpleBlockManager, TraceSpec, make_trace
from paged_kv.bench.trace import output_token_id
from paged_kv.bench.workloads.allocator import bookkeeping_cache, replay_paged, replay_simple

TRACE = make_trace(TraceSpec(num_requests=120), seed=0)
PROMPTS = [r.prompt_token_ids[:128] for r in make_trace(TraceSpec(num_requests=256), seed=1)]


@pytest.mark.benchmark(group="trace replay, 120 requests, bookkeeping only")
@pytest.mark.parametrize("manager", ["paged", "simple"])
def test_trace_replay(benchmark, manager):
    run = replay_paged if manager == "paged" else replay_simple
    result = benchmark.pedantic(run, args=(TRACE,), rounds=3, iterations=1)
    benchmark.extra_info["block_ops"] = result.num_block_ops
    assert result.num_block_ops > 0


def _decoding(manager_name: str):
    blocks = 256 * (128 // 16 + 40) + 1
    manager = (bookkeeping_cache(num_blocks=blocks) if manager_name == "paged"
               else SimpleBlockManager(blocks, 16))
    for seq_id, prompt in enumerate(PROMPTS):
        hit = manager.add_sequence(seq_id, prompt)
        manager.prepare({seq_id: prompt[hit:]})
    return manager


@pytest.mark.benchmark(group="decode step bookkeeping, 256 sequences")
@pytest.mark.parametrize("manager_name", ["paged", "simple"])
def test_decode_step(benchmark, manager_name):
    manager, step = _decoding(manager_name), [0]

    def one_step():
        step[0] += 1
        manager.prepare({s: [output_token_id(s, step[0])] for s in range(len(PROMPTS))})

    benchmark.pedantic(one_step, rounds=200, iterations=1, warmup_rounds=5)
