"""Sizes of every workload for the quick and the full run."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Scale:
    """How big each workload is; `QUICK` fits in well under a minute on 2 cores."""

    name: str
    repeats: int                       # timed repeats of every figure
    trace_requests: int                # workloads 1 and 4
    decode_steps: int                  # timed decode steps with 256 sequences (workload 1)
    kernel_seqs: int                   # workload 2: sequences x tokens, 8 KV heads x 128
    kernel_tokens: int
    step_lengths: tuple[int, ...]      # workload 3
    step_layers: int
    step_kv_heads: int
    step_head_dim: int
    step_seqs: tuple[int, ...] = (256, 512, 1024)  # workload 3's second part: running
    step_seq_steps: int = 40           # sequences, and decode steps timed per repeat
    memory_block_sizes: tuple[int, ...] = (8, 16, 32, 64, 128)
    sharing_requests: int = 32         # prompts forked n ways (workload 4)
    serving_requests: int = 200        # workload 5
    serving_scale: int = 8             # trace lengths divided by this for serving
    serving_layers: int = 4
    serving_hidden: int = 256
    serving_repeats: int = 3
    peers_requests: int = 64           # workload 6: a Llama checkpoint through the peers
    peers_new_tokens: int = 64
    peers_hidden: int = 256
    peers_layers: int = 4
    peers_vocab: int = 4096
    peers_repeats: int = 3
    peers_defaults: bool = True        # also run generate_batch at its defaults
    hybrid_context: int = 8192         # hybrid: prompt tokens of the long sequences
    hybrid_window_divisor: int = 1     # hybrid: windows divided by this (shorter contexts
                                       # keep the full run's ratios)
    hybrid_generate_prompt: int = 1024  # hybrid: prompt tokens against transformers' generate
    hybrid_decode_steps: int = 16      # hybrid: decode steps per timed repeat


QUICK = Scale(name="quick", repeats=3, trace_requests=300, decode_steps=30, kernel_seqs=8,
              kernel_tokens=1024, step_lengths=(128, 512, 2048, 4096), step_layers=1,
              step_kv_heads=4, step_head_dim=128, sharing_requests=16, serving_requests=64,
              serving_scale=8, serving_layers=1, serving_hidden=128, serving_repeats=2,
              peers_requests=8, peers_new_tokens=8, peers_hidden=64, peers_layers=2,
              peers_vocab=512, peers_repeats=1, peers_defaults=False, hybrid_context=2048,
              hybrid_window_divisor=4, hybrid_generate_prompt=256, hybrid_decode_steps=8,
              step_seqs=(64, 128, 256), step_seq_steps=10)

FULL = Scale(name="full", repeats=5, trace_requests=2000, decode_steps=100, kernel_seqs=16,
             kernel_tokens=1024, step_lengths=(128, 256, 512, 1024, 2048, 4096), step_layers=2,
             step_kv_heads=8, step_head_dim=128)
