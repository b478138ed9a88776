"""Check the Triton paged attention's layer kinds (sliding window, chunked, sinks, soft-cap)
against the torch reference on a CUDA GPU, then time a window layer's decode against a full
layer's over the same pages.

32 sequences of 4-8K tokens, 8 KV heads x 128, block 16, bf16, 32 query heads. Exits non-zero
when there is no CUDA device or a case disagrees with its reference.

    python benchmarks/gpu_layer_kinds.py [--markdown docs/bench/gpu_layer_kinds.md]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.gpu_check import TOLERANCES, bench  # noqa: E402
from paged_kv.bench.workloads.kernels import PagedSetup  # noqa: E402
from paged_kv.kernels.attention import (  # noqa: E402
    paged_attention_reference,
    paged_attention_triton,
)

DEVICE = "cuda"
CASES = {  # name -> the kind arguments
    "full": {},
    "sliding 512": {"window": 512},
    "sliding 128 + sinks": {"window": 128, "sinks": True},
    "chunked 1024": {"chunk": 1024},
    "soft-cap 50": {"softcap": 50.0},
    "sliding 512 + soft-cap 50": {"window": 512, "softcap": 50.0},
}


def kind_args(case: dict, num_q_heads: int) -> dict:
    args = {k: v for k, v in case.items() if k != "sinks"}
    if case.get("sinks"):
        args["sinks"] = torch.randn(num_q_heads, device=DEVICE)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk's new tokens")
    parser.add_argument("--markdown", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dtype, heads_q, failures, rows = torch.bfloat16, 32, [], []
    pages = PagedSetup(args.num_seqs, args.max_len, dtype, DEVICE, 0,
                       min_len=args.max_len // 2, block_size=16, num_kv_heads=8, head_dim=128)
    caches = (pages.key_cache, pages.value_cache)
    for step, num_new in (("decode", 1), (f"prefill chunk of {args.chunk}", args.chunk)):
        starts = torch.arange(0, (args.num_seqs + 1) * num_new, num_new, dtype=torch.int32,
                              device=DEVICE)
        query = torch.randn(args.num_seqs * num_new, heads_q, 128, device=DEVICE).to(dtype)
        inputs = (query, *caches, pages.block_tables, pages.seq_lens, starts)
        full_ms = None
        for name, case in CASES.items():
            kinds = kind_args(case, heads_q)
            got = paged_attention_triton(*inputs, **kinds)
            want = paged_attention_reference(*inputs, **kinds)
            ok = torch.allclose(got, want, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
            print(f"  check {step} {name}: {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failures.append(f"{step} {name}")
            ms = bench(lambda inputs=inputs, kinds=kinds, got=got:
                       paged_attention_triton(*inputs, out=got, **kinds))
            full_ms = ms if full_ms is None else full_ms
            rows.append((step, name, ms, full_ms / ms))
    table = ["| step | layer kind | ms | speed vs full |", "|---|---|---:|---:|"]
    table += [f"| {step} | {name} | {ms:.3f} | {ratio:.2f}x |" for step, name, ms, ratio in rows]
    text = "\n".join(table)
    print(text)
    if args.markdown:
        verdict = "all ok" if not failures else "FAILED: " + ", ".join(failures)
        head = (f"# Triton paged attention by layer kind, {torch.cuda.get_device_name()}\n\n"
                f"{datetime.date.today()}; {args.num_seqs} sequences of {args.max_len // 2}-"
                f"{args.max_len} tokens, 8 KV heads x 128, 32 query heads, block 16, bf16; "
                f"`python benchmarks/gpu_layer_kinds.py`. Every case checked against the torch "
                f"reference first ({verdict}).\n\n")
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(head + text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
