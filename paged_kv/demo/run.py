"""`paged-kv demo`: serve the demo's workload (`workload`) on the embedded model, or any
model the `Engine` drives, and report what it cost (`report`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..core.accounting import CacheStats
from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.model import TinyLlama, TinyLlamaConfig
from ..engine.sampling import SamplingParams
from ..engine.sizing import pool_config
from ..tiers import TierConfig
from .report import make_report, tiers_report
from .workload import make_workload


def run_demo(*, num_requests: int = 64, block_size: int = 16, memory_mib: float = 16.0,
             preemption: str = "recompute", model_config: TinyLlamaConfig | None = None,
             seed: int = 0, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
             progress: bool = True, model: torch.nn.Module | None = None,
             memory_fraction: float | None = None, kv_cache_dtype: str = "auto",
             tensor_parallel_size: int = 1, kv_tiers: TierConfig | None = None) -> dict:
    """Serve `make_workload(num_requests)` and return the report as a dict.

    `model` defaults to the embedded `TinyLlama(model_config)`; any model the `Engine`
    drives works (e.g. `HFCausalLM.from_pretrained(path)`). The pool takes `memory_mib`, or,
    when given, `memory_fraction` of the free memory (`cache_config_for_free_memory`).
    `kv_cache_dtype` picks 8-bit pages (`CacheConfig.kv_cache_dtype`): more blocks in the
    same memory. `kv_tiers` puts tiers behind the pool (the report counts their hits).
    """
    torch.manual_seed(seed)
    model = model if model is not None else TinyLlama(model_config, seed=seed)
    cache_config, budget = pool_config(model, block_size=block_size, memory_mib=memory_mib,
                                       memory_fraction=memory_fraction, preemption=preemption,
                                       kv_cache_dtype=kv_cache_dtype)
    engine = Engine(model, EngineConfig(cache=cache_config, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens,
                                        preemption=preemption,
                                        tensor_parallel_size=tensor_parallel_size,
                                        kv_tiers=kv_tiers))
    max_prompt_len = min(1024, model.config.max_position // 2)
    workload = make_workload(num_requests, vocab_size=model.config.vocab_size, seed=seed,
                             max_prompt_len=max_prompt_len,
                             max_output_len=min(256, model.config.max_position // 4))
    for prompt, params in workload:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    outputs, peak, concurrency = _serve(engine, num_requests, progress)
    elapsed = time.perf_counter() - start
    engine.check()
    report = make_report(workload, outputs, elapsed, peak, engine, concurrency, budget)
    if engine.tiers is not None:
        report["tiers replay"] = _replay_from_tiers(engine, workload, outputs)
        report["tiers"] = tiers_report(engine.stats().tiers)
    if engine.tensor_parallel_size > 1:
        report["tensor parallel"] = {"ranks": engine.tensor_parallel_size,
                                     "pool bytes per rank": engine.pool_bytes_per_rank()}
    engine.close()
    return report


def _replay_from_tiers(engine: Engine, workload: list, outputs: list, count: int = 8) -> dict:
    """Drop the device's prefix cache (as a restart would) and send the first `count`
    prompts again for one token each: their prefixes come back from the tiers. Returns
    their time to first token against the first time, and the tokens the tiers served."""
    count = min(count, len(workload))
    engine.tiers.flush()
    engine.cache.reset_prefix_cache()
    before = {t.tier: t.hit_tokens for t in engine.stats().tiers.tiers}
    first = {out.request_id: out.time_to_first_token for out in outputs}
    again = engine.generate([p for p, _ in workload[:count]], SamplingParams(max_tokens=1))
    after = engine.stats().tiers.tiers
    return {"requests": len(again),
            "ttft_median_ms": 1e3 * float(np.median([o.time_to_first_token for o in again])),
            "first_ttft_median_ms": 1e3 * float(np.median([first[i] for i in range(count)])),
            "tier_hit_tokens": sum(t.hit_tokens - before[t.tier] for t in after),
            "prompt_tokens": sum(len(p) for p, _ in workload[:count])}


def _serve(engine: Engine, num_requests: int, progress: bool,
           ) -> tuple[list, CacheStats, list[int]]:
    """Step until done: the outputs, the accounting at the peak, and running per step."""
    outputs, peak, concurrency = [], engine.cache.stats(), []
    bar = _progress(num_requests, progress)
    while engine.has_unfinished_requests:
        done = engine.step()
        outputs += done
        bar.update(len(done))
        stats = engine.stats()
        concurrency.append(stats.num_running)
        if stats.num_live_blocks > peak.num_live_blocks:
            peak = engine.cache.stats()  # the full accounting only at a new peak
    bar.close()
    return outputs, peak, concurrency


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled, leave=False)
