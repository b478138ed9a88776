"""Check every Triton kernel against its torch reference on a CUDA GPU, then time it.

Realistic shapes: 32 sequences of 1-4K tokens, 8 KV heads x 128, block 16, bf16, 32 query
heads. One table: GB/s of write / gather (padded, packed) / copy and each one's speed relative
to a device-to-device ``dst.copy_(src)`` moving the same bytes (the practical roofline);
paged attention (decode and a prefill chunk) against SDPA on contiguous K/V and against
gather + SDPA; the prefill chunk (the tiled kernel, `attention_prefill`) also against the
per-token kernel it replaced (a program per query token, which reads the K/V once per query)
and FlashAttention's varlen kernel on contiguous packed K/V where ``flash_attn`` imports
(its row is skipped otherwise); ``--tile-sweep`` adds the tiled kernel at other tile shapes.
Then decode of a few long sequences (``--long-seqs`` of ``--long-len`` tokens), where the keys
are split across programs (flash-decoding), against the same kernel unsplit and SDPA.
Exits non-zero when there is no CUDA device or a kernel disagrees with its reference. Takes
well under a minute on an H100-class GPU.

    python benchmarks/gpu_check.py [--markdown bench-out/gpu_check.md] [--tile-sweep]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from paged_kv.bench.workloads.kernels import PagedSetup, copy_baseline  # noqa: E402
from paged_kv.kernels import attention, attention_prefill  # noqa: E402
from paged_kv.kernels._triton import triton  # noqa: E402
from paged_kv.kernels.attention import (  # noqa: E402
    paged_attention_reference,
    paged_attention_triton,
)
from paged_kv.kernels.copy import copy_blocks_reference, copy_blocks_triton  # noqa: E402
from paged_kv.kernels.gather import gather_kv_reference, gather_kv_triton  # noqa: E402
from paged_kv.kernels.gather_packed import (  # noqa: E402
    gather_kv_packed_reference,
    gather_kv_packed_triton,
)
from paged_kv.kernels.write import write_kv_reference, write_kv_triton  # noqa: E402

DEVICE = "cuda"
INT32_LIMIT = 2**31  # elements; pool offsets past this need 64-bit arithmetic
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (rows per tile, keys per step, warps) of the tiled prefill kernel tried by --tile-sweep
TILE_SHAPES = [(32, 64, 4), (64, 32, 4), (64, 64, 8), (128, 32, 4), (128, 32, 8), (128, 64, 8)]


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: our kernel against a baseline doing the same job."""

    op: str
    ms: float
    gbps: float  # bytes moved (read + written) per second; attention: cached K/V read once
    baseline: str
    baseline_ms: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--chunk", type=int, default=128,
                        help="new tokens per sequence in the prefill-chunk attention case")
    parser.add_argument("--num-layers", type=int, default=8, help="layers of the copy_blocks pool")
    parser.add_argument("--num-copies", type=int, default=256, help="block pairs to copy")
    parser.add_argument("--skip-int64", action="store_true",
                        help="skip the check on a pool past 2**31 elements (needs ~9 GiB)")
    parser.add_argument("--long-seqs", type=int, default=4,
                        help="sequences of the split-key (flash-decoding) decode case")
    parser.add_argument("--long-len", type=int, default=32768,
                        help="tokens of each sequence of the split-key decode case")
    parser.add_argument("--tile-sweep", action="store_true",
                        help="also time the tiled prefill kernel at each of TILE_SHAPES")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, metavar="PATH",
                        help="also write the table, with date, GPU and versions, to PATH")
    args = parser.parse_args(argv)
    if not 1 <= args.chunk <= args.min_len <= args.max_len:
        parser.error("expected 1 <= --chunk <= --min-len <= --max-len")
    return args


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` (warmed up, L2 flushed between runs by do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_ms(num_bytes: int, dtype: torch.dtype) -> float:
    """Milliseconds of ``dst.copy_(src)`` moving `num_bytes` (half read, half written)."""
    numel = max(1, num_bytes // 2 // dtype.itemsize)
    return bench(copy_baseline(numel, dtype, DEVICE, copies=1))


def make_batch(args: argparse.Namespace, dtype: torch.dtype) -> PagedSetup:
    """The kernel workload's pages at this script's shape: random lengths in
    [min_len, max_len], blocks scattered over the pool; ``slots`` every token's slot."""
    batch = PagedSetup(args.num_seqs, args.max_len, dtype, DEVICE, args.seed,
                       min_len=args.min_len, block_size=args.block_size,
                       num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    batch.slots = batch.slot_mapping()
    return batch


def row_bytes(args: argparse.Namespace, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) in the pool."""
    return args.num_kv_heads * args.head_dim * dtype.itemsize


def require(name: str, is_ok: bool, failures: list[str]) -> None:
    print(f"  check {name}: {'ok' if is_ok else 'MISMATCH'}")
    if not is_ok:
        failures.append(name)


def write_row(args: argparse.Namespace, batch: PagedSetup, dtype: torch.dtype,
              failures: list[str]) -> Row:
    """write_kv of every token of the batch (a prefill), plus CUDA-graph padding slots."""
    padding = torch.full((16,), -1, dtype=torch.int64, device=DEVICE)
    slots = torch.cat([batch.slots, padding])
    key, value = (torch.randn(slots.shape[0], args.num_kv_heads, args.head_dim,
                              device=DEVICE).to(dtype) for _ in range(2))
    want = (batch.key_cache.clone(), batch.value_cache.clone())
    write_kv_reference(key, value, *want, slots)
    got = (batch.key_cache.clone(), batch.value_cache.clone())
    write_kv_triton(key, value, *got, slots)
    require("write_kv", all(map(torch.equal, got, want)), failures)
    total = batch.slots.shape[0]
    moved = 2 * 2 * total * row_bytes(args, dtype)  # K and V, read and written
    ms = bench(lambda: write_kv_triton(key, value, *got, slots))
    return Row(f"write_kv ({total} tokens)", ms, moved / ms / 1e6, "copy_ same bytes",
               copy_ms(moved, dtype))


def gather_rows(args: argparse.Namespace, batch: PagedSetup, dtype: torch.dtype,
                failures: list[str]) -> list[Row]:
    """gather_kv padded to the longest sequence, and packed."""
    caches = (batch.key_cache, batch.value_cache)
    tables = (batch.block_tables, batch.seq_lens)
    total = batch.slots.shape[0]
    padded = gather_kv_triton(*caches, *tables)
    want = gather_kv_reference(*caches, *tables)
    require("gather_kv padded", all(map(torch.equal, padded, want)), failures)
    moved = 2 * (total + padded[0].shape[0] * padded[0].shape[1]) * row_bytes(args, dtype)
    ms = bench(lambda: gather_kv_triton(*caches, *tables, out=padded))
    rows = [Row(f"gather_kv padded [{args.num_seqs}, {padded[0].shape[1]}]", ms,
                moved / ms / 1e6, "copy_ same bytes", copy_ms(moved, dtype))]
    packed = gather_kv_packed_triton(*caches, *tables, batch.cu_seqlens)
    want = gather_kv_packed_reference(*caches, *tables, batch.cu_seqlens)
    require("gather_kv_packed", all(map(torch.equal, packed, want)), failures)
    moved = 2 * 2 * total * row_bytes(args, dtype)
    ms = bench(lambda: gather_kv_packed_triton(*caches, *tables, batch.cu_seqlens, out=packed))
    rows.append(Row(f"gather_kv_packed [{total}]", ms, moved / ms / 1e6, "copy_ same bytes",
                    copy_ms(moved, dtype)))
    return rows


def copy_row(args: argparse.Namespace, dtype: torch.dtype, failures: list[str]) -> Row:
    """copy_blocks of `num_copies` random block pairs in a `num_layers` pool."""
    num_blocks = 4 * args.num_copies
    pool = torch.randn(args.num_layers, 2, num_blocks, args.block_size, args.num_kv_heads,
                       args.head_dim, device=DEVICE).to(dtype)
    src, dst = torch.randperm(num_blocks, device=DEVICE)[: 2 * args.num_copies].chunk(2)
    want = pool.clone()
    copy_blocks_reference(want, src, dst)
    copy_blocks_triton(pool, src, dst)
    require("copy_blocks", torch.equal(pool, want), failures)
    moved = 2 * args.num_copies * args.num_layers * 2 * args.block_size * row_bytes(args, dtype)
    ms = bench(lambda: copy_blocks_triton(pool, src, dst))
    return Row(f"copy_blocks ({args.num_copies} blocks x {args.num_layers} layers)", ms,
               moved / ms / 1e6, "copy_ same bytes", copy_ms(moved, dtype))


def sdpa_padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                num_new: int) -> Callable[[], torch.Tensor]:
    """SDPA on contiguous ``[B, H, T, D]`` K/V (no per-sequence lengths: padded to the longest).

    Bottom-right causal over the last `num_new` positions; grouped-query heads natively when
    this torch's SDPA backends accept it, else with K/V repeated outside the timed call.
    """
    mask = None
    if num_new > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(num_new, key.shape[2])
    try:
        F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    except (RuntimeError, TypeError, ValueError):
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    return lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                  enable_gqa=True)


def attention_rows(args: argparse.Namespace, batch: PagedSetup, dtype: torch.dtype,
                   failures: list[str]) -> list[Row]:
    """Paged attention, decode and a prefill chunk: vs SDPA on contiguous K/V, vs gather + SDPA."""
    caches = (batch.key_cache, batch.value_cache)
    kv_bytes = 2 * batch.slots.shape[0] * row_bytes(args, dtype)  # cached K/V, read once
    padded_k, padded_v = (t.transpose(1, 2).contiguous()  # [B, Hkv, T, D]
                          for t in gather_kv_triton(*caches, batch.block_tables, batch.seq_lens))
    rows = []
    for name, num_new in (("decode", 1), (f"prefill chunk of {args.chunk}", args.chunk)):
        query_start_loc = torch.arange(0, (args.num_seqs + 1) * num_new, num_new,
                                       dtype=torch.int32, device=DEVICE)
        query = torch.randn(args.num_seqs * num_new, args.num_q_heads, args.head_dim,
                            device=DEVICE).to(dtype)
        inputs = (query, *caches, batch.block_tables, batch.seq_lens, query_start_loc)
        got = paged_attention_triton(*inputs)
        want = paged_attention_reference(*inputs)
        tolerance = TOLERANCES[dtype]
        require(f"paged_attention {name}",
                torch.allclose(got, want, atol=tolerance, rtol=tolerance), failures)
        del want
        padded_q = query.view(args.num_seqs, num_new, args.num_q_heads,
                              args.head_dim).transpose(1, 2)  # [B, Hq, num_new, D]
        sdpa = sdpa_padded(padded_q, padded_k, padded_v, num_new)
        ms = bench(lambda inputs=inputs, got=got: paged_attention_triton(*inputs, out=got))
        rows.append(Row(f"paged_attention {name}", ms, kv_bytes / ms / 1e6,
                        "SDPA, contiguous K/V padded to the longest", bench(sdpa)))
        padded = gather_kv_triton(*caches, batch.block_tables, batch.seq_lens)
        sdpa_on_gathered = sdpa_padded(padded_q, padded[0].transpose(1, 2),
                                       padded[1].transpose(1, 2), num_new)

        def gather_then_sdpa(sdpa=sdpa_on_gathered, padded=padded) -> torch.Tensor:
            gather_kv_triton(*caches, batch.block_tables, batch.seq_lens, out=padded)
            return sdpa()

        rows.append(Row(f"paged_attention {name}", ms, kv_bytes / ms / 1e6,
                        "gather_kv (Triton) + SDPA", bench(gather_then_sdpa)))
        if num_new > 1:
            rows += prefill_rows(args, batch, inputs, ms, kv_bytes, failures)
    return rows


@contextlib.contextmanager
def per_token_kernel() -> Iterator[None]:
    """`paged_attention_triton` with its prefill branch pointed back at the per-token kernel
    (a program per query token and KV head, as before `attention_prefill`), given the same
    arguments: the old kernel on the same batch, through the same launcher."""
    def launch(kernel_args: dict, query_start_loc: torch.Tensor, num_tokens: int,
               num_kv_heads: int, num_splits: int = 1) -> None:
        attention._paged_attention_kernel[(num_tokens, num_kv_heads)](**kernel_args)

    with mock.patch.object(attention_prefill, "launch_tiled", launch):
        yield


def flash_attn_varlen() -> Callable | None:
    """FlashAttention's ``flash_attn_varlen_func``, or None (with the reason printed) when
    ``flash_attn`` does not import here."""
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError, RuntimeError) as error:  # missing, or built for another torch
        print(f"  flash_attn varlen: skipped ({type(error).__name__}: {error})")
        return None
    return flash_attn_varlen_func


def prefill_rows(args: argparse.Namespace, batch: PagedSetup, inputs: tuple, tiled_ms: float,
                 kv_bytes: int, failures: list[str]) -> list[Row]:
    """The tiled prefill chunk against the per-token kernel, FlashAttention's varlen kernel
    on contiguous packed K/V (bottom-right causal, as ours), and at other tile shapes."""
    query, *caches = inputs[:3]
    query_start_loc = inputs[5]
    want = paged_attention_reference(*inputs)
    tolerance = TOLERANCES[query.dtype]
    op = f"paged_attention prefill chunk of {args.chunk} (tiled)"
    with per_token_kernel():
        old = paged_attention_triton(*inputs)
        require("paged_attention prefill, per-token kernel",
                torch.allclose(old, want, atol=tolerance, rtol=tolerance), failures)
        old_ms = bench(lambda: paged_attention_triton(*inputs, out=old))
    rows = [Row(op, tiled_ms, kv_bytes / tiled_ms / 1e6,
                "per-token kernel (K/V read once per query)", old_ms)]
    flash = flash_attn_varlen() if query.dtype != torch.float32 else None  # 16-bit only
    if flash is not None:
        key, value = gather_kv_packed_triton(*caches, batch.block_tables, batch.seq_lens,
                                             batch.cu_seqlens)  # [total, Hkv, D]
        max_len = int(batch.seq_lens.max())

        def run() -> torch.Tensor:
            return flash(query, key, value, query_start_loc, batch.cu_seqlens, args.chunk,
                         max_len, causal=True)

        agrees = torch.allclose(run(), want, atol=tolerance, rtol=tolerance)
        print(f"  flash_attn varlen against the reference: {'ok' if agrees else 'differs'}")
        rows.append(Row(op, tiled_ms, kv_bytes / tiled_ms / 1e6,
                        "FlashAttention varlen, contiguous packed K/V", bench(run)))
    if args.tile_sweep:
        rows += tile_sweep_rows(inputs, want, tiled_ms, kv_bytes, failures)
    return rows


def tile_sweep_rows(inputs: tuple, want: torch.Tensor, tiled_ms: float, kv_bytes: int,
                    failures: list[str]) -> list[Row]:
    """The tiled kernel at each of `TILE_SHAPES`, against it at the default shape."""
    rows, tolerance = [], TOLERANCES[want.dtype]
    default = (attention_prefill.ROWS_PER_TILE, attention_prefill.KEYS_PER_TILE,
               attention_prefill.NUM_WARPS)
    for num_rows, num_keys, num_warps in TILE_SHAPES:
        name = f"{num_rows} rows x {num_keys} keys, {num_warps} warps"
        with mock.patch.object(attention_prefill, "ROWS_PER_TILE", num_rows), \
                mock.patch.object(attention_prefill, "KEYS_PER_TILE", num_keys), \
                mock.patch.object(attention_prefill, "NUM_WARPS", num_warps):
            got = paged_attention_triton(*inputs)
            require(f"paged_attention prefill, tile {name}",
                    torch.allclose(got, want, atol=tolerance, rtol=tolerance), failures)
            ms = bench(lambda got=got: paged_attention_triton(*inputs, out=got))
        rows.append(Row(f"tiled prefill, {name}", ms, kv_bytes / ms / 1e6,
                        "tiled, {} rows x {} keys, {} warps".format(*default), tiled_ms))
    return rows


def split_decode_rows(args: argparse.Namespace, dtype: torch.dtype,
                      failures: list[str]) -> list[Row]:
    """Decode of `--long-seqs` sequences of `--long-len` tokens: too few (sequence, KV head)
    programs to fill the GPU, so the keys are split (`attention_prefill.decode_splits`);
    against the same batch unsplit (the per-token kernel) and SDPA on contiguous K/V."""
    batch = PagedSetup(args.long_seqs, args.long_len, dtype, DEVICE, args.seed,
                       min_len=args.long_len, block_size=args.block_size,
                       num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    caches = (batch.key_cache, batch.value_cache)
    query = torch.randn(args.long_seqs, args.num_q_heads, args.head_dim,
                        device=DEVICE).to(dtype)
    query_start_loc = torch.arange(args.long_seqs + 1, dtype=torch.int32, device=DEVICE)
    inputs = (query, *caches, batch.block_tables, batch.seq_lens, query_start_loc)
    num_splits = attention_prefill.decode_splits(
        args.long_seqs, args.long_seqs, args.num_kv_heads,
        batch.block_tables.shape[1] * args.block_size, query.device)
    print(f"  split decode: {args.long_seqs} x {args.long_len} tokens, {num_splits} splits")
    want, tolerance = paged_attention_reference(*inputs), TOLERANCES[dtype]
    got = paged_attention_triton(*inputs)
    require("paged_attention split decode",
            torch.allclose(got, want, atol=tolerance, rtol=tolerance), failures)
    ms = bench(lambda: paged_attention_triton(*inputs, out=got))
    with mock.patch.object(attention_prefill, "decode_splits", lambda *_: 1):
        unsplit_ms = bench(lambda: paged_attention_triton(*inputs, out=got))
    kv_bytes = 2 * args.long_seqs * args.long_len * row_bytes(args, dtype)
    padded_k, padded_v = (t.transpose(1, 2).contiguous()  # [B, Hkv, T, D]
                          for t in gather_kv_triton(*caches, batch.block_tables, batch.seq_lens))
    sdpa = sdpa_padded(query[:, :, None], padded_k, padded_v, 1)
    op = f"paged_attention decode, {args.long_seqs} x {args.long_len}, {num_splits} splits"
    return [Row(op, ms, kv_bytes / ms / 1e6, "unsplit (per-token kernel)", unsplit_ms),
            Row(op, ms, kv_bytes / ms / 1e6, "SDPA, contiguous K/V", bench(sdpa))]


def check_int64_offsets(args: argparse.Namespace, dtype: torch.dtype,
                        failures: list[str]) -> None:
    """Every kernel on a pool whose offsets pass 2**31 elements (int32 indexing would wrap)."""
    block_numel = args.block_size * args.num_kv_heads * args.head_dim
    num_blocks = INT32_LIMIT // block_numel + 8
    pool = torch.zeros(1, 2, num_blocks, args.block_size, args.num_kv_heads, args.head_dim,
                       dtype=dtype, device=DEVICE)
    key_cache, value_cache = pool[0, 0], pool[0, 1]
    high_blocks = torch.arange(num_blocks - 3, num_blocks, device=DEVICE)
    num_tokens = 3 * args.block_size
    slots = (high_blocks[:, None] * args.block_size
             + torch.arange(args.block_size, device=DEVICE)).flatten()
    key, value = (torch.randn(num_tokens, args.num_kv_heads, args.head_dim,
                              device=DEVICE).to(dtype) for _ in range(2))
    write_kv_triton(key, value, key_cache, value_cache, slots)
    block_tables = high_blocks.int()[None]
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE)
    k, v = gather_kv_triton(key_cache, value_cache, block_tables, seq_lens)
    require("int64 write + gather", torch.equal(k[0], key) and torch.equal(v[0], value), failures)
    copy_blocks_triton(pool, high_blocks[-1:], high_blocks[:1] - 2)
    require("int64 copy_blocks", torch.equal(pool[:, :, -3 - 2], pool[:, :, -1]), failures)
    query = torch.randn(1, args.num_q_heads, args.head_dim, device=DEVICE).to(dtype)
    inputs = (query, key_cache, value_cache, block_tables, seq_lens,
              torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    require("int64 paged_attention", torch.allclose(
        paged_attention_triton(*inputs), paged_attention_reference(*inputs),
        atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype]), failures)


def table(rows: list[Row]) -> str:
    lines = ["| op | ms | GB/s | baseline | baseline ms | speed vs baseline |",
             "|---|---:|---:|---|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.op} | {row.ms:.3f} | {row.gbps:,.0f} | {row.baseline} "
                     f"| {row.baseline_ms:.3f} | {row.baseline_ms / row.ms:.2f}x |")
    lines.append("\nGB/s: bytes read + written per second (attention: the cached K/V, read "
                 "once). Speed vs baseline: baseline ms / ms, above 1x means ours is faster.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this script needs a GPU "
              "(on CPU run tests/kernels/test_triton_kernels.py instead)", file=sys.stderr)
        return 2
    if triton is None:
        print("gpu_check: triton is not installed (pip install 'paged_kv[triton]')",
              file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    failures: list[str] = []
    batch = make_batch(args, dtype)
    print(f"{args.num_seqs} sequences, {batch.slots.shape[0]} tokens, "
          f"{args.num_kv_heads}x{args.head_dim} KV heads, {args.num_q_heads} query heads, "
          f"block {args.block_size}, {args.dtype}")
    rows = [write_row(args, batch, dtype, failures), *gather_rows(args, batch, dtype, failures),
            copy_row(args, dtype, failures), *attention_rows(args, batch, dtype, failures),
            *split_decode_rows(args, dtype, failures)]
    del batch
    torch.cuda.empty_cache()
    block_numel = args.block_size * args.num_kv_heads * args.head_dim
    int64_bytes = 2 * (INT32_LIMIT + 8 * block_numel) * dtype.itemsize
    if args.skip_int64 or torch.cuda.mem_get_info()[0] < int64_bytes + 2**30:
        print("  check int64 offsets: skipped")
    else:
        check_int64_offsets(args, dtype, failures)
    report = table(rows)
    print(report)
    if args.markdown is not None:
        header = (f"# paged_kv gpu_check\n\n{datetime.date.today().isoformat()}, "
                  f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                  f"triton {triton.__version__}; {args.num_seqs} sequences of "
                  f"{args.min_len}-{args.max_len} tokens, {args.num_kv_heads}x{args.head_dim} "
                  f"KV heads, {args.num_q_heads} query heads, block {args.block_size}, "
                  f"{args.dtype}.\nChecks: {'all ok' if not failures else ', '.join(failures)}."
                  "\n\n")
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(header + report + "\n")
    if failures:
        print(f"gpu_check: {len(failures)} kernel(s) disagree with the reference: "
              f"{', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
