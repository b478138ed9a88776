"""The main job: serve a realistic workload on the embedded model and report what it cost."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..accounting import CacheStats
from ..tiers import TierConfig
from ..tiers.manager import TiersStats
from .engine import Engine
from .model import TinyLlama, TinyLlamaConfig
from .sampling import SamplingParams
from .sizing import pool_config


def make_workload(num_requests: int, *, vocab_size: int, seed: int = 0,
                  system_prompt_len: int = 64, mean_prompt_len: int = 160,
                  max_prompt_len: int = 1024, mean_output_len: int = 48,
                  max_output_len: int = 256) -> list[tuple[list[int], SamplingParams]]:
    """Seeded requests: long-tailed prompt and output lengths, half of the prompts behind one
    shared system prompt, every eighth request sampled ``n = 4`` times."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, system_prompt_len).tolist()
    requests = []
    for i in range(num_requests):
        # lognormal with sigma 1: median ~ 0.6 x mean, a long tail clipped at the maximum
        prompt_len = int(np.clip(rng.lognormal(np.log(mean_prompt_len) - 0.5, 1.0), 1,
                                 max_prompt_len))
        output_len = int(np.clip(rng.lognormal(np.log(mean_output_len) - 0.5, 1.0), 1,
                                 max_output_len))
        prompt = rng.integers(0, vocab_size, prompt_len).tolist()
        if i % 2 == 0:
            prompt = system + prompt
        n = 4 if i % 8 == 3 else 1
        params = SamplingParams(max_tokens=output_len, n=n, seed=seed * 1000 + i,
                                temperature=0.8 if n > 1 else 0.0, top_k=50)
        requests.append((prompt, params))
    return requests


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
    engine = Engine(model, cache_config, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, preemption=preemption,
                    tensor_parallel_size=tensor_parallel_size, kv_tiers=kv_tiers)
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
    report = _report(workload, outputs, elapsed, peak, engine, concurrency, budget)
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


def tiers_report(stats: TiersStats) -> dict:
    """Per tier: blocks and MiB held, blocks written, prompt tokens served, misses,
    verification failures; and the fetches' fallbacks."""
    report = {t.tier: {"blocks": t.blocks, "mib": t.bytes / 2**20, "written": t.written_blocks,
                       "hit_tokens": t.hit_tokens, "misses": t.misses,
                       "verify_failures": t.verify_failures} for t in stats.tiers}
    report["fetches"] = {"done": stats.fetches, "deadline_fallbacks": stats.deadline_fallbacks,
                         "skipped": stats.skipped_fetches, "dropped_writes": stats.dropped_writes}
    return report


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


def _report(workload, outputs, elapsed: float, peak: CacheStats, engine: Engine,
            concurrency: list[int], budget: int) -> dict:
    final = engine.cache.stats()
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    ttft = np.array([out.time_to_first_token for out in outputs])
    latencies = np.array([x for out in outputs for x in out.token_latencies] or [0.0])
    max_len = max(len(p) + q.max_tokens for p, q in workload)
    return {
        "model": getattr(engine.model, "name", type(engine.model).__name__),
        "kv_cache_dtype": engine.cache.config.kv_cache_dtype,
        "num_requests": len(outputs),
        "num_samples": sum(len(out.outputs) for out in outputs),
        "prompt_tokens": sum(len(p) for p, _ in workload),
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "throughput_tokens_per_s": generated / elapsed,
        "ttft_median_ms": 1e3 * float(np.median(ttft)),
        "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
        "token_latency_median_ms": 1e3 * float(np.median(latencies)),
        "token_latency_p99_ms": 1e3 * float(np.percentile(latencies, 99)),
        "max_running": max(concurrency),
        "memory_budget_bytes": budget,
        "pool_bytes": final.total_bytes,
        "peak_live_blocks": peak.num_live_blocks,
        "peak_cached_blocks": peak.num_cached_blocks,
        "peak_free_blocks": peak.num_free_blocks,
        "peak_live_tokens": peak.num_live_tokens,
        "peak_waste_percent": 100 * peak.waste_fraction,
        "peak_bytes_saved_by_sharing": peak.bytes_saved_by_sharing,
        "prefix_query_tokens": final.prefix_query_tokens,
        "prefix_hit_tokens": final.prefix_hit_tokens,
        "prefix_hit_rate": final.prefix_hit_rate,
        "preemptions": engine.stats().num_preemptions,
        "final_live_blocks": final.num_live_blocks,
        "final_cached_blocks": final.num_cached_blocks,
        "final_free_blocks": final.num_free_blocks,
        "contiguous_max_len": max_len,
        "contiguous_fits_requests": budget // (max_len * engine.cache.config.bytes_per_token),
    }


def _tier_rows(report: dict) -> list[tuple[str, str]]:
    """The report's rows about the tiers (none without them)."""
    rows = []
    for tier, t in report.get("tiers", {}).items():
        if tier != "fetches":
            rows.append((f"{tier} tier: blocks (MiB) / written / hit tokens",
                         f"{t['blocks']} ({t['mib']:.1f}) / {t['written']} / {t['hit_tokens']}"))
    if "tiers replay" in report:
        replay = report["tiers replay"]
        rows.append((f"{replay['requests']} prompts again, device cache dropped",
                     f"{replay['tier_hit_tokens']} / {replay['prompt_tokens']} prompt tokens "
                     f"from the tiers, TTFT median {replay['ttft_median_ms']:.0f} ms "
                     f"(first time {replay['first_ttft_median_ms']:.0f} ms)"))
    return rows


def format_report(report: dict) -> str:
    """The report as the text table `paged-kv demo` prints."""
    mib = 2**20
    rows = [
        ("requests (samples)", f"{report['num_requests']} ({report['num_samples']})"),
        ("prompt / generated tokens", f"{report['prompt_tokens']} / "
                                      f"{report['generated_tokens']}"),
        ("wall time", f"{report['elapsed_s']:.2f} s"),
        ("throughput", f"{report['throughput_tokens_per_s']:.0f} generated tokens/s"),
        ("time to first token", f"median {report['ttft_median_ms']:.0f} ms, "
                                f"p99 {report['ttft_p99_ms']:.0f} ms"),
        ("per-token latency", f"median {report['token_latency_median_ms']:.1f} ms, "
                              f"p99 {report['token_latency_p99_ms']:.1f} ms"),
        ("most sequences running at once", f"{report['max_running']}"),
        ("KV pool", f"{report['pool_bytes'] / mib:.1f} MiB "
                    f"(kv_cache_dtype {report['kv_cache_dtype']})"),
        ("peak blocks live / cached / free", f"{report['peak_live_blocks']} / "
                                             f"{report['peak_cached_blocks']} / "
                                             f"{report['peak_free_blocks']}"),
        ("waste at peak (empty slots)", f"{report['peak_waste_percent']:.2f}% of live slots"),
        ("saved by sharing at peak", f"{report['peak_bytes_saved_by_sharing'] / mib:.2f} MiB"),
        ("prefix cache hits", f"{report['prefix_hit_tokens']} / {report['prefix_query_tokens']}"
                              f" prompt tokens ({100 * report['prefix_hit_rate']:.1f}%)"),
        ("preemptions", f"{report['preemptions']}"),
        ("end: blocks live / cached / free", f"{report['final_live_blocks']} / "
                                             f"{report['final_cached_blocks']} / "
                                             f"{report['final_free_blocks']}"),
        ("a contiguous max-length cache", f"fits {report['contiguous_fits_requests']} requests "
                                          f"of {report['contiguous_max_len']} tokens in the "
                                          f"same memory (paged ran up to "
                                          f"{report['max_running']})"),
    ]
    rows += _tier_rows(report)
    if "tensor parallel" in report:
        parallel = report["tensor parallel"]
        rows.append(("tensor-parallel ranks", f"{parallel['ranks']}, KV pool per rank " + ", ".join(
            f"{nbytes / mib:.1f} MiB" for nbytes in parallel["pool bytes per rank"])))
    width = max(len(name) for name, _ in rows)
    lines = [f"paged_kv demo: continuous batching on {report['model']}", "-" * (width + 40)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
