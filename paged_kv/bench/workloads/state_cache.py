"""The state workload's cache side: a Qwen3-Next-shaped byte layout, a stand-in cache with
the same block and state-slot counts, and a replay that drives it as the engine would.

The policy that keeps or drops state checkpoints sees slot and block counts only, never
bytes: so the byte arithmetic is done on the real model's `CacheConfig` (never allocated:
one slot of a 48-layer Qwen3-Next-like model is 74 MiB), and the replay runs a stand-in
cache of tiny tensors with exactly the same ``num_blocks``, ``num_state_slots``, block size
and layer pattern. Its fake state is a fingerprint of the tokens consumed (their count and
a rolling hash), written after every step the way the engine's forward writes states: each
row's final state, and the state after each of the batch's ``emit_tokens`` into its
checkpoint slot. Every admission checks that the state it was served is the fingerprint of
exactly the prefix it hit, so a hit is only counted where its state is right.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np
import torch

from ...config import CacheConfig, LayerKind, StateSpec
from ...core.cache import PagedKVCache
from ...core.groups.checkpoints import CheckpointPolicy
from ...errors import OutOfBlocksError

BLOCK_SIZE = 16
# Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (2 KV heads x 256, bf16), the
# others gated delta nets: conv window [8192, 4] bf16 and recurrent state [32, 128, 128] f32
NUM_LAYERS, FULL_EVERY, KV_HEADS, HEAD_DIM = 48, 4, 2, 256
STATES = (StateSpec("conv", (8192, 4), torch.bfloat16),
          StateSpec("recurrent", (32, 128, 128), torch.float32))
# the stand-in's state: [tokens consumed, rolling hash of them] (exact in float32)
FINGERPRINT = StateSpec("fingerprint", (2,), torch.float32)
HASH_MODULUS = 16_777_213  # a prime below 2**24


def layer_kinds(states: tuple[StateSpec, ...], num_layers: int) -> tuple[LayerKind, ...]:
    """Three recurrent layers, then one full-attention layer, repeated (3:1)."""
    return tuple(LayerKind() if (layer + 1) % FULL_EVERY == 0 else LayerKind.recurrent(states)
                 for layer in range(num_layers))


def model_config(num_blocks: int, num_state_slots: int, *,
                 all_attention: bool = False) -> CacheConfig:
    """The real model's cache config (only its bytes are read; never allocated);
    `all_attention`: the same layers all full attention (no slots)."""
    kinds = (None if all_attention else layer_kinds(STATES, NUM_LAYERS))
    return CacheConfig(num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       block_size=BLOCK_SIZE, num_blocks=num_blocks, dtype=torch.bfloat16,
                       layer_kinds=kinds or (), num_state_slots=0 if all_attention
                       else num_state_slots)


def spec_bytes(specs: tuple[StateSpec, ...]) -> int:
    """Bytes of one layer's states by their shapes and dtypes alone."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)


def state_bytes() -> int:
    """A sequence's own state: every recurrent layer's, counted from the specs."""
    return spec_bytes(STATES) * (NUM_LAYERS - NUM_LAYERS // FULL_EVERY)


def stand_in(num_blocks: int, num_state_slots: int, *, all_attention: bool = False,
             policy: CheckpointPolicy | None = None) -> PagedKVCache:
    """A cache of tiny tensors with the model's counts: 3 fingerprint layers and one full
    attention layer (or 4 attention layers); `policy` replaces the checkpoint policy
    before any slot is used (the one place a policy lives: see `CheckpointPolicy`)."""
    kinds = () if all_attention else layer_kinds((FINGERPRINT,), FULL_EVERY)
    cache = PagedKVCache(CacheConfig(
        num_layers=FULL_EVERY, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE,
        num_blocks=num_blocks, dtype=torch.float32, layer_kinds=kinds,
        num_state_slots=0 if all_attention else num_state_slots))
    if policy is not None:
        cache.groups[-1].slots.policy = policy
    return cache


class RecencyPolicy(CheckpointPolicy):
    """A counterfactual for the report: the least recently used checkpoint goes first
    whatever its position, and a new one always displaces it (the cache's own policy ranks
    by position first)."""

    def add_all(self, slots, tiers) -> None:
        """`add_all` with every checkpoint in one tier: its use alone ranks it. (`add`,
        `touch` and a step's confirm all come here.)"""
        super().add_all(slots, np.zeros(len(slots), dtype=np.int64))

    def retier(self, slot: int, tier: int) -> None:
        """No tiers: a checkpoint keeps its rank."""

    def admits(self, tier: int, victim: int) -> bool:
        """A new checkpoint always displaces the victim."""
        return True


def fingerprints(tokens: list[int], start: tuple[int, int] = (0, 0)) -> list[tuple[int, int]]:
    """The fingerprint after each of `tokens`, continuing from `start`."""
    count, value = start
    found = []
    for token in tokens:
        count, value = count + 1, (value * 1_000_003 + token + 1) % HASH_MODULUS
        found.append((count, value))
    return found


@dataclasses.dataclass
class Request:
    """A prompt and the answer the engine would sample (its tokens but the last are fed
    back as decode steps); ``hit`` is filled in at admission."""

    prompt: list[int]
    answer: list[int]
    hit: int = -1

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens its forward consumed: the prompt and the answer but its last."""
        return self.prompt + self.answer[:-1]


@dataclasses.dataclass
class _Running:
    request: Request
    seq_id: int
    done: int  # tokens consumed
    state: tuple[int, int]  # fingerprint after them


@dataclasses.dataclass
class ReplayStats:
    """What a replay served: hits (tokens, per request), and the most checkpoints held."""

    hits: list[int]
    peak_checkpoints: int
    checkpoints_written: int
    checkpoints_evicted: int


def replay(cache: PagedKVCache, requests: list[Request], *, concurrency: int = 1,
           budget: int = 512, after: dict[int, int] | None = None) -> ReplayStats:
    """Serve `requests` in order, at most `concurrency` at once, `budget` tokens a step
    (decodes first, then prefill chunks), as the engine schedules; `after[i] = j`: request
    ``i`` waits until request ``j`` finished (a conversation's next turn)."""
    recurrent = list(cache.config.recurrent_layers)
    waiting, running, finished, peak = deque(range(len(requests))), [], set(), 0
    while waiting or running:
        while waiting and len(running) < concurrency:
            index = waiting[0]
            if (after or {}).get(index, index) not in finished | {index}:
                break  # its conversation's previous turn is still running
            request = requests[index]
            try:
                hit = cache.add_sequence(index, request.prompt)
            except OutOfBlocksError:
                break
            waiting.popleft()
            request.hit = hit
            state = fingerprints(request.prompt[:hit])[-1] if hit else (0, 0)
            _check_served(cache, index, state, recurrent[0])
            running.append(_Running(request, index, hit, state))
        if not running:
            raise RuntimeError("replay: no request can be admitted into an empty cache")
        new_tokens, left = {}, budget
        for run in sorted(running, key=lambda r: r.done < len(r.request.prompt)):
            tokens = run.request.cached_tokens
            # a decode feeds back one sampled token a step; a prefill takes a chunk
            chunk = 1 if run.done >= len(run.request.prompt) else left
            count = min(chunk, left, len(tokens) - run.done)
            if count > 0:
                new_tokens[run.seq_id] = tokens[run.done:run.done + count]
                left -= count
        batch = cache.prepare(new_tokens)
        _write_states(cache, batch, running, new_tokens, recurrent)
        peak = max(peak, cache.stats().num_checkpoints)
        for run in list(running):
            if run.done == len(run.request.cached_tokens):
                cache.free(run.seq_id)
                running.remove(run)
                finished.add(run.seq_id)
    stats = cache.stats()
    return ReplayStats([r.hit for r in requests], peak, stats.checkpoints_written,
                       stats.checkpoints_evicted)


def _write_states(cache: PagedKVCache, batch, running: list[_Running],
                  new_tokens: dict[int, list[int]], recurrent: list[int]) -> None:
    """The forward's writes: each row's fingerprint after its tokens into its live slot,
    and the fingerprint after each emitted token into its checkpoint slot."""
    by_id = {run.seq_id: run for run in running}
    packed, final = [], []
    for seq_id, tokens in new_tokens.items():  # the batch packs rows in this order
        run = by_id[seq_id]
        states = fingerprints(tokens, run.state)
        packed += states
        final.append(states[-1])
        run.done, run.state = run.done + len(tokens), states[-1]
    emit = batch.groups[-1].emit_tokens.tolist()
    final_t = torch.tensor(final, dtype=torch.float32)
    emitted_t = torch.tensor([packed[i] for i in emit], dtype=torch.float32).reshape(-1, 2)
    for layer in recurrent:
        cache.write_states(layer, batch, (final_t,), (emitted_t,))


def _check_served(cache: PagedKVCache, seq_id: int, expected: tuple[int, int],
                  layer: int) -> None:
    """RuntimeError unless `seq_id`'s live state is the fingerprint of what it hit: a hit
    served with another prefix's state would be wrong tokens, not a hit."""
    group = cache.groups[-1]
    slot = int(group.slots.live_of([cache.tables.row_of[seq_id]])[0])
    found = tuple(int(v) for v in cache.states(layer)[0][slot].tolist())
    if found != expected:
        raise RuntimeError(f"request {seq_id}: served the state {found}, expected {expected} "
                           f"(tokens consumed, hash)")


def count_resident(num_blocks: int, num_state_slots: int, prompt_len: int, *,
                   all_attention: bool = False, limit: int = 10_000) -> int:
    """Sequences of `prompt_len` distinct tokens admitted (and one decode step each) into
    a stand-in pool before the first that does not fit (blocks or state slots)."""
    cache = stand_in(num_blocks, num_state_slots, all_attention=all_attention)
    recurrent = list(cache.config.recurrent_layers)
    for index in range(limit):
        prompt = [index * prompt_len + t for t in range(prompt_len)]
        request = Request(prompt, [0, 0])
        try:
            _, batch = cache.admit(index, prompt)
        except OutOfBlocksError:
            return index
        run = _Running(request, index, 0, (0, 0))
        if recurrent:
            _write_states(cache, batch, [run], {index: prompt}, recurrent)
            try:  # its checkpoints are confirmed (evictable) by its next step
                batch = cache.prepare({index: [0]})
            except OutOfBlocksError:
                return index + 1
            _write_states(cache, batch, [run], {index: [0]}, recurrent)
    return limit
