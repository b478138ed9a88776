"""``paged-kv bench``: run the workloads, print a summary table, write the report.

Importing this module is cheap (the parser only); the workloads load when the command runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

WORKLOADS = ("allocator", "kernels", "step_cost", "memory", "serving", "quantised", "peers",
             "tensor_parallel")
# only when named: they start `paged-kv serve`, redis-server and writer processes, or (hybrid)
# prefill 8K-token prompts for minutes; state replays a 48-layer model's slot counts (about a
# minute, and a transformers checkpoint); latent runs two transformers checkpoints
OPTIONAL_WORKLOADS = ("service", "tiers", "replicas", "hybrid", "tenants", "disagg", "state",
                      "latent")


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``bench`` on the ``paged-kv`` subcommands (its ``run`` returns an exit code)."""
    bench = commands.add_parser(
        "bench", help="run the benchmark suite and write a report with plots",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=__doc__.splitlines()[0].strip("`: ").split(": ", 1)[-1])
    bench.add_argument("--quick", action="store_true",
                       help="small sizes and fewer repeats (under a minute on 2 cores)")
    bench.add_argument("--out", type=Path, default=Path("bench-out"),
                       help="directory for report.md, results.json, the PNGs and trace.jsonl")
    bench.add_argument("--trace", type=Path, default=None,
                       help="replay this trace (JSON lines, as written to OUT/trace.jsonl) "
                            "instead of generating one")
    bench.add_argument("--workloads", nargs="+", choices=WORKLOADS + OPTIONAL_WORKLOADS,
                       default=list(WORKLOADS),
                       help="which workloads to run ('service', 'tiers', 'replicas', "
                            "'hybrid', 'tenants', 'disagg', 'state' and 'latent' run only "
                            "when named)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    bench.add_argument("--threads", type=_positive_int, default=None,
                       help="torch CPU threads (default: 1 with --quick, which keeps timings "
                            "sane on a shared machine; torch's default otherwise)")
    bench.add_argument("--device", default=None,
                       help="device of the kernel workload (default: cuda when available)")
    bench.set_defaults(run=run_bench)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected >= 1, got {text}")
    return value


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every option spelled out."""
    parts = ["paged-kv", "bench"] + (["--quick"] if args.quick else [])
    parts += ["--out", str(args.out), "--seed", str(args.seed), "--threads", str(args.threads),
              "--device", str(args.device), "--workloads", *args.workloads]
    return shlex.join(parts + (["--trace", str(args.trace)] if args.trace else []))


def run_bench(args: argparse.Namespace) -> int:
    """Run the selected workloads and write the report; returns the exit code."""
    import torch

    threads = torch.get_num_threads()
    args.threads = args.threads or (1 if args.quick else threads)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)
    try:
        return _run_all(args)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their setting


def _run_all(args: argparse.Namespace) -> int:
    import torch

    from .report import machine_info, summary_table, to_json, write_report
    from .scale import FULL, QUICK
    from .trace import TraceSpec, load_trace, make_trace, save_trace

    scale = QUICK if args.quick else FULL
    trace = (load_trace(args.trace) if args.trace
             else make_trace(TraceSpec(num_requests=scale.trace_requests), seed=args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    save_trace(trace, args.out / "trace.jsonl")
    start = time.perf_counter()
    results = []
    for i, key in enumerate(args.workloads, 1):
        print(f"[{i}/{len(args.workloads)}] {key} ({time.perf_counter() - start:.1f} s)",
              file=sys.stderr, flush=True)
        result = _run_workload(key, scale, trace, torch.device(args.device))
        if result is not None:  # None: skipped, its optional extra is missing
            results.append(result)
    wall_time = time.perf_counter() - start
    mode = (f"{scale.name} ({scale.repeats} repeats, {scale.serving_repeats} for serving, "
            f"{scale.peers_repeats} for peers)")
    data = to_json(command_line(args), machine_info(), mode, wall_time, results)
    for warning in write_report(args.out, data, results):
        print(f"warning: {warning}", file=sys.stderr)
    print(summary_table(data))
    print(f"\nreport: {args.out / 'report.md'}")
    return 0


def _run_workload(key: str, scale, trace, device):
    import importlib

    # each workload's run() arguments after `scale` (imported only when run)
    extra = {"allocator": (trace,), "kernels": (device,), "memory": (trace,),
             "quantised": (trace, device), "serving": (trace,)}
    module = importlib.import_module(f".workloads.{key}", __package__)
    result = module.run(scale, *extra.get(key, ()))
    if key == "peers" and result is None:
        print(module.SKIP_REASON, file=sys.stderr, flush=True)
    return result
