"""A synthetic multi-sequence workload that drives the cache alone (no model).

Sequences arrive over time with long-tailed prompt lengths (half share a system prompt),
prefill in chunks, decode one token per step, sometimes fork (parallel sampling) and finish.
K/V are random tensors written through the real kernels, so every byte path runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..bench.trace import LognormalLengths, PromptSource, PromptSpec, UniformLengths
from ..config import CacheConfig
from ..core.accounting import CacheStats
from ..core.cache import PagedKVCache
from ..errors import OutOfBlocksError

# prompts of 1 + lognormal(5, 0.8) tokens (median ~150, at most 2049) after the system
# prompt, when there is one; 8 to 95 generated tokens
PROMPT_LENGTHS = LognormalLengths(5.0, 0.8, low=0, high=2048, shift=1)
OUTPUT_LENGTHS = UniformLengths(8, 95)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadReport:
    """What a synthetic run did, and the accounting at its busiest step."""

    num_steps: int
    num_sequences: int
    num_forks: int
    num_tokens_written: int
    num_out_of_blocks: int
    peak: CacheStats
    final: CacheStats


def run_synthetic(config: CacheConfig, *, num_sequences: int = 48, seed: int = 0,
                  chunk_size: int = 256, max_running: int = 32) -> WorkloadReport:
    """Drive a `PagedKVCache` through a seeded serving-like workload.

    Parameters
    ----------
    config : CacheConfig
    num_sequences : int
        Requests to serve in all.
    chunk_size : int
        Prefill tokens per sequence per step.
    max_running : int
        Sequences in the cache at once.
    """
    rng = np.random.default_rng(seed)
    cache = PagedKVCache(config)
    waiting = _requests(rng, num_sequences, config.block_size)
    pending: dict[str, list[int]] = {}
    remaining: dict[str, int] = {}
    steps = forks = tokens = out_of_blocks = 0
    peak = cache.stats()
    while waiting or pending:
        while waiting and len(pending) < max_running:
            seq_id, prompt, output_len = waiting.pop(0)
            hit = cache.add_sequence(seq_id, prompt)
            pending[seq_id], remaining[seq_id] = prompt[hit:], output_len
        request = {s: (p[:chunk_size] if p else [int(rng.integers(0, 32000))])
                   for s, p in pending.items()}
        try:
            batch = cache.prepare(request)
        except OutOfBlocksError:
            out_of_blocks += 1
            victim = next(reversed(pending))  # preempt the newest: recompute it later
            cache.free(victim)
            pending.pop(victim)
            waiting.insert(0, (victim, rng.integers(0, 32000, 8).tolist(), remaining.pop(victim)))
            continue
        _write_all_layers(cache, batch)
        steps, tokens = steps + 1, tokens + batch.num_tokens
        forks += _advance(cache, request, pending, remaining, rng, max_running)
        stats = cache.stats()
        if stats.num_live_blocks > peak.num_live_blocks:
            peak = stats
    cache.check()
    return WorkloadReport(steps, num_sequences, forks, tokens, out_of_blocks, peak, cache.stats())


def _requests(rng: np.random.Generator, num_sequences: int, block_size: int,
              ) -> list[tuple[str, list[int], int]]:
    """``(seq_id, prompt, output length)``: long-tailed prompts, every other one behind a
    shared system prompt."""
    prompts = PromptSource(PromptSpec(PROMPT_LENGTHS, system_prompt_len=4 * block_size + 3,
                                      shared_fraction=0.5), rng)
    return [(f"req{i}", prompts.draw()[0], OUTPUT_LENGTHS.draw(rng))
            for i in range(num_sequences)]


def _advance(cache: PagedKVCache, request: dict[str, list[int]],
             pending: dict[str, list[int]], remaining: dict[str, int],
             rng: np.random.Generator, max_running: int) -> int:
    """After a step: consume prefill, count down outputs, free the finished, sometimes fork
    one near its end; returns the forks made."""
    forks = 0
    for seq_id, new in request.items():
        if pending[seq_id]:
            pending[seq_id] = pending[seq_id][len(new):]
            continue
        remaining[seq_id] -= 1
        if remaining[seq_id] == 0:
            cache.free(seq_id)
            del pending[seq_id], remaining[seq_id]
        elif remaining[seq_id] == 4 and rng.random() < 0.25 and len(pending) < max_running:
            child = f"{seq_id}.fork"
            cache.fork(seq_id, child)
            pending[child], remaining[child] = [], 4
            forks += 1
    return forks


def _write_all_layers(cache: PagedKVCache, batch) -> None:
    config = cache.config
    shape = (batch.num_tokens, config.num_kv_heads, config.head_dim)
    for layer in range(config.num_layers):
        key = torch.randn(shape, dtype=config.dtype, device=config.device)
        cache.write(layer, key, key, batch)
