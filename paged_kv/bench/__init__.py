"""The benchmark suite behind ``paged-kv bench``: every claim a ratio against a baseline
measured in the same run, written to a report with plots.

    trace.py      seeded prompts (every workload's and the demo's) and the serving trace,
                  saved and loaded as JSON lines
    replay.py     replay a trace through any block manager's bookkeeping
    baselines.py  the same-run baselines: a Python-object block manager, the seeds' caches
    scale.py      the sizes of every workload for the quick and the full run
    workloads/    one ``run`` each: allocator, kernels, step_cost, memory, serving,
                  quantised, peers, tensor_parallel by default; service, tiers, replicas,
                  hybrid only when named (they start servers, redis-server and writer
                  processes, or prefill long prompts for minutes)
    netdelay.py   the tiers workload's loopback helpers: a private redis-server, and a TCP
                  proxy that adds latency and counts round trips
    timing.py     repeats -> median / min / max, and `Figure` (value, baseline, ratio)
    results.py    what a workload hands the report: figures, facts, plots
    report.py     report.md, results.json, PNGs (matplotlib, imported lazily)
    cli.py        ``paged-kv bench [--quick] [--out DIR] [--workloads NAME ...]``

Importing this package needs neither matplotlib nor the serving extra.
"""

from .baselines import ContiguousKVCache, ListKVCache, SimpleBlockManager
from .replay import ReplayResult, replay
from .timing import Figure, Stat
from .trace import TraceRequest, TraceSpec, load_trace, make_trace, save_trace

__all__ = ["ContiguousKVCache", "Figure", "ListKVCache", "ReplayResult", "SimpleBlockManager",
           "Stat", "TraceRequest", "TraceSpec", "load_trace", "make_trace", "replay",
           "save_trace"]
