"""``--workloads allocator``: allocator and page tables replaying a serving trace, bookkeeping only.

The paged cache (numpy page tables, batch allocator) and `SimpleBlockManager` (a Python
object per block and per sequence) replay the very same trace; a second measurement times
single decode steps with 256 running sequences.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from ...config import CacheConfig
from ...core.cache import PagedKVCache
from ..baselines import SimpleBlockManager
from ..replay import ReplayResult, paged_block_ops, replay, simple_block_ops
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat
from ..trace import TraceRequest, describe, output_token_id

BLOCK_SIZE = 16
NUM_BLOCKS = 16384  # 262K token slots: 256 running requests at their full length fit
MAX_RUNNING = 256
BASELINE = "SimpleBlockManager (Python objects per block and sequence)"
DESCRIPTION = (
    "A seeded synthetic trace (Poisson arrivals, long-tailed prompt and output lengths, half "
    "of the prompts behind a 256-token system prompt, up to 256 running, block size "
    "{block_size}) replayed through the cache's bookkeeping only (pool of 1 layer x 1 head x "
    "head_dim 1, prefix caching on, token ids given): add_sequence, prepare (block tables and "
    "slot mapping built as tensors), free, take_events. Only the manager's calls are timed. "
    "The baseline replays the very same schedule. The decode figure times single prepare() "
    "calls for {batch_size} sequences decoding one token each (median over steps, then over "
    "repeats).")


def bookkeeping_cache(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE,
                      enable_prefix_caching: bool = True, compiled: bool | None = None,
                      ) -> PagedKVCache:
    """A `PagedKVCache` whose pool is negligible (1 layer, 1 head, head_dim 1); `compiled`
    picks the decode step's variant (default: numba where installed)."""
    return PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=1,
                                    block_size=block_size, num_blocks=num_blocks,
                                    dtype=torch.float16, max_num_seqs=MAX_RUNNING,
                                    enable_prefix_caching=enable_prefix_caching),
                        compiled=compiled)


def replay_paged(trace: Sequence[TraceRequest]) -> ReplayResult:
    """The trace through a fresh bookkeeping-only `PagedKVCache`."""
    cache = bookkeeping_cache()
    return replay(trace, cache, capacity_blocks=NUM_BLOCKS - 1, block_size=BLOCK_SIZE,
                  max_running=MAX_RUNNING, count_block_ops=paged_block_ops(cache))


def replay_simple(trace: Sequence[TraceRequest]) -> ReplayResult:
    """The trace through a fresh `SimpleBlockManager`."""
    manager = SimpleBlockManager(NUM_BLOCKS, BLOCK_SIZE)
    return replay(trace, manager, capacity_blocks=NUM_BLOCKS - 1, block_size=BLOCK_SIZE,
                  max_running=MAX_RUNNING, count_block_ops=simple_block_ops(manager))


def decode_step_times(manager, prompts: Sequence[Sequence[int]], num_steps: int) -> list[float]:
    """Seconds of each of `num_steps` decode steps (one token for every sequence) after
    prefilling `prompts` into `manager`."""
    for seq_id, prompt in enumerate(prompts):
        hit = manager.add_sequence(seq_id, prompt)
        manager.prepare({seq_id: prompt[hit:]})
    times = []
    for step in range(num_steps):
        new_tokens = {seq_id: [output_token_id(seq_id, step)] for seq_id in range(len(prompts))}
        start = time.perf_counter()
        manager.prepare(new_tokens)
        times.append(time.perf_counter() - start)
    return times


def decode_step_times_arrays(cache: PagedKVCache, prompts: Sequence[Sequence[int]],
                             num_steps: int) -> list[float]:
    """As `decode_step_times`, through the array API: row handles resolved once (the
    running set does not change), then `prepare_decode(rows, tokens)` per step."""
    for seq_id, prompt in enumerate(prompts):
        hit = cache.add_sequence(seq_id, prompt)
        cache.prepare({seq_id: prompt[hit:]})
    rows = cache.rows_of(range(len(prompts)))
    times = []
    for step in range(num_steps):
        tokens = np.array([output_token_id(seq_id, step) for seq_id in range(len(prompts))])
        start = time.perf_counter()
        cache.prepare_decode(rows, tokens)
        times.append(time.perf_counter() - start)
    return times


def run(scale: Scale, trace: Sequence[TraceRequest]) -> WorkloadResult:
    """Replay `trace` through both managers `scale.repeats` times, then time decode steps."""
    paged, simple = [], []
    for _ in range(scale.repeats):
        paged.append(replay_paged(trace))
        simple.append(replay_simple(trace))
    prompts = [r.prompt_token_ids for r in trace[:MAX_RUNNING]]
    blocks = sum(-(-(len(p) + scale.decode_steps) // BLOCK_SIZE) for p in prompts) + 1
    paged_step, simple_step = [], []
    for _ in range(scale.repeats):
        cache = bookkeeping_cache(num_blocks=blocks)
        paged_step.append(statistics.median(decode_step_times(cache, prompts,
                                                              scale.decode_steps)))
        manager = SimpleBlockManager(blocks, BLOCK_SIZE)
        simple_step.append(statistics.median(decode_step_times(manager, prompts,
                                                               scale.decode_steps)))
    arrays_step, numpy_step = [], []
    for _ in range(scale.repeats):
        arrays_step.append(statistics.median(decode_step_times_arrays(
            bookkeeping_cache(num_blocks=blocks), prompts, scale.decode_steps)))
        numpy_step.append(statistics.median(decode_step_times_arrays(
            bookkeeping_cache(num_blocks=blocks, compiled=False), prompts,
            scale.decode_steps)))
    result = _result(trace, paged, simple, paged_step, simple_step, len(prompts))

    def us(times: list[float]) -> Stat:
        return Stat(tuple(times), "s").scaled(1e6, "us")

    compiled = bookkeeping_cache(num_blocks=2).tables.compiled
    result.figures.extend([
        Figure(f"decode step, {len(prompts)} sequences: array API (rows_of + prepare_decode"
               f"{', compiled loops' if compiled else ''})", us(arrays_step),
               "the mapping API, prepare({seq: [token]})", us(paged_step),
               higher_is_better=False),
        Figure(f"decode step, {len(prompts)} sequences, array API: "
               f"{'compiled page-table loops (numba)' if compiled else 'numpy path'}",
               us(arrays_step), "numpy page-table path (compiled=False)", us(numpy_step),
               higher_is_better=False),
    ])
    return result


def _result(trace, paged: list[ReplayResult], simple: list[ReplayResult],
            paged_step: list[float], simple_step: list[float], batch_size: int,
            ) -> WorkloadResult:
    def total(results: list[ReplayResult]) -> Stat:
        return Stat(tuple(r.total_time for r in results), "s")

    def ops_rate(results: list[ReplayResult]) -> Stat:
        return Stat(tuple(r.num_block_ops / r.total_time for r in results), "block ops/s")

    figures = [
        Figure("trace replay: total bookkeeping time", total(paged), BASELINE, total(simple),
               higher_is_better=False),
        Figure("trace replay: block operations per second", ops_rate(paged), BASELINE,
               ops_rate(simple), higher_is_better=True),
        Figure(f"decode step, {batch_size} sequences: median bookkeeping time",
               Stat(tuple(paged_step), "s").scaled(1e6, "us"), BASELINE,
               Stat(tuple(simple_step), "s").scaled(1e6, "us"), higher_is_better=False),
    ]
    last_paged, last_simple = paged[-1], simple[-1]
    info = {**{f"trace {k}": v for k, v in describe(list(trace)).items()},
            "block size": BLOCK_SIZE, "pool blocks": NUM_BLOCKS,
            "steps replayed": len(last_paged.step_times),
            "most requests running at once": max(last_paged.running),
            "block operations (allocated + freed) per replay": last_paged.num_block_ops,
            "baseline block operations per replay": last_simple.num_block_ops,
            "same schedule in both replays": last_paged.running == last_simple.running}
    plot = Plot("bookkeeping time of each trace step (last repeat)",
                "requests running", "time per step (us)",
                (Series("paged (PagedKVCache)", last_paged.running,
                        tuple(1e6 * t for t in last_paged.step_times)),
                 Series("baseline (SimpleBlockManager)", last_simple.running,
                        tuple(1e6 * t for t in last_simple.step_times))),
                kind="scatter", logy=True)
    return WorkloadResult(
        key="allocator", title="1. Allocator and page tables on a serving trace",
        description=DESCRIPTION.format(block_size=BLOCK_SIZE, batch_size=batch_size),
        figures=figures, info=info, plots=[plot])
