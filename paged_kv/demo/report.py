"""The demo's report: the figures of a run as a dict (``paged-kv demo --json``) and as the
text table ``paged-kv demo`` prints."""

from __future__ import annotations

import numpy as np

from ..config import CacheConfig
from ..core.accounting import CacheStats
from ..engine.engine import Engine
from ..tiers.manager import TiersStats


def tiers_report(stats: TiersStats) -> dict:
    """Per tier: blocks and MiB held, blocks written, prompt tokens served, misses,
    verification failures; and the fetches' fallbacks."""
    report = {t.tier: {"blocks": t.blocks, "mib": t.bytes / 2**20, "written": t.written_blocks,
                       "hit_tokens": t.hit_tokens, "misses": t.misses,
                       "verify_failures": t.verify_failures} for t in stats.tiers}
    report["fetches"] = {"done": stats.fetches, "deadline_fallbacks": stats.deadline_fallbacks,
                         "skipped": stats.skipped_fetches, "dropped_writes": stats.dropped_writes}
    return report


def _pool_figures(config: CacheConfig, total_bytes: int) -> dict:
    """The pool's bytes, and what its page format buys: the tokens it holds and each
    token's bytes (scales included)."""
    return {"pool_bytes": total_bytes,
            "pool_tokens": config.num_usable_blocks * config.block_size,
            "bytes_per_token": config.bytes_per_token}


def make_report(workload: list, outputs: list, elapsed: float, peak: CacheStats,
                engine: Engine, concurrency: list[int], budget: int) -> dict:
    """The demo's figures: throughput, latencies, the accounting at the peak and at the end,
    prefix hits, and what a contiguous max-length cache would fit in the same memory."""
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
        **_pool_figures(engine.cache.config, final.total_bytes),
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
    } | _hybrid_fields(peak, final)


def _hybrid_fields(peak, final) -> dict:
    """A hybrid layout's peak blocks by layer kind and what its window layers gave back."""
    fields = {"peak_blocks_by_kind": dict(peak.blocks_by_kind),
              "given_back_blocks": final.num_given_back,
              "given_back_bytes": final.bytes_given_back}
    if final.state_bytes:  # recurrent layers: the state slab and its checkpoints
        fields |= {"state_bytes": final.state_bytes,
                   "peak_live_states": peak.num_live_states,
                   "checkpoints": final.num_checkpoints,
                   "checkpoint_bytes": final.checkpoint_bytes,
                   "checkpoints_written": final.checkpoints_written,
                   "checkpoints_hit": final.checkpoints_hit,
                   "checkpoints_evicted": final.checkpoints_evicted}
    return fields


def _hybrid_rows(report: dict) -> list[tuple[str, str]]:
    """The report's rows about a hybrid layout's window layers (none for a uniform one)."""
    rows = []
    if report.get("peak_blocks_by_kind"):
        rows += [("peak blocks by layer kind", ", ".join(
                    f"{kind} {count}" for kind, count in report["peak_blocks_by_kind"].items())),
                 ("given back by window layers", f"{report['given_back_blocks']} blocks "
                  f"({report['given_back_bytes'] / 2**20:.1f} MiB)")]
    if report.get("state_bytes"):
        rows += [("recurrent state slab", f"{report['state_bytes'] / 2**20:.1f} MiB, "
                  f"{report['peak_live_states']} live states at peak"),
                 ("state checkpoints held / written / hit / evicted",
                  f"{report['checkpoints']} ({report['checkpoint_bytes'] / 2**20:.1f} MiB) / "
                  f"{report['checkpoints_written']} / {report['checkpoints_hit']} / "
                  f"{report['checkpoints_evicted']}")]
    return rows


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
        ("KV pool", f"{report['pool_bytes'] / mib:.1f} MiB, {report['pool_tokens']} tokens "
                    f"x {report['bytes_per_token']} B ({report['kv_cache_dtype']} pages)"),
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
    rows += _hybrid_rows(report) + _tier_rows(report)
    if "tensor parallel" in report:
        parallel = report["tensor parallel"]
        rows.append(("tensor-parallel ranks", f"{parallel['ranks']}, KV pool per rank " + ", ".join(
            f"{nbytes / mib:.1f} MiB" for nbytes in parallel["pool bytes per rank"])))
    width = max(len(name) for name, _ in rows)
    lines = [f"paged_kv demo: continuous batching on {report['model']}", "-" * (width + 40)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
