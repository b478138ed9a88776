"""``--workloads memory``: how much KV memory holds live tokens, and what sharing saves.

Replays the trace's schedule through the paged cache (bookkeeping only) and samples
`CacheStats` after every step; the baselines are computed from the very same sequence
lengths: contiguous max-length preallocation reserves the trace's longest request for every
sequence, power-of-two bucket padding the next power of two of its current length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..replay import replay
from ..results import Plot, Series, WorkloadResult
from ..scale import Scale
from ..timing import Figure, Stat
from ..trace import TraceRequest, output_token_id
from .allocator import bookkeeping_cache

BUDGET_TOKENS = 131072          # the "same budget" of the concurrency figures, in token slots
REFERENCE_BYTES_PER_TOKEN = 2 * 32 * 32 * 128 * 2  # Llama-2-7B, fp16: 512 KiB per token
CONTIGUOUS, BUCKET = "contiguous max-length preallocation", "power-of-two bucket padding"
DESCRIPTION = (
    "Fractions are time-averaged over the trace's steps: the sum over steps of live tokens "
    "over the sum of the slots each scheme holds (paged: allocated blocks x block size, prefix "
    "caching off so only block granularity counts; contiguous: the trace's longest request for "
    "every running sequence; bucket: the next power of two of each sequence's length). "
    "Sequences that fit: the budget over the time-averaged slots per running sequence. "
    "Sharing: KV bytes the cache holds against what unshared copies would take "
    "(CacheStats.bytes_saved_by_sharing), for {num_prompts} prompts forked into n samples after "
    "the prompt, and for the trace's shared system prompt with prefix caching on. Bytes are for "
    "a model of Llama-2-7B's size in float16 (512 KiB per token: the bookkeeping pool's bytes "
    "scaled up); the ratios do not depend on the model. The PagedAttention paper reports "
    "20-38% of KV memory holding real tokens in earlier systems and under 4% waste for paged.")


@dataclasses.dataclass
class Occupancy:
    """Sums over sampled steps: live tokens, slots each scheme holds, sequence-steps."""

    live_tokens: int = 0
    paged_slots: int = 0
    contiguous_slots: int = 0
    bucket_slots: int = 0
    seq_steps: int = 0
    live_bytes: int = 0
    saved_bytes: int = 0
    num_samples: int = 0

    def add_bytes(self, stats, bytes_per_token: int) -> None:
        """Add one sample of `CacheStats` bytes, scaled to the reference model's size."""
        scale = REFERENCE_BYTES_PER_TOKEN / bytes_per_token
        self.live_bytes += int(stats.live_bytes * scale)
        self.saved_bytes += int(stats.bytes_saved_by_sharing * scale)
        self.num_samples += 1

    @property
    def saved_fraction(self) -> float:
        return self.saved_bytes / (self.live_bytes + self.saved_bytes)

    @property
    def held_gib(self) -> float:
        """KV bytes held per sample, in GiB."""
        return self.live_bytes / max(self.num_samples, 1) / 2**30

    @property
    def unshared_gib(self) -> float:
        """What unshared copies would take per sample, in GiB."""
        return (self.live_bytes + self.saved_bytes) / max(self.num_samples, 1) / 2**30


def occupancy(trace: Sequence[TraceRequest], block_size: int, *,
              enable_prefix_caching: bool = False) -> Occupancy:
    """Replay `trace` at `block_size` and sum the occupancy of every step (time average)."""
    longest = max(r.total_len for r in trace)
    # room for 256 requests at the longest length: no block size changes the schedule
    num_blocks = 256 * -(-longest // block_size) + 1
    cache = bookkeeping_cache(num_blocks, block_size, enable_prefix_caching)
    total = Occupancy()

    def sample() -> None:
        stats, tables = cache.stats(), cache.tables
        lengths = tables.num_tokens[tables.rows()]
        total.live_tokens += stats.num_live_tokens
        total.paged_slots += stats.num_live_tokens + stats.num_empty_slots
        total.contiguous_slots += longest * len(lengths)
        total.bucket_slots += int((1 << np.ceil(np.log2(np.maximum(lengths, 1)))
                                   .astype(np.int64)).sum())
        total.seq_steps += len(lengths)
        total.add_bytes(stats, cache.config.bytes_per_token)

    replay(trace, cache, capacity_blocks=10**12, block_size=block_size, on_step=sample)
    return total


def parallel_sampling(trace: Sequence[TraceRequest], n: int, num_requests: int) -> Occupancy:
    """Prefill `num_requests` prompts, fork each into `n` samples after its prompt (as the
    engine does), decode every sample to its output length; sums over decode steps."""
    requests = trace[:num_requests]
    tokens = sum(len(r.prompt_token_ids) + n * r.output_len for r in requests)
    cache = bookkeeping_cache(num_blocks=tokens // 8 + n * num_requests + 2)
    for r in requests:
        cache.add_sequence((r.request_id, 0), r.prompt_token_ids)
    cache.prepare({(r.request_id, 0): r.prompt_token_ids for r in requests})
    for r in requests:
        for i in range(1, n):
            cache.fork((r.request_id, 0), (r.request_id, i))
    total = Occupancy()
    for step in range(max(r.output_len for r in requests)):
        live = [(r.request_id, i) for r in requests if step < r.output_len for i in range(n)]
        cache.prepare({s: [output_token_id(s[0] * 8 + s[1], step)] for s in live})
        total.add_bytes(cache.stats(), cache.config.bytes_per_token)
        for r in requests:
            if step + 1 == r.output_len:
                for i in range(n):
                    cache.free((r.request_id, i))
    return total


def _fraction(value: float) -> Stat:
    return Stat((value,), "fraction")


def run(scale: Scale, trace: Sequence[TraceRequest]) -> WorkloadResult:
    """Block-size sweep, concurrency in one budget, parallel sampling and system prompt."""
    sweep = {b: occupancy(trace, b) for b in scale.memory_block_sizes}
    ref = sweep[16] if 16 in sweep else next(iter(sweep.values()))
    contiguous = _fraction(ref.live_tokens / ref.contiguous_slots)
    bucket = _fraction(ref.live_tokens / ref.bucket_slots)
    figures = []
    for block_size, occ in sweep.items():
        paged = _fraction(occ.live_tokens / occ.paged_slots)
        name = f"live-token fraction of KV memory, paged, block size {block_size}"
        figures += [Figure(name, paged, CONTIGUOUS, contiguous, higher_is_better=True),
                    Figure(name, paged, BUCKET, bucket, higher_is_better=True)]
    fits = {name: Stat((BUDGET_TOKENS * ref.seq_steps // slots,), "sequences")
            for name, slots in (("paged", ref.paged_slots), (CONTIGUOUS, ref.contiguous_slots),
                                (BUCKET, ref.bucket_slots))}
    name = f"sequences fitting {BUDGET_TOKENS} token slots, paged, block size 16"
    figures += [Figure(name, fits["paged"], CONTIGUOUS, fits[CONTIGUOUS], True),
                Figure(name, fits["paged"], BUCKET, fits[BUCKET], True)]
    sharing = {f"parallel sampling n = {n}": parallel_sampling(trace, n, scale.sharing_requests)
               for n in (2, 4, 6)}
    sharing["shared system prompt (trace)"] = occupancy(
        trace, 16, enable_prefix_caching=True)
    figures += [Figure(f"{what}: KV bytes held, time-averaged", Stat((occ.held_gib,), "GiB"),
                       "unshared copies", Stat((occ.unshared_gib,), "GiB"),
                       higher_is_better=False) for what, occ in sharing.items()]
    return _result(scale, sweep, ref, figures, sharing)


def _result(scale: Scale, sweep: dict[int, Occupancy], ref: Occupancy,
            figures: list[Figure], sharing: dict[str, Occupancy]) -> WorkloadResult:
    sizes = tuple(float(b) for b in sweep)
    plot = Plot("fraction of KV memory holding live tokens (time-averaged)", "block size",
                "live tokens / reserved slots",
                (Series("paged", sizes, tuple(o.live_tokens / o.paged_slots
                                              for o in sweep.values())),
                 Series(CONTIGUOUS, sizes, (ref.live_tokens / ref.contiguous_slots,) * len(sizes)),
                 Series(BUCKET, sizes, (ref.live_tokens / ref.bucket_slots,) * len(sizes))),
                kind="line", logx=True)
    labels = tuple(what.replace("parallel sampling ", "") for what in sharing)
    bars = Plot("KV bytes held with sharing (time-averaged, Llama-2-7B-sized)", "", "GiB",
                (Series("shared (paged)", labels, tuple(o.held_gib for o in sharing.values())),
                 Series("unshared copies", labels,
                        tuple(o.unshared_gib for o in sharing.values()))), kind="bar")
    info = {f"{what}: saved by sharing": f"{occ.saved_fraction:.1%}"
            for what, occ in sharing.items()}
    info.update({f"waste, paged block size {b}": f"{1 - o.live_tokens / o.paged_slots:.2%}"
                 for b, o in sweep.items()})
    return WorkloadResult(
        key="memory", title="4. Memory: live tokens, concurrency, sharing",
        description=DESCRIPTION.format(num_prompts=scale.sharing_requests),
        figures=figures, info=info, plots=[plot, bars])
