"""The ``serving`` workload at small size: the engine on the paged cache against the same engine
on a contiguous max-length cache with the same memory budget; throughput in ``extra_info``."""

from __future__ import annotations

import pytest

from paged_kv.bench import TraceSpec, make_trace
from paged_kv.bench.trace import scale_trace
from paged_kv.bench.workloads.serving import SLABS, serve

pytest.importorskip("prometheus_client")

from paged_kv.engine import TinyLlama, TinyLlamaConfig

MODEL = TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=64, intermediate_size=128))
REQUESTS = scale_trace(make_trace(TraceSpec(num_requests=32), seed=0), 16,
                       MODEL.config.vocab_size)
MAX_LEN = max(r.total_len for r in REQUESTS)


@pytest.mark.benchmark(group="serving 32 scaled requests, same KV budget")
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_serving(benchmark, cache):
    run = benchmark.pedantic(serve, args=(MODEL, REQUESTS),
                             kwargs=dict(paged=cache == "paged", budget_tokens=SLABS * MAX_LEN,
                                         max_len=MAX_LEN), rounds=2, iterations=1)
    benchmark.extra_info.update(throughput=run.throughput, max_running=max(run.running))
    assert run.throughput > 0
