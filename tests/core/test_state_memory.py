"""Memory: how many 1,000-token sequences a pool of fixed bytes runs, a 3:1 recurrent:
attention layout against the all-attention layout of the same attention shape.

A live state costs its own bytes once, not K/V per token, so the hybrid layout runs more
sequences the smaller its state is beside the K/V it replaces. With LFM2's short
convolutions (a 3-token window of the hidden size) the state is a few tokens' worth of K/V
and the 3:1 layout runs >= 3x the sequences (admitted for real, until the pool is out).
With Qwen3-Next's gated delta nets (a 2 MiB float32 state a layer) one state is the K/V of
~1,100 tokens of one layer, so at 1,000 tokens the two layouts run about as many, and the
hybrid's advantage grows with the length (>= 2.8x at 8K, >= 3x past that).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from paged_kv import CacheConfig, PagedKVCache
from paged_kv.config import LayerKind, StateSpec
from paged_kv.errors import OutOfBlocksError

BS, TOKENS = 16, 1000


def _layout(kinds: tuple[LayerKind, ...], heads: int, head_dim: int, dtype: torch.dtype,
            budget: int, max_seqs: int = 64) -> CacheConfig:
    """The config of `kinds` whose blocks and state slots fill `budget` bytes: a slot per
    sequence that could run (a state, when there is one), the rest in blocks."""
    probe = CacheConfig(num_layers=len(kinds), num_kv_heads=heads, head_dim=head_dim,
                        block_size=BS, num_blocks=2, dtype=dtype, layer_kinds=kinds,
                        num_state_slots=1 if any(k.is_recurrent for k in kinds) else 0)
    per_seq = math.ceil(TOKENS / BS) * probe.bytes_per_block + probe.state_bytes_per_slot
    slots = min(max_seqs, budget // per_seq) if probe.state_bytes_per_slot else 0
    blocks = (budget - slots * probe.state_bytes_per_slot) // probe.bytes_per_block
    # running sequences only: no prefix cache (no checkpoint takes a slot)
    return CacheConfig(num_layers=len(kinds), num_kv_heads=heads, head_dim=head_dim,
                       block_size=BS, num_blocks=blocks, dtype=dtype, layer_kinds=kinds,
                       num_state_slots=slots, enable_prefix_caching=False)


def _sequences_run(config: CacheConfig) -> int:
    """1,000-token sequences admitted (prompt prepared) until the pool or slab is out."""
    cache, count = PagedKVCache(config), 0
    while True:
        prompt = (np.arange(TOKENS) + count * TOKENS + 1).tolist()  # no prefix shared
        try:
            cache.admit(f"s{count}", prompt)
        except OutOfBlocksError:
            return count
        count += 1


def test_a_3_to_1_short_conv_layout_runs_3x_the_sequences():
    """LFM2-1.2B's shapes (hidden 2048, 8 KV heads of 64, conv window 3, bfloat16)."""
    conv = LayerKind.recurrent((StateSpec("conv", (2048, 3), torch.bfloat16),))
    full = LayerKind()
    budget = 64 << 20
    hybrid = _layout((conv, conv, conv, full), 8, 64, torch.bfloat16, budget)
    twin = _layout((full,) * 4, 8, 64, torch.bfloat16, budget)
    assert hybrid.total_bytes <= budget and twin.total_bytes <= budget
    ran, ran_twin = _sequences_run(hybrid), _sequences_run(twin)
    assert ran_twin >= 7
    assert ran >= 3 * ran_twin, (ran, ran_twin)


def test_a_large_recurrent_state_pays_off_only_past_its_own_length():
    """Qwen3-Next-80B's shapes (36 gated delta nets: conv 8192 x 4 bf16 and a float32
    32 x 128 x 128 state each; 12 attention layers of 2 KV heads of 256, bfloat16):
    sequences per byte of the 3:1 layout against 48 attention layers, by length."""
    state = (StateSpec("conv", (8192, 4), torch.bfloat16),
             StateSpec("ssm", (32, 128, 128), torch.float32))
    per_token = 2 * 2 * 256 * 2  # K and V, one layer

    def ratio(tokens: int) -> float:
        twin = 48 * tokens * per_token
        hybrid = 12 * tokens * per_token + 36 * sum(
            math.prod(s.shape) * s.dtype.itemsize for s in state)
        return twin / hybrid

    assert 0.9 < ratio(1_000) < 1.1  # about as many: one state ~ 1,088 tokens of a layer
    assert ratio(8_192) > 2.8 and ratio(32_768) > 3.5
