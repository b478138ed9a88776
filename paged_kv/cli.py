"""The ``paged-kv`` command line: ``paged-kv demo`` (the main job)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from .accounting import CacheStats
from .bench.cli import add_bench_parser
from .config import KV_CACHE_DTYPES, CacheConfig
from .workload import run_synthetic

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _accounting_rows(stats: CacheStats, block_size: int) -> list[tuple[str, str]]:
    mib = 2**20
    return [
        ("blocks (null block included)", f"{stats.num_blocks}"),
        ("  live", f"{stats.num_live_blocks}  ({stats.live_bytes / mib:.2f} MiB)"),
        ("  cached (reusable prefixes)", f"{stats.num_cached_blocks}  "
                                         f"({stats.cached_bytes / mib:.2f} MiB)"),
        ("  free", f"{stats.num_free_blocks}"),
        ("  shared (refcount > 1)", f"{stats.num_shared_blocks}"),
        ("pool bytes", f"{stats.total_bytes / mib:.2f} MiB"),
        ("live tokens", f"{stats.num_live_tokens}"),
        ("empty slots (waste)", f"{stats.num_empty_slots}  ({100 * stats.waste_fraction:.2f}% "
                                f"of live slots, block size {block_size})"),
        ("bytes saved by sharing", f"{stats.bytes_saved_by_sharing / mib:.2f} MiB"),
        ("prefix hit tokens / queried", f"{stats.prefix_hit_tokens} / "
                                        f"{stats.prefix_query_tokens}  "
                                        f"({100 * stats.prefix_hit_rate:.1f}%)"),
        ("sequences in cache", f"{len(stats.sequences)}"),
    ]


def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    print(f"\n{title}\n" + "-" * (width + 30))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def _demo(args: argparse.Namespace) -> int:
    if args.synthetic:
        if args.memory_fraction is not None:
            print("paged-kv demo: --memory-fraction sizes a model's pool; --synthetic has no "
                  "model, give --memory-mib", file=sys.stderr)
            return 2
        return _synthetic_demo(args)
    from .serving import TinyLlamaConfig
    from .serving.demo import format_report, run_demo

    model_config = TinyLlamaConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                   num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                   head_dim=args.head_dim, vocab_size=args.vocab_size,
                                   intermediate_size=2 * args.hidden_size)
    model = None
    if args.model is not None:
        from .serving.hf import HFCausalLM

        model = HFCausalLM.from_pretrained(args.model)
    report = run_demo(model=model, num_requests=args.num_requests, block_size=args.block_size,
                      memory_mib=args.memory_mib, preemption=args.preemption,
                      memory_fraction=args.memory_fraction, model_config=model_config,
                      seed=args.seed,
                      max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      progress=not args.json, kv_cache_dtype=args.kv_cache_dtype,
                      tensor_parallel_size=args.tensor_parallel_size)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _synthetic_demo(args: argparse.Namespace) -> int:
    config = CacheConfig.for_memory(
        args.memory_mib * 2**20, num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim, block_size=args.block_size, dtype=DTYPES[args.dtype],
        kv_cache_dtype=args.kv_cache_dtype)
    report = run_synthetic(config, num_sequences=args.num_requests, seed=args.seed)
    if args.json:
        print(json.dumps({"num_steps": report.num_steps, "num_forks": report.num_forks,
                          "num_tokens_written": report.num_tokens_written,
                          "num_out_of_blocks": report.num_out_of_blocks,
                          "peak": _stats_dict(report.peak),
                          "final": _stats_dict(report.final)}, indent=2))
        return 0
    print(f"paged_kv synthetic workload: {report.num_sequences} sequences, "
          f"{report.num_steps} steps, {report.num_tokens_written} tokens written, "
          f"{report.num_forks} forks, {report.num_out_of_blocks} out-of-blocks preemptions")
    _print_table("memory accounting at the busiest step", _accounting_rows(report.peak,
                                                                            config.block_size))
    _print_table("memory accounting at the end", _accounting_rows(report.final,
                                                                  config.block_size))
    return 0


def _stats_dict(stats: CacheStats) -> dict:
    fields = {k: getattr(stats, k) for k in stats.__dataclass_fields__ if k != "sequences"}
    return {**fields, "waste_fraction": stats.waste_fraction,
            "prefix_hit_rate": stats.prefix_hit_rate, "num_sequences": len(stats.sequences)}


def build_parser() -> argparse.ArgumentParser:
    """The ``paged-kv`` argument parser (``demo``, ``bench``)."""
    parser = argparse.ArgumentParser(prog="paged-kv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="serve a workload on the embedded model and report throughput, latency "
                     "and memory accounting")
    demo.add_argument("--num-requests", type=int, default=64)
    demo.add_argument("--block-size", type=int, default=16)
    memory = demo.add_mutually_exclusive_group()
    memory.add_argument("--memory-mib", type=float, default=16.0, help="KV pool budget")
    memory.add_argument("--memory-fraction", type=float, default=None,
                        help="size the KV pool as this share, in (0, 1], of the memory free "
                             "on the device (vLLM's --gpu-memory-utilization; not with "
                             "--synthetic)")
    demo.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    demo.add_argument("--max-num-seqs", type=int, default=64)
    demo.add_argument("--max-num-batched-tokens", type=int, default=512)
    demo.add_argument("--num-layers", type=int, default=4)
    demo.add_argument("--hidden-size", type=int, default=256)
    demo.add_argument("--num-heads", type=int, default=8)
    demo.add_argument("--num-kv-heads", type=int, default=2)
    demo.add_argument("--head-dim", type=int, default=32)
    demo.add_argument("--vocab-size", type=int, default=2048)
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                      help="pool dtype of --synthetic (the model runs in float32)")
    demo.add_argument("--tensor-parallel-size", type=int, default=1,
                      help="split the model and the KV pool over N processes "
                           "(torch.distributed; under torchrun, its ranks)")
    demo.add_argument("--kv-cache-dtype", choices=["auto", *KV_CACHE_DTYPES], default="auto",
                      help="how pages store K/V: auto (the pool dtype) or 8 bits with a scale "
                           "per token and head (about twice the tokens per MiB)")
    demo.add_argument("--model", metavar="PATH", default=None,
                      help="serve a Hugging Face causal LM from this local directory "
                           "(needs the hf extra) instead of the embedded TinyLlama")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--synthetic", action="store_true",
                      help="drive the cache alone (no model) through a synthetic workload")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.set_defaults(run=_demo)
    add_bench_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``paged-kv`` command line; returns the exit code."""
    if int(os.environ.get("RANK", "0")) > 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a torchrun rank other than 0: serve rank 0's tensor-parallel plans until it stops
        from .serving.parallel import torchrun_worker

        torchrun_worker()
        return 0
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
