"""The ``memory`` workload at small size: the occupancy replay at several block sizes and parallel
sampling; the memory fractions go to ``extra_info`` (the timing is of the replay)."""

from __future__ import annotations

import pytest

from paged_kv.bench import TraceSpec, make_trace
from paged_kv.bench.workloads.memory import occupancy, parallel_sampling

TRACE = make_trace(TraceSpec(num_requests=80), seed=0)


@pytest.mark.benchmark(group="memory: occupancy replay, 80 requests")
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_occupancy(benchmark, block_size):
    occ = benchmark.pedantic(occupancy, args=(TRACE, block_size), rounds=1, iterations=1)
    benchmark.extra_info.update(
        paged=occ.live_tokens / occ.paged_slots,
        contiguous=occ.live_tokens / occ.contiguous_slots,
        bucket=occ.live_tokens / occ.bucket_slots)
    assert occ.paged_slots >= occ.live_tokens > 0


@pytest.mark.benchmark(group="memory: parallel sampling, 8 prompts")
@pytest.mark.parametrize("n", [2, 4, 6])
def test_parallel_sampling(benchmark, n):
    occ = benchmark.pedantic(parallel_sampling, args=(TRACE, n, 8), rounds=1, iterations=1)
    benchmark.extra_info["saved_fraction"] = occ.saved_fraction
    assert occ.saved_bytes > 0
