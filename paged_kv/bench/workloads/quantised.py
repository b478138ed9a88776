"""``--workloads quantised``: 8-bit KV pages (int8, fp8) against float16 pages in the same memory.

Capacity comes from `CacheConfig.for_memory` (scales included); serving runs the engine with
as many blocks as each format fits in one byte budget; bandwidth counts the bytes each op
moves (read + written) against ``dst.copy_(src)`` moving as many; accuracy compares paged
attention on 8-bit pages with SDPA on the original float32 K/V, and greedy tokens with a
float32 cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ... import CacheConfig, PagedKVCache
from ...kernels import gather_kv, write_kv
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, time_interleaved
from ..trace import TraceRequest
from .kernels import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, PagedSetup
from .quantised4 import NOTES as NOTES4
from .quantised4 import four_bit_figures
from .serving import ServingRun, serve_config, served_model, stat_of

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
SERVED = ("int8", "fp8_e4m3")  # e5m2 serves like e4m3 (same bytes); its accuracy is below
FP16 = "float16 pages"
COPY = "dst.copy_(src) moving the same bytes"
CAPACITY_BUDGET = 1 << 30
LLAMA_7B = dict(num_layers=32, num_kv_heads=32, head_dim=128)
AGREEMENT_PREFIX = 8
# the serving budget in longest requests of float16 pages: tight, so that memory (not the
# token budget or the queue) limits how many requests run at once
SLABS = 2
DESCRIPTION = (
    "8-bit pages store one code per element and one bfloat16 scale per (token, layer, K/V, "
    "KV head). Capacity: blocks CacheConfig.for_memory fits in {capacity_gib} GiB, scales "
    "included, for the serving model's shape (head_dim {head_dim}) and Llama-2-7B's (head_dim "
    "128). Serving: paged_kv.engine.Engine with TinyLlama ({layers} layers, {kv_heads} KV "
    "heads x {head_dim}, float32 math) on the trace's first {num_requests} requests, lengths "
    "divided by {factor}, greedy, all queued at once, block size 16, in a KV budget of "
    "{slabs} longest requests in float16 ({budget_mib:.2f} MiB); each format gets the blocks "
    "it fits in that budget. The float16 baseline runs float32 pages with the block count "
    "float16 pages would fit (the model computes in float32), so capacity and concurrency are "
    "float16's. Bandwidth (on {device}; Triton on CUDA, the torch path on CPU): write_kv "
    "and gather_kv of {kernel_seqs} ragged sequences of up to {kernel_tokens} tokens, "
    "{kv_heads_k} KV heads x {head_dim_k}, "
    "float16 in and out; bytes moved = read + written (codes, scales, float16), the baseline "
    "copy_ moves as many. Accuracy: decode and prefill attention over the same random K/V "
    "against SDPA on the float32 originals (relative Frobenius error), and the fraction of "
    "greedy tokens equal to those of the float32 cache in the serving run.")


def capacity_figures(model_shape: dict) -> tuple[list[Figure], dict]:
    """Tokens in `CAPACITY_BUDGET` per format against float16 pages, for two model shapes."""
    figures, info = [], {}
    for label, shape in (("serving model", model_shape), ("Llama-2-7B shape", LLAMA_7B)):
        fp16 = CacheConfig.for_memory(CAPACITY_BUDGET, dtype=torch.float16, **shape)
        base = Stat((fp16.num_usable_blocks * fp16.block_size,), "tokens")
        for kv_cache_dtype in FORMATS:
            config = CacheConfig.for_memory(CAPACITY_BUDGET, dtype=torch.float16,
                                            kv_cache_dtype=kv_cache_dtype, **shape)
            tokens = Stat((config.num_usable_blocks * config.block_size,), "tokens")
            name = f"tokens in 1 GiB, {kv_cache_dtype} pages ({label}, head_dim " \
                   f"{shape['head_dim']})"
            figures.append(Figure(name, tokens, FP16, base, higher_is_better=True))
            info[f"bytes per token, {kv_cache_dtype}, {label}"] = config.bytes_per_token
        info[f"bytes per token, float16, {label}"] = fp16.bytes_per_token
    return figures, info


def serve(model, requests: Sequence[TraceRequest], num_blocks: int,
          kv_cache_dtype: str) -> tuple[ServingRun, list[list[int]]]:
    """Serve `requests` greedily on a fresh engine; the run and each request's tokens."""
    config = model.cache_config(num_blocks=num_blocks, block_size=16,
                                kv_cache_dtype=kv_cache_dtype)
    run, outputs = serve_config(model, config, requests)
    return run, [out.outputs[0].token_ids for out in outputs]


def serving_figures(scale: Scale, trace: Sequence[TraceRequest],
                    ) -> tuple[list[Figure], dict, dict[str, list[ServingRun]]]:
    """Concurrency, throughput and greedy agreement per served format against float16;
    also the facts and every run."""
    model, requests, max_len = served_model(scale, trace, num_heads=4, num_kv_heads=2,
                                            head_dim=64)
    probe = {k: model.cache_config(num_blocks=2, kv_cache_dtype=k) for k in SERVED}
    fp16_probe = model.cache_config(num_blocks=2, dtype=torch.float16)
    budget = SLABS * max_len * fp16_probe.bytes_per_token
    blocks = {FP16: budget // fp16_probe.bytes_per_block}
    blocks.update({k: budget // p.bytes_per_block for k, p in probe.items()})
    serve(model, requests[:2], blocks[FP16], "auto")  # warm-up
    runs: dict[str, list[ServingRun]] = {name: [] for name in blocks}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(max(1, scale.serving_repeats - 1)):
        for name in blocks:
            kv_cache_dtype = "auto" if name == FP16 else name
            run, tokens[name] = serve(model, requests, blocks[name], kv_cache_dtype)
            runs[name].append(run)
    info = {"served requests": len(requests), "longest request": max_len,
            "KV budget (MiB)": round(budget / 2**20, 3)}
    figures, per_format = _format_figures(runs, tokens, blocks)
    info.update(per_format)
    return figures, info, runs


def _format_figures(runs: dict[str, list[ServingRun]], tokens: dict[str, list[list[int]]],
                    blocks: dict[str, int]) -> tuple[list[Figure], dict]:
    """Each served format against float16: concurrency, throughput, greedy agreement."""
    figures, info = [], {}
    for name in SERVED:
        for what, metric, unit in (
                ("requests running at once, max", lambda r: max(r.running), "seqs"),
                ("requests running at once, mean", lambda r: statistics.fmean(r.running),
                 "seqs"),
                ("throughput, generated tokens", lambda r: r.throughput, "tokens/s")):
            figures.append(Figure(f"{what}, {name} pages", stat_of(runs[name], metric, unit),
                                  FP16, stat_of(runs[FP16], metric, unit), True))
        same, prefix = _agreement(tokens[FP16], tokens[name])
        figures.append(Figure(f"greedy tokens equal to the float32 cache's, {name}",
                              Stat((same,), "fraction"), "float32 cache", Stat((1.0,),
                                                                               "fraction"),
                              True))
        info[f"{name}: requests whose first {AGREEMENT_PREFIX} tokens match"] = f"{prefix:.1%}"
        info[f"{name}: blocks in the budget"] = blocks[name]
        info[f"{name}: preemptions"] = runs[name][-1].num_preemptions
    info[f"{FP16}: blocks in the budget"] = blocks[FP16]
    info[f"{FP16}: preemptions"] = runs[FP16][-1].num_preemptions
    return figures, info


def _agreement(want: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """Fraction of tokens equal position by position, and of requests whose first
    `AGREEMENT_PREFIX` tokens all match."""
    same = sum(a == b for w, g in zip(want, got, strict=True)
               for a, b in zip(w, g, strict=False))
    prefix = sum(w[:AGREEMENT_PREFIX] == g[:AGREEMENT_PREFIX]
                 for w, g in zip(want, got, strict=True))
    return same / sum(map(len, want)), prefix / len(want)


def bandwidth_figures(scale: Scale, device: torch.device) -> list[Figure]:
    """write_kv and gather_kv on float16 and 8-bit pages, GB/s of bytes moved vs copy_."""
    setup = PagedSetup(scale.kernel_seqs, scale.kernel_tokens, torch.float16, device)
    slots = setup.slot_mapping()
    new = torch.randn(setup.num_tokens, NUM_KV_HEADS, HEAD_DIM).to(torch.float16).to(device)
    out = tuple(torch.empty(setup.seq_lens.shape[0], setup.max_len, NUM_KV_HEADS, HEAD_DIM,
                            dtype=torch.float16, device=device) for _ in range(2))
    figures = []
    for kv_cache_dtype in ("auto", *SERVED):
        if kv_cache_dtype == "auto":
            pages, scales, kw = (setup.key_cache, setup.value_cache), (None, None), {}
        else:
            dtype = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=1,
                                kv_cache_dtype=kv_cache_dtype).cache_dtype
            pages = tuple(torch.zeros(setup.key_cache.shape, dtype=dtype, device=device)
                          for _ in range(2))
            scales = tuple(torch.zeros(setup.key_cache.shape[:3], dtype=torch.bfloat16,
                                       device=device) for _ in range(2))
            kw = dict(key_scales=scales[0], value_scales=scales[1])
        write_kv(new, new, *pages, slots, *scales)
        stored = pages[0].element_size() * HEAD_DIM + (0 if scales[0] is None else 2)
        per_token = 2 * NUM_KV_HEADS  # K and V heads
        written = setup.num_tokens * per_token * stored
        moved = {"write_kv": new.nbytes * 2 + written,
                 "gather_kv": written + out[0].nbytes * 2}
        ops = {"write_kv": lambda p=pages, s=scales: write_kv(new, new, *p, slots, *s),
               "gather_kv": lambda p=pages, k=kw: gather_kv(
                   *p, setup.block_tables, setup.seq_lens, setup.max_len, out, **k)}
        label = FP16 if kv_cache_dtype == "auto" else f"{kv_cache_dtype} pages"
        for op_name, op in ops.items():
            nbytes = moved[op_name]
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).fill_(1)
            dst = torch.empty_like(src)
            paged, copied = time_interleaved([op, lambda d=dst, s=src: d.copy_(s)],
                                             repeats=scale.repeats, device=device)
            figures.append(Figure(f"{op_name}, {label}, bytes moved",
                                  paged.inverse(nbytes / 1e9, "GB/s"), COPY,
                                  copied.inverse(nbytes / 1e9, "GB/s"), True))
    return figures


def attention_errors(seed: int = 0) -> dict[str, float]:
    """Relative error of paged attention (decode and a prefill chunk) per page format against
    SDPA on the float32 K/V, over randn data: 4 sequences of 100-300 tokens."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens, query_lens, num_q_heads = [100, 181, 240, 300], [1, 1, 16, 1], 16
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator) for n in seq_lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator) for n in seq_lens]
    query = torch.randn(sum(query_lens), num_q_heads, HEAD_DIM, generator=generator)
    want = []
    start = 0
    for k, v, q in zip(keys, values, query_lens, strict=True):
        n = k.shape[0]
        mask = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
        want.append(F.scaled_dot_product_attention(
            query[start:start + q].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, enable_gqa=True).transpose(0, 1))
        start += q
    want = torch.cat(want)
    errors = {}
    for kv_cache_dtype in ("auto", *FORMATS):
        dtype = torch.float16 if kv_cache_dtype == "auto" else torch.float32
        cache = PagedKVCache(CacheConfig(num_layers=1, num_kv_heads=NUM_KV_HEADS,
                                         head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                                         num_blocks=64, dtype=dtype,
                                         kv_cache_dtype=kv_cache_dtype))
        for i in range(len(seq_lens)):
            cache.add_sequence(i)
        batch = cache.prepare({i: n - q for i, (n, q) in enumerate(zip(seq_lens, query_lens,
                                                                         strict=True))})
        cache.write(0, *(torch.cat([x[:n - q] for x, n, q in zip(t, seq_lens, query_lens,
                                                                  strict=True)]).to(dtype)
                         for t in (keys, values)), batch)
        batch = cache.prepare(dict(enumerate(query_lens)))
        cache.write(0, *(torch.cat([x[n - q:] for x, n, q in zip(t, seq_lens, query_lens,
                                                                  strict=True)]).to(dtype)
                         for t in (keys, values)), batch)
        got = cache.attention(0, query.to(dtype), batch).float()
        errors[FP16 if kv_cache_dtype == "auto" else kv_cache_dtype] = float(
            (got - want).norm() / want.norm())
    return errors


def _plots(figures: list[Figure], runs: dict[str, list[ServingRun]]) -> list[Plot]:
    """Tokens in 1 GiB per format, requests running per step, serving throughput."""
    labels = (FP16, *SERVED)
    return [
        Plot("tokens in 1 GiB (serving model shape)", "", "tokens",
             (Series("tokens", (FP16, *FORMATS),
                     (figures[0].baseline.median, *(f.value.median for f in figures[:3]))),),
             kind="bar"),
        Plot("requests running at each engine step (last repeat)", "engine step",
             "requests running", tuple(Series(name, tuple(range(len(runs[name][-1].running))),
                                              runs[name][-1].running) for name in labels)),
        Plot("serving throughput", "", "generated tokens/s",
             (Series("throughput", labels, tuple(statistics.median(r.throughput
                                                                   for r in runs[name])
                                                 for name in labels)),), kind="bar"),
    ]


def run(scale: Scale, trace: Sequence[TraceRequest], device: torch.device) -> WorkloadResult:
    """Capacity, serving, bandwidth and accuracy of 8-bit pages against float16 pages."""
    model_shape = dict(num_layers=scale.serving_layers, num_kv_heads=2, head_dim=64)
    figures, info = capacity_figures(model_shape)
    served, serving_info, runs = serving_figures(scale, trace)
    figures += served
    info.update(serving_info)
    figures += bandwidth_figures(scale, device)
    errors = attention_errors()
    figures += [Figure(f"attention output relative error, {name} pages", Stat((error,),
                                                                             "fraction"),
                       FP16, Stat((errors[FP16],), "fraction"), higher_is_better=False)
                for name, error in errors.items() if name != FP16]
    info.update({f"attention relative error, {name}": f"{error:.2e}"
                 for name, error in errors.items()})
    plots = _plots(figures, runs)
    more, four_bit = four_bit_figures(scale)  # after _plots: it reads figures[:3]
    figures += more
    info = {**{k: v for k, v in four_bit.items() if k.startswith("target")}, **info,
            **{k: v for k, v in four_bit.items() if not k.startswith("target")}}
    return WorkloadResult(
        key="quantised", title="6. Quantised pages: int8, fp8 and 4-bit against float16",
        description=DESCRIPTION.format(
            capacity_gib=CAPACITY_BUDGET >> 30, head_dim=64, layers=scale.serving_layers,
            kv_heads=2, num_requests=info["served requests"], factor=scale.serving_scale,
            slabs=SLABS, budget_mib=info["KV budget (MiB)"], device=device,
            kernel_seqs=scale.kernel_seqs, kernel_tokens=scale.kernel_tokens,
            kv_heads_k=NUM_KV_HEADS, head_dim_k=HEAD_DIM),
        figures=figures, info=info, plots=plots,
        notes=["The embedded model has random weights, so many next-token logits are nearly "
               "tied; greedy agreement is a lower bound on what a trained model shows.",
               "On CPU the torch path quantises with several full passes over the data (amax, "
               "divide, round, cast), so 8-bit write runs well below copy speed; the Triton "
               "kernel does it in one pass.", *NOTES4])
