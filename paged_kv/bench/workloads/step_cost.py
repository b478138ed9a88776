"""``--workloads step_cost``: per-step cost against sequence length, the paged cache against the
seeds'; and one decode step's bookkeeping against the number of running sequences, for one
layer group and for three (`paged_kv.bench.workloads.step_scale`).

One decode step appends one token to each of 8 sequences and hands contiguous K/V on:

- paged: ``prepare`` + ``write`` + ``gather`` into buffers allocated once (and, as a fourth
  line, ``prepare`` + ``write`` alone: what a step costs when attention reads the pages);
- seed (a) `ListKVCache`: append a K and a V tensor per layer, stack the whole list;
- seed (b) `ContiguousKVCache`: re-copy the whole buffer to append, pad to a power of two.
"""

from __future__ import annotations

import torch

from ...config import CacheConfig
from ...core.cache import PagedKVCache
from ..baselines import ContiguousKVCache, ListKVCache
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat, time_interleaved
from . import step_scale

BATCH_SIZE, BLOCK_SIZE, RATIO_AT = 8, 16, 2048
NAMES = ("paged: prepare + write + gather", "paged in place: prepare + write",
         "seed (a): per-token list, stacked", "seed (b): contiguous re-copy, 2^k pad")

DESCRIPTION = (
    "Batch of {batch_size} sequences, {layers} layer(s), {heads} KV heads x {head_dim}, "
    "float16, one new token per sequence per step, K/V handed on contiguous every step by every "
    "cache except the in-place paged line. Steps are timed at lengths {lengths} (the timed "
    "steps end at that length, so seed (b)'s power-of-two bucket is no larger than it must "
    "be). The in-place line (prepare + write, no gather) is what a step costs the cache when "
    "attention reads the pages (paged_attention).")
SCALE_DESCRIPTION = (
    " Second part: one decode step's bookkeeping (scheduler, block manager, the step's input "
    "arrays; no model, no K/V) with {seqs} running sequences of the serving trace's prompts, "
    "for a uniform full-attention cache (1 group) and for full + sliding window ({window} "
    "tokens) + recurrent state layers (3 groups), each as the cache's array step "
    "(prepare_decode) and as the engine's scheduler step; median of {steps} steps a repeat. "
    "Its figures compare each size with half as many sequences (the growth per doubling; "
    "target <= 1.1x) and three groups with one.")
NOTE = ("The paged cache's gather still copies each sequence's history once per step (that is "
        "what handing on contiguous K/V means); the seeds copy it once (a) or twice plus a fresh "
        "zeroed buffer (b). Only the in-place line, where attention reads the pages, is "
        "independent of length.")


class PagedStepper:
    """A paged cache holding `BATCH_SIZE` sequences of `length` tokens, stepped one token."""

    def __init__(self, scale: Scale, length: int, max_len: int, prefill: torch.Tensor,
                 gather: bool) -> None:
        config = CacheConfig(num_layers=scale.step_layers, num_kv_heads=scale.step_kv_heads,
                             head_dim=scale.step_head_dim, block_size=BLOCK_SIZE,
                             num_blocks=BATCH_SIZE * -(-max_len // BLOCK_SIZE) + 1,
                             dtype=prefill.dtype)
        self.cache, self.gather, self.max_len = PagedKVCache(config), gather, max_len
        for seq_id in range(BATCH_SIZE):
            self.cache.add_sequence(seq_id)
        batch = self.cache.prepare(dict.fromkeys(range(BATCH_SIZE), length))
        flat = prefill[:, :length].reshape(-1, *prefill.shape[2:])  # [B * length, H, D]
        for layer in range(config.num_layers):
            self.cache.write(layer, flat, flat, batch)
        self.token = prefill[:, 0].contiguous()  # [B, H, D]
        self.out = tuple(prefill.new_empty(BATCH_SIZE, max_len, *prefill.shape[2:])
                         for _ in range(2)) if gather else None

    def step(self) -> None:
        batch = self.cache.prepare({seq_id: [7] for seq_id in range(BATCH_SIZE)})
        for layer in range(self.cache.config.num_layers):
            self.cache.write(layer, self.token, self.token, batch)
            if self.gather:
                self.cache.gather(layer, batch, pad_to=self.max_len, out=self.out)


class SeedStepper:
    """One of the seeds' caches holding `BATCH_SIZE` sequences of `length` tokens."""

    def __init__(self, cache: ListKVCache | ContiguousKVCache, num_layers: int, length: int,
                 prefill: torch.Tensor) -> None:
        self.cache, self.num_layers = cache, num_layers
        for layer in range(num_layers):
            cache.extend(layer, prefill[:, :length], prefill[:, :length])
        self.token = prefill[:, 0].contiguous()

    def step(self) -> None:
        for layer in range(self.num_layers):
            self.cache.append(layer, self.token, self.token)
            self.cache.kv(layer)


def measure_length(scale: Scale, length: int) -> list[Stat]:
    """Seconds per step of the four caches; the timed steps end at `length` tokens, so the
    power-of-two bucket of seed (b) is `length` itself when it is a power of two."""
    steps = scale.repeats + 1  # one warm-up step each
    start_len = max(length - steps, 1)
    prefill = torch.randn(BATCH_SIZE, start_len, scale.step_kv_heads,
                          scale.step_head_dim).half()
    steppers = [PagedStepper(scale, start_len, start_len + steps, prefill, gather=True),
                PagedStepper(scale, start_len, start_len + steps, prefill, gather=False),
                SeedStepper(ListKVCache(scale.step_layers), scale.step_layers, start_len,
                            prefill),
                SeedStepper(ContiguousKVCache(scale.step_layers), scale.step_layers,
                            start_len, prefill)]
    return time_interleaved([s.step for s in steppers], repeats=scale.repeats)


def run(scale: Scale) -> WorkloadResult:
    """Every length of ``scale.step_lengths``; ratios at 2048 tokens (or the nearest)."""
    by_length = {length: [s.scaled(1e3, "ms") for s in measure_length(scale, length)]
                 for length in scale.step_lengths}
    at = min(scale.step_lengths, key=lambda n: abs(n - RATIO_AT))
    paged, paged_in_place, listed, contiguous = by_length[at]
    figures = [Figure(f"step at {at} tokens, {NAMES[i]}", value, NAMES[j], base, False)
               for i, value in ((0, paged), (1, paged_in_place))
               for j, base in ((2, listed), (3, contiguous))]
    lengths = tuple(float(n) for n in scale.step_lengths)
    series = tuple(Series(name, lengths, tuple(by_length[n][i].median for n in by_length),
                          tuple(by_length[n][i].min for n in by_length),
                          tuple(by_length[n][i].max for n in by_length))
                   for i, name in enumerate(NAMES))
    scaled = step_scale.measure(scale.step_seqs, scale.step_seq_steps, scale.repeats)
    scale_figures, scale_info, scale_plot = step_scale.growth_rows(scaled)
    first, last = scale.step_lengths[0], scale.step_lengths[-1]
    growth = {f"{name}: step time at {last} over at {first} tokens":
              f"{by_length[last][i].median / by_length[first][i].median:.1f}x"
              for i, name in enumerate(NAMES)}
    return WorkloadResult(
        key="step_cost", title="3. Per-step cost against sequence length (the seeds' caches) "
        "and running sequences",
        description=DESCRIPTION.format(
            batch_size=BATCH_SIZE, layers=scale.step_layers, heads=scale.step_kv_heads,
            head_dim=scale.step_head_dim, lengths=", ".join(map(str, scale.step_lengths)))
        + SCALE_DESCRIPTION.format(seqs=", ".join(map(str, scale.step_seqs)),
                                   window=step_scale.WINDOW, steps=scale.step_seq_steps),
        figures=figures + scale_figures, info={**growth, **scale_info},
        plots=[Plot("time of one decode step", "sequence length (tokens)", "ms per step",
                    series, kind="line", logx=True, logy=True), scale_plot],
        notes=[NOTE])
