"""The ``paged-kv`` command line: ``demo`` (the main job), ``serve`` (HTTP), ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from .bench.cli import add_bench_parser
from .cli_types import api_keys, at_least, model_dir, redis_url, writable_dir
from .config import KV_CACHE_DTYPES, CacheConfig
from .core.accounting import CacheStats
from .demo.synthetic import run_synthetic
from .handoff import add_handoff_flags
from .router.cli import add_route_parser
from .tiers import TierConfig

DEMO_HOST_MIB = 64.0  # the demo shows a host tier at work by default
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


def _check_memory(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """Reject a --memory-mib too small for two blocks of the embedded model's K/V."""
    bytes_per_block = CacheConfig(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                                  head_dim=args.head_dim, block_size=args.block_size,
                                  num_blocks=2, dtype=dtype).bytes_per_block
    if args.memory_mib * 2**20 < 2 * bytes_per_block:
        raise ValueError(f"argument --memory-mib: {args.memory_mib} MiB holds fewer than 2 "
                         f"KV blocks of {bytes_per_block} bytes; raise it")


def _demo(args: argparse.Namespace) -> int:
    if args.model is None:
        _check_memory(args, DTYPES[args.dtype] if args.synthetic else torch.float32)
    if args.synthetic:
        if args.memory_fraction is not None:
            print("paged-kv demo: --memory-fraction sizes a model's pool; --synthetic has no "
                  "model, give --memory-mib", file=sys.stderr)
            return 2
        return _synthetic_demo(args)
    from .demo.report import format_report
    from .demo.run import run_demo
    from .engine import TinyLlamaConfig

    model_config = TinyLlamaConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                   num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                   head_dim=args.head_dim, vocab_size=args.vocab_size,
                                   intermediate_size=2 * args.hidden_size)
    model = None
    if args.model is not None:
        from .engine.hf import HFCausalLM

        model = HFCausalLM.from_pretrained(args.model)
    report = run_demo(model=model, num_requests=args.num_requests, block_size=args.block_size,
                      memory_mib=args.memory_mib, preemption=args.preemption,
                      memory_fraction=args.memory_fraction, model_config=model_config,
                      seed=args.seed,
                      max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      progress=not args.json and sys.stderr.isatty(),
                      kv_cache_dtype=args.kv_cache_dtype,
                      tensor_parallel_size=args.tensor_parallel_size,
                      kv_tiers=TierConfig.from_args(args, _demo_host_mib(args, model)))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _demo_host_mib(args: argparse.Namespace, model: object) -> float:
    """The host tier the demo shows by default: none with several ranks or recurrent
    layers (the tiers do not carry their states yet; asking for one is refused by name)."""
    if args.tensor_parallel_size > 1 or getattr(model, "num_recurrent", 0):
        return 0.0
    return DEMO_HOST_MIB


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


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming it (no usage block), exit status 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _engine_flags() -> argparse.ArgumentParser:
    """Cache and engine flags shared by ``demo`` and ``serve`` (one parent, so a flag added
    here applies to both)."""
    parent = argparse.ArgumentParser(add_help=False)
    positive = at_least(int, 1)
    parent.add_argument("--block-size", type=positive, default=16, help="tokens per KV block")
    memory = parent.add_mutually_exclusive_group()
    memory.add_argument("--memory-mib", type=at_least(float, 0, strict=True), default=16.0,
                        help="KV pool budget in MiB")
    memory.add_argument("--memory-fraction", type=at_least(float, 0, strict=True),
                        default=None,
                        help="size the KV pool as this share, in (0, 1], of the memory free "
                             "on the device (vLLM's --gpu-memory-utilization; not with "
                             "--synthetic)")
    parent.add_argument("--kv-cache-dtype", choices=["auto", *KV_CACHE_DTYPES], default="auto",
                        help="how pages store K/V: auto (the model's dtype), 8 bits with a "
                             "scale per token and head (~2x the tokens), or 4 bits (~3.5x)")
    parent.add_argument("--tensor-parallel-size", type=positive, default=1,
                        help="split the model and the KV pool over N processes "
                             "(torch.distributed; under torchrun, its ranks)")
    parent.add_argument("--preemption", choices=["recompute", "swap"], default="recompute",
                        help="what happens to a sequence when blocks run out")
    parent.add_argument("--max-num-seqs", type=positive, default=64,
                        help="sequences running at once")
    parent.add_argument("--max-num-batched-tokens", type=positive, default=512,
                        help="tokens per engine step (prefill chunks and decodes)")
    tiers = parent.add_argument_group("cache tiers behind the device pool")
    tiers.add_argument("--kv-host-mib", type=at_least(float, 0), default=None, metavar="MIB",
                       help="host RAM for blocks written down from the pool (demo default "
                            "64, serve 0: off)")
    tiers.add_argument("--kv-disk", type=writable_dir, default=None, metavar="DIR",
                       help="a directory keeping blocks across restarts (with --kv-disk-mib)")
    tiers.add_argument("--kv-disk-mib", type=at_least(float, 0, strict=True), default=None,
                       metavar="MIB", help="the disk tier's cap")
    tiers.add_argument("--kv-remote", type=redis_url, default=None,
                       metavar="redis://HOST:PORT/DB",
                       help="a Redis every replica shares (give it maxmemory and "
                            "maxmemory-policy allkeys-lru)")
    parent.add_argument("--model", metavar="PATH", type=model_dir, default=None,
                        help="serve a Hugging Face causal LM from this local directory "
                             "(needs the hf extra) instead of the embedded TinyLlama")
    return parent


def _add_demo_parser(commands: argparse._SubParsersAction,
                     parent: argparse.ArgumentParser) -> None:
    demo = commands.add_parser(
        "demo", parents=[parent], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="serve a workload on the embedded model and report throughput, latency "
             "and memory accounting")
    positive = at_least(int, 1)
    demo.add_argument("--num-requests", type=positive, default=64)
    demo.add_argument("--num-layers", type=positive, default=4)
    demo.add_argument("--hidden-size", type=positive, default=256)
    demo.add_argument("--num-heads", type=positive, default=8)
    demo.add_argument("--num-kv-heads", type=positive, default=2)
    demo.add_argument("--head-dim", type=positive, default=32)
    demo.add_argument("--vocab-size", type=positive, default=2048)
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                      help="pool dtype of --synthetic (the model runs in float32)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--synthetic", action="store_true",
                      help="drive the cache alone (no model) through a synthetic workload")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.set_defaults(run=_demo)


def _add_serve_parser(commands: argparse._SubParsersAction,
                      parent: argparse.ArgumentParser) -> None:
    serve = commands.add_parser(
        "serve", parents=[parent], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
             "/metrics) over the engine; needs the serve extra")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=at_least(int, 0), default=8000)
    serve.add_argument("--api-keys", metavar="FILE", dest="tenants_file", type=api_keys,
                       default=None, help="'KEY TENANT' per line, or a TOML tenants file "
                                          "(admin keys, quotas, reservations, retention; "
                                          "docs/tenants.md): require Bearer auth and keep "
                                          "a prefix cache per tenant")
    serve.add_argument("--max-waiting", type=at_least(int, 0), default=256,
                       help="requests that would wait for a running slot beyond this get "
                            "429 with Retry-After (0: none waits)")
    serve.add_argument("--arrival-hold-ms", type=at_least(float, 0), default=1.0,
                       help="the most a step about to start waits for generation requests "
                            "the API server has received but not yet handed to the engine "
                            "core, so that they join it as they would in-process (0: steps "
                            "never wait)")
    serve.add_argument("--drain-timeout", type=at_least(float, 0), default=30.0,
                       help="seconds running requests get to finish after SIGTERM")
    serve.add_argument("--api-server-count", type=at_least(int, 1), default=1,
                       help="API server processes (HTTP, tokenization, SSE) sharing the one "
                            "engine-core process and the listening socket")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                       help="the model's names, as in vLLM: the first is the one responses "
                            "and /v1/models report, a request may give any (another is a "
                            "404; none: the first); default: the --model directory's name, "
                            "or paged-kv-tiny-llama")
    _add_request_limits(serve)
    _add_kv_events_flags(serve)
    add_handoff_flags(serve)
    serve.set_defaults(run=_serve)


def _add_kv_events_flags(serve: argparse.ArgumentParser) -> None:
    """Where and how the prefix index's changes are published (``--kv-events*``)."""
    events = serve.add_argument_group("KV events, for cache-aware routers (the events extra)")
    events.add_argument("--kv-events", metavar="ENDPOINT", default=None,
                        help="publish the prefix index's changes in vLLM's wire format on this "
                             "ZMQ PUB endpoint, e.g. tcp://*:5557 (GET /kv_events tells "
                             "routers where)")
    events.add_argument("--kv-events-replay", metavar="ENDPOINT", default=None,
                        help="the replay socket (default: the next port; 'off': none)")
    events.add_argument("--kv-events-topic", default=None,
                        help="first frame of each message (default kv@HOST:PORT@MODEL)")
    events.add_argument("--kv-events-token-ids", action="store_true",
                        help="put token ids in BlockStored events: they are the tenants' "
                             "prompts, so off unless you allow it")


def _add_request_limits(serve: argparse.ArgumentParser) -> None:
    """What one request may ask (the defaults are `server.http.protocol.InputLimits`'s;
    that module needs the serve extra, so they are repeated here)."""
    limits = serve.add_argument_group("what one request may ask")
    limits.add_argument("--max-logprobs", type=at_least(int, 0), default=20,
                        help="the most top log-probabilities per token (logprobs, "
                             "top_logprobs, prompt_logprobs); more is a 400, as in vLLM")
    limits.add_argument("--max-request-bytes", type=at_least(int, 1),
                        default=4 * 2**20,
                        help="a larger request body is refused (413) before it is parsed")


def _serve(args: argparse.Namespace) -> int:
    from .handoff import HandoffConfig
    from .server.serve import serve

    HandoffConfig.from_args(args)  # a role without its secret: exit 2 before anything starts
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``paged-kv`` argument parser (``demo``, ``serve``, ``bench``, ``route``)."""
    parser = _Parser(prog="paged-kv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    parent = _engine_flags()
    _add_demo_parser(commands, parent)
    _add_serve_parser(commands, parent)
    add_bench_parser(commands)
    add_route_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``paged-kv`` command line; returns the exit code."""
    if int(os.environ.get("RANK", "0")) > 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a torchrun rank other than 0: serve rank 0's tensor-parallel plans until it stops
        from .engine.parallel import torchrun_worker

        torchrun_worker()
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:  # a flag value only the run can judge
        print(f"paged-kv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
