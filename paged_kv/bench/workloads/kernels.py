"""``--workloads kernels``: the kernels' bandwidth against ``dst.copy_(src)`` of the same bytes, and
paged attention against gather + SDPA and SDPA on contiguous K/V.

Pages are handed out in a random order (as after a long run) and sequence lengths are
ragged; outputs are preallocated, so every op and its baseline write into memory that is
already mapped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...kernels import copy_blocks, gather_kv, gather_kv_packed, paged_attention, write_kv
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, time_interleaved

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_Q_HEADS = 16, 8, 128, 32
COPY = "dst.copy_(src), same bytes, preallocated dst"


class PagedSetup:
    """Pages holding `num_seqs` ragged sequences of up to `max_len` tokens, shuffled.

    Attributes: ``key_cache``/``value_cache`` ``[num_blocks, block_size, H, D]``,
    ``block_tables [B, max_len / block_size]`` int32, ``seq_lens [B]`` int32 (the first
    `max_len`, the others in ``[min_len, max_len]``, default ``min_len = max_len // 2``),
    ``cu_seqlens [B + 1]`` int32. The kernel workload's shape by default; `gpu_check` sets
    its own.
    """

    def __init__(self, num_seqs: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0, *, min_len: int | None = None,
                 block_size: int = BLOCK_SIZE, num_kv_heads: int = NUM_KV_HEADS,
                 head_dim: int = HEAD_DIM) -> None:
        generator = torch.Generator().manual_seed(seed)
        width = -(-max_len // block_size)
        num_blocks = num_seqs * width + 1
        order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0: null
        self.block_tables = order.view(num_seqs, width).to(torch.int32).to(device)
        low = max_len // 2 if min_len is None else min_len
        lens = torch.randint(low, max_len + 1, (num_seqs,), generator=generator)
        lens[0] = max_len
        self.seq_lens = lens.to(torch.int32).to(device)
        self.cu_seqlens = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
        torch.cumsum(self.seq_lens, 0, out=self.cu_seqlens[1:])
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
        self.value_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
        self.max_len, self.num_tokens = max_len, int(lens.sum())
        self.block_size = block_size

    def slot_mapping(self) -> torch.Tensor:
        """``[num_tokens]`` int64 slots of every token of every sequence, in order."""
        positions = torch.arange(self.max_len, device=self.block_tables.device)
        slots = (self.block_tables.long()[:, positions // self.block_size] * self.block_size
                 + positions % self.block_size)
        return slots[positions[None, :] < self.seq_lens[:, None]]


def copy_baseline(num_elements: int, dtype: torch.dtype, device: torch.device | str,
                  copies: int = 2) -> Callable[[], object]:
    """The roofline of a kernel moving K and V: ``dst.copy_(src)`` of `copies` random
    tensors of `num_elements` each (K and V: 2) into preallocated ones."""
    src = [torch.randn(num_elements).to(dtype).to(device) for _ in range(copies)]
    dst = [torch.empty_like(s) for s in src]
    return lambda: [d.copy_(s) for d, s in zip(dst, src, strict=True)]


def _bandwidth_figure(name: str, op, num_elements: int, setup: PagedSetup,
                      repeats: int, device: torch.device) -> Figure:
    """GB/s of `op` (moving K and V of `num_elements` each) against copy_ of those bytes."""
    nbytes = 2 * num_elements * setup.key_cache.element_size()
    baseline = copy_baseline(num_elements, setup.key_cache.dtype, device)
    paged, copied = time_interleaved([op, baseline], repeats=repeats, device=device)
    return Figure(name, paged.inverse(nbytes / 1e9, "GB/s"), COPY,
                  copied.inverse(nbytes / 1e9, "GB/s"), higher_is_better=True)


def bandwidth_figures(setup: PagedSetup, repeats: int, device: torch.device) -> list[Figure]:
    """write_kv, gather_kv (padded, packed) and copy_blocks (consecutive and scattered
    ids) against copy_."""
    s, per_token = setup, NUM_KV_HEADS * HEAD_DIM
    slots = s.slot_mapping()
    new = torch.randn(s.num_tokens, NUM_KV_HEADS, HEAD_DIM).to(s.key_cache.dtype).to(device)
    padded = tuple(s.key_cache.new_empty(s.seq_lens.shape[0], s.max_len, NUM_KV_HEADS,
                                         HEAD_DIM) for _ in range(2))
    packed = tuple(s.key_cache.new_empty(s.num_tokens, NUM_KV_HEADS, HEAD_DIM)
                   for _ in range(2))
    pool = torch.stack([s.key_cache, s.value_cache])[None]  # [1, 2, blocks, 16, 8, 128]
    half = (pool.shape[2] - 1) // 2
    src_ids = torch.arange(1, half + 1, device=device)
    dst_ids = torch.arange(half + 1, 2 * half + 1, device=device)
    # the same number of blocks at random places (fresh blocks are consecutive; blocks
    # freed and reused over a long run are not)
    order = torch.randperm(2 * half, generator=torch.Generator().manual_seed(1)) + 1
    scattered_src, scattered_dst = order[:half].to(device), order[half:].to(device)
    cases = [
        ("write_kv (every token's K/V into its slot)", s.num_tokens * per_token,
         lambda: write_kv(new, new, s.key_cache, s.value_cache, slots)),
        ("gather_kv padded [B, T, H, D]", padded[0].numel(),
         lambda: gather_kv(s.key_cache, s.value_cache, s.block_tables, s.seq_lens,
                           s.max_len, padded)),
        ("gather_kv_packed [total_tokens, H, D]", s.num_tokens * per_token,
         lambda: gather_kv_packed(s.key_cache, s.value_cache, s.block_tables, s.seq_lens,
                                  s.cu_seqlens, packed)),
        (f"copy_blocks ({half} blocks, K and V)", half * BLOCK_SIZE * per_token,
         lambda: copy_blocks(pool, src_ids, dst_ids)),
        (f"copy_blocks ({half} scattered blocks, K and V)", half * BLOCK_SIZE * per_token,
         lambda: copy_blocks(pool, scattered_src, scattered_dst)),
    ]
    return [_bandwidth_figure(name, op, n, s, repeats, device) for name, n, op in cases]


def attention_figures(setup: PagedSetup, repeats: int, device: torch.device) -> list[Figure]:
    """Decode attention (one query per sequence) read from pages, against gather + SDPA and
    SDPA over K/V already contiguous ``[B, H, T, D]``."""
    s, batch_size = setup, setup.seq_lens.shape[0]
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(batch_size, NUM_Q_HEADS, HEAD_DIM, generator=generator)
    query = query.to(s.key_cache.dtype).to(device)
    query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device=device)
    mask = (torch.arange(s.max_len, device=device)[None, :]
            < s.seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, T]
    out = tuple(s.key_cache.new_empty(batch_size, s.max_len, NUM_KV_HEADS, HEAD_DIM)
                for _ in range(2))
    contiguous = [t.transpose(1, 2).contiguous() for t in gather_kv(
        s.key_cache, s.value_cache, s.block_tables, s.seq_lens, s.max_len)]  # [B, H, T, D]

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(query[:, :, None], k, v, attn_mask=mask,
                                              enable_gqa=True)

    def gathered() -> torch.Tensor:
        k, v = gather_kv(s.key_cache, s.value_cache, s.block_tables, s.seq_lens, s.max_len,
                         out)
        return sdpa(k.transpose(1, 2), v.transpose(1, 2))

    # the reused scratch PagedKVCache passes to the torch path (the Triton path ignores it)
    workspace = s.key_cache.new_empty(2 * out[0].numel() + 2 * BLOCK_SIZE * batch_size
                                      * NUM_KV_HEADS * HEAD_DIM)
    paged, via_gather, direct = time_interleaved(
        [lambda: paged_attention(query, s.key_cache, s.value_cache, s.block_tables,
                                 s.seq_lens, query_start_loc, workspace=workspace),
         gathered, lambda: sdpa(*contiguous)], repeats=repeats, device=device)
    name = f"paged_attention, decode, {batch_size} seqs"
    return [Figure(name, paged.scaled(1e3, "ms"), "gather_kv + SDPA",
                   via_gather.scaled(1e3, "ms"), higher_is_better=False),
            Figure(name, paged.scaled(1e3, "ms"), "SDPA on contiguous K/V",
                   direct.scaled(1e3, "ms"), higher_is_better=False)]


def run(scale: Scale, device: torch.device) -> WorkloadResult:
    """Bandwidth in float16, attention in float16 on CUDA and float32 on CPU."""
    on_cpu = device.type == "cpu"
    attention_dtype = torch.float32 if on_cpu else torch.float16
    setup = PagedSetup(scale.kernel_seqs, scale.kernel_tokens, torch.float16, device)
    figures = bandwidth_figures(setup, scale.repeats, device)
    if on_cpu:
        setup = PagedSetup(scale.kernel_seqs, scale.kernel_tokens, attention_dtype, device)
    figures += attention_figures(setup, scale.repeats, device)
    return _result(figures, scale, device, attention_dtype)


def _result(figures: list[Figure], scale: Scale, device: torch.device,
            attention_dtype: torch.dtype) -> WorkloadResult:
    bandwidth = [f for f in figures if f.value.unit == "GB/s"]
    attention = [f for f in figures if f.value.unit != "GB/s"]
    names = tuple(f.name.split(" (")[0].split(" [")[0]
                  + (" packed" if "packed" in f.name else "")
                  + (" scattered" if "scattered" in f.name else "") for f in bandwidth)
    plots = [
        Plot("bandwidth against copy_ of the same bytes", "op", "GB/s",
             (_bars("paged kernel", names, [f.value for f in bandwidth]),
              _bars("dst.copy_(src)", names, [f.baseline for f in bandwidth])), kind="bar"),
        Plot("decode attention", "path", "ms",
             (_bars("time", ("paged_attention", "gather + SDPA", "SDPA contiguous"),
                    [attention[0].value, attention[0].baseline, attention[1].baseline]),),
             kind="bar")]
    backend = "Triton" if device.type == "cuda" else "torch reference (CPU path)"
    return WorkloadResult(
        key="kernels", title="2. Kernels: bandwidth and attention",
        description=(
            f"On {device} ({backend}): {scale.kernel_seqs} sequences of up to "
            f"{scale.kernel_tokens} tokens (ragged, at least half), {NUM_KV_HEADS} KV heads x "
            f"{HEAD_DIM}, block size {BLOCK_SIZE}, pages in random order. Bandwidth counts "
            "the bytes each op writes (K and V), in float16; the baseline copies the same "
            "bytes with dst.copy_(src) into a preallocated dst (the practical roofline), so "
            "the ratio is the fraction of copy bandwidth reached. Attention: one decode query "
            f"per sequence, {NUM_Q_HEADS} query heads (GQA), in {attention_dtype}."),
        figures=figures, plots=plots,
        info={"device": str(device), "backend": backend,
              "attention dtype": str(attention_dtype)},
        notes=["CPU float16 SDPA is several times slower than float32 in torch, so the "
               "attention figures use float32 on CPU."] if device.type == "cpu" else [])


def _bars(name: str, labels: tuple[str, ...], stats: list[Stat]) -> Series:
    return Series(name, labels, tuple(s.median for s in stats), tuple(s.min for s in stats),
                  tuple(s.max for s in stats))
