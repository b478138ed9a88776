"""``--workloads tensor_parallel``: tensor parallelism — capacity at a fixed per-rank memory
budget, N = 1 and 2.

Each rank's pool holds its share of the KV heads for the same block ids, so at one per-rank
budget N ranks hold N times the blocks: the longest context and the number of sequences
running at once should grow by N. Both are measured by running the engine (the embedded
TinyLlama) with ``tensor_parallel_size`` 1 and 2 at the same per-rank budget; step time is
split into model, communication (the plan broadcast and the all-reduces, timed on rank 0)
and bookkeeping (everything else in the step). On this 2-core CPU machine the two ranks
share the cores, so throughput is not the point; capacity is.
"""

from __future__ import annotations

import time

import numpy as np

from ...engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from ...engine.config import EngineConfig
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat

BLOCK_SIZE = 16
CONFIG = TinyLlamaConfig(num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=512,
                         num_heads=8, num_kv_heads=4, head_dim=32, max_position=8192)
BASELINE = "tensor_parallel_size=1 at the same per-rank budget"


def _run(model: TinyLlama, size: int, budget: int, requests: list[list[int]],
         new_tokens: int) -> dict:
    probe = model.cache_config(num_blocks=2, block_size=BLOCK_SIZE)
    per_rank_block = probe.bytes_per_block // size
    num_blocks = budget // per_rank_block
    config = model.cache_config(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    with Engine(model, EngineConfig(cache=config, max_num_seqs=256, max_num_batched_tokens=1024,
                                    tensor_parallel_size=size)) as engine:
        longest = config.num_usable_blocks * BLOCK_SIZE  # one sequence may hold them all
        for prompt in requests:
            engine.add_request(prompt, SamplingParams(max_tokens=new_tokens))
        running, step_s, model_s = [], 0.0, [0.0]
        forward = engine.model.forward

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            model_s[0] += time.perf_counter() - start
            return out

        engine.model.forward = timed
        collectives = engine.runner.collectives
        while engine.has_unfinished_requests:
            start = time.perf_counter()
            engine.step()
            step_s += time.perf_counter() - start
            running.append(engine.stats().num_running)
        reduce_s, broadcast_s = ((collectives.all_reduce_s, collectives.broadcast_s)
                                 if collectives is not None else (0.0, 0.0))
        bytes_per_rank = engine.pool_bytes_per_rank()
    return {"blocks": num_blocks, "longest": longest, "max_running": max(running),
            "mean_running": float(np.mean(running)), "steps": len(running),
            "model_s": model_s[0] - reduce_s, "comm_s": reduce_s + broadcast_s,
            "bookkeeping_s": step_s - model_s[0] - broadcast_s,
            "pool_bytes": bytes_per_rank}


def _split(runs: dict[int, list[dict]], budget: int, num_requests: int) -> tuple[dict, Plot]:
    """The facts, and rank 0's step time split into model, communication and bookkeeping."""
    last = {size: runs[size][-1] for size in (1, 2)}
    info = {"per-rank budget (MiB)": budget / 2**20, "requests": num_requests,
            "model": f"TinyLlama {CONFIG.num_layers} layers, {CONFIG.num_heads}/"
                     f"{CONFIG.num_kv_heads} heads, head_dim {CONFIG.head_dim}",
            "pool bytes per rank, N=1": last[1]["pool_bytes"],
            "pool bytes per rank, N=2": last[2]["pool_bytes"]}
    for size in (1, 2):
        for key in ("model_s", "comm_s", "bookkeeping_s"):
            info[f"N={size} {key.replace('_s', '')} time per step (ms)"] = round(
                1e3 * last[size][key] / last[size]["steps"], 3)
    parts = ("model_s", "comm_s", "bookkeeping_s")
    plot = Plot("step time split, rank 0 (ms per step)", "part", "ms per step",
                tuple(Series(f"N={size}", tuple(p.replace("_s", "") for p in parts),
                             tuple(1e3 * last[size][p] / last[size]["steps"] for p in parts))
                      for size in (1, 2)), kind="bar")
    return info, plot


def run(scale: Scale) -> WorkloadResult:
    """N = 1 and N = 2 at one per-rank budget, `scale.repeats` times each."""
    quick = scale.name == "quick"
    model = TinyLlama(CONFIG, seed=0)
    budget = (2 if quick else 8) * 2**20
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, CONFIG.vocab_size, int(n)).tolist()
                for n in rng.integers(64, 256, 24 if quick else 96)]
    new_tokens = 8 if quick else 32
    _run(model, 1, budget, requests[:2], 2)  # warm-up: compiled loops, first allocations
    runs = {1: [], 2: []}
    for _ in range(1 if quick else scale.repeats):
        for size in (1, 2):
            runs[size].append(_run(model, size, budget, requests, new_tokens))

    def stat(size: int, key: str, unit: str) -> Stat:
        return Stat(tuple(float(r[key]) for r in runs[size]), unit)

    figures = [
        Figure("blocks in the pool at the per-rank budget", stat(2, "blocks", "blocks"),
               BASELINE, stat(1, "blocks", "blocks"), higher_is_better=True),
        Figure("longest context that fits (tokens)", stat(2, "longest", "tokens"), BASELINE,
               stat(1, "longest", "tokens"), higher_is_better=True),
        Figure("most sequences running at once", stat(2, "max_running", "sequences"),
               BASELINE, stat(1, "max_running", "sequences"), higher_is_better=True),
        Figure("mean sequences running", stat(2, "mean_running", "sequences"), BASELINE,
               stat(1, "mean_running", "sequences"), higher_is_better=True),
    ]
    info, plot = _split(runs, budget, len(requests))
    return WorkloadResult(
        key="tensor_parallel", title="8. Tensor parallelism: capacity at a per-rank budget",
        description=__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        figures=figures, info=info, plots=[plot],
        notes=["CPU throughput is not the point here: both ranks share the same 2 cores, "
               "and gloo over loopback stands in for NCCL. benchmarks/gpu_check.py gains "
               "nothing from this workload (one GPU)."])
