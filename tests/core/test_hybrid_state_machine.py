"""Random programs over a hybrid cache (full, sliding-window and chunked layers in one pool)
against a model.

K/V of a token is a deterministic function of its prefix of token ids (one tensor per
layer), so K/V a prefix hit brings from another sequence must equal what the sequence
would have written itself. After every rule the cache passes `check()`, and every resident
sequence reads back its model in every layer at every position that layer's row still
holds, which must include every position its next query can see
(`paged_kv.core.groups.rules.skipped_tokens`); positions its window gave back read zeros.
"""

from __future__ import annotations

import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from paged_kv import LayerKind, OutOfBlocksError, PagedKVCache
from paged_kv.core.cache import snapshot
from paged_kv.kernels.quant import dequantize_reference, quantize_reference

from ..conftest import assert_same_snapshot, tiny_config

SYSTEM_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 13)
HEADS, DIM = 2, 4
MAX_BLOCKS = 16  # columns a page table starts with


def kv_for(prefix: tuple, num_layers: int) -> torch.Tensor:
    """``[num_layers, 2, H, D]`` K/V of the last token of `prefix` (None = unknown ids)."""
    if None in prefix:
        return torch.randn(num_layers, 2, HEADS, DIM)
    seed = zlib.crc32(np.asarray(prefix, dtype="<i4").tobytes())
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(
        (num_layers, 2, HEADS, DIM))).float()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_seen(kind: LayerKind, position: int) -> int:
    """The first key a query at `position` sees, from the contract (not from the code's
    rule: a shared rule would agree with itself however wrong): a window of W sees
    ``position - W < j``, a chunk of C from the start of its own chunk."""
    if kind.window:
        return max(position - kind.window + 1, 0)
    if kind.chunk:
        return position // kind.chunk * kind.chunk
    return 0


class HybridMachine(RuleBasedStateMachine):
    """Sliding:3, full, sliding:3, chunked:4 in blocks of 2: four groups of one layer."""

    seqs = Bundle("seqs")
    kinds = (LayerKind.sliding(3), LayerKind.full(), LayerKind.sliding(3),
             LayerKind.chunked(4))
    block_size = 2
    num_blocks = 40
    kv_cache_dtype = "auto"

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(tiny_config(
            num_layers=len(self.kinds), layer_kinds=self.kinds, block_size=self.block_size,
            num_blocks=self.num_blocks, num_host_blocks=0, kv_cache_dtype=self.kv_cache_dtype))
        self.layers = len(self.kinds)
        self.tokens: dict[str, list] = {}     # seq -> token ids so far (None = unknown)
        self.kv: dict[str, list] = {}         # seq -> per token [layers, 2, H, D]
        self.pending: dict[str, list] = {}    # seq -> prompt tokens not yet prepared
        self.counter = 0

    def _room(self) -> list[str]:
        """Sequences that may grow: a row of more blocks than the tables' first width
        (16) grows every row's columns, which `snapshot` would count as a change of a
        refused step."""
        return sorted(s for s, t in self.tokens.items()
                      if len(t) + 6 <= MAX_BLOCKS * self.block_size)

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _prompt(self, system: int, suffix: list[int]) -> list[int]:
        return (list(SYSTEM_PROMPTS[system]) if system < len(SYSTEM_PROMPTS) else []) + suffix

    def _append(self, seq_id: str, new_ids: list) -> list[torch.Tensor]:
        """Extend the model of `seq_id` by `new_ids`; their K/V, one per token."""
        out = []
        for token in new_ids:
            self.tokens[seq_id].append(token)
            self.kv[seq_id].append(kv_for(tuple(self.tokens[seq_id]), self.layers))
            out.append(self.kv[seq_id][-1])
        return out

    def _write(self, kvs: list[torch.Tensor], batch) -> None:
        kv = torch.stack(kvs, 2)  # (layers, 2, tokens, H, D)
        for layer in range(self.layers):
            self.cache.write(layer, kv[layer, 0].contiguous(), kv[layer, 1].contiguous(), batch)

    def _check_window_rows(self, old_lens: dict[str, int], one_token: bool) -> None:
        """After a step a window or chunked row holds exactly the blocks from the one its
        first query (at the old length) reads on: so it gave back all it could, and kept
        what the step's queries read; about ``cdiv(span, block_size) + 1`` blocks."""
        bs = self.block_size
        for seq_id, old_len in old_lens.items():
            new_len = len(self.tokens[seq_id])
            for group in self.cache.groups:
                blocks = group.tables.blocks(seq_id)
                held = int((blocks != 0).sum())
                if group.kind.is_full:
                    assert held == cdiv(new_len, bs)
                    continue
                want = cdiv(new_len, bs) - first_seen(group.kind, old_len) // bs
                assert held == want, (f"{seq_id}'s {group.kind} row holds {held} blocks "
                                      f"after {old_len} -> {new_len} tokens, not {want}")
                if one_token:
                    assert held <= cdiv(group.kind.span, bs) + 1

    # -- admissions -----------------------------------------------------------------------
    @rule(target=seqs, system=st.integers(0, len(SYSTEM_PROMPTS)),
          suffix=st.lists(st.integers(0, 5), max_size=6))
    def add(self, system, suffix):
        prompt = self._prompt(system, suffix)
        seq_id = self._new_id()
        hit = self.cache.add_sequence(seq_id, prompt or None)
        assert hit % self.block_size == 0 and (hit < len(prompt) or hit == 0)
        assert self.cache.tables.num_tokens_of(seq_id) == hit
        self.tokens[seq_id], self.kv[seq_id] = [], []
        self._append(seq_id, prompt[:hit])
        self.pending[seq_id] = prompt[hit:]
        return seq_id

    @rule(target=seqs, system=st.integers(0, len(SYSTEM_PROMPTS)),
          suffix=st.lists(st.integers(0, 5), min_size=1, max_size=6),
          max_tokens=st.none() | st.integers(1, 6))
    def admit(self, system, suffix, max_tokens):
        prompt = self._prompt(system, suffix)
        seq_id = self._new_id()
        plan = self.cache.plan_admission(seq_id, prompt, max_tokens=max_tokens)
        obtainable = self.cache.allocator.num_obtainable_blocks
        before = snapshot(self.cache)
        try:
            hit, batch = self.cache.admit(seq_id, prompt, max_tokens=max_tokens)
        except OutOfBlocksError:
            assert plan.requested + plan.revived > obtainable, "admit refused a plan that fits"
            assert_same_snapshot(before, snapshot(self.cache), "admit() out of blocks")
            return multiple()
        assert hit == plan.num_hit and batch.num_tokens == plan.count
        assert hit % self.block_size == 0 and hit < len(prompt)
        self.tokens[seq_id], self.kv[seq_id] = [], []
        self._append(seq_id, prompt[:hit])
        for group in self.cache.groups:  # what its first query reads is there
            given_back = int((group.tables.blocks(seq_id) == 0).sum())
            assert given_back <= first_seen(group.kind, hit) // self.block_size
        new = prompt[hit:hit + batch.num_tokens]
        self.pending[seq_id] = prompt[hit + len(new):]
        self._write(self._append(seq_id, new), batch)
        return seq_id

    # -- steps ----------------------------------------------------------------------------
    def _try_step(self, request, call, what: str):
        """Run one step, checking the capacity rule against `num_blocks_needed` first; the
        batch, or None when it was refused (and then nothing changed)."""
        needed = self.cache.num_blocks_needed(request)
        obtainable = self.cache.allocator.num_obtainable_blocks
        before = snapshot(self.cache)
        try:
            batch = call()
        except OutOfBlocksError as exc:
            assert exc.requested > exc.free
            assert needed > obtainable, (f"{what} refused a step num_blocks_needed says fits "
                                         f"({needed} <= {obtainable})")
            assert_same_snapshot(before, snapshot(self.cache), f"{what} out of blocks")
            return None
        taken = obtainable - self.cache.allocator.num_obtainable_blocks
        # an upper bound: a copy-on-write copy's source returns to the obtainable blocks
        # when the row was its last owner (as in the uniform cache); the give-back of shared
        # blocks by forks in one step is counted exactly (test_hybrid_cache.py)
        assert taken <= needed, f"{what} took {taken} blocks, num_blocks_needed said {needed}"
        return batch

    @rule(data=st.data())
    def step(self, data):
        if not self._room():
            return
        chosen = data.draw(st.lists(st.sampled_from(self._room()), min_size=1, unique=True))
        request = {}
        for seq_id in chosen:
            size = data.draw(st.integers(1, 6))
            if data.draw(st.sampled_from(["ids", "ids", "count"])) == "count":
                request[seq_id] = size
            else:
                request[seq_id] = self.pending[seq_id][:size] or data.draw(
                    st.lists(st.integers(0, 5), min_size=1, max_size=size))
        old_lens = {s: len(self.tokens[s]) for s in request}
        batch = self._try_step(request, lambda: self.cache.prepare(request), "prepare()")
        if batch is None:
            return
        kvs = []
        for seq_id, new in request.items():
            if not isinstance(new, int):
                self.pending[seq_id] = self.pending[seq_id][len(new):]
            kvs += self._append(seq_id, [None] * new if isinstance(new, int) else list(new))
        self._write(kvs, batch)
        self._check_window_rows(old_lens, one_token=False)

    @rule(data=st.data())
    def decode(self, data):
        """One token for each of some sequences through the array API."""
        if not self._room():
            return
        chosen = data.draw(st.lists(st.sampled_from(self._room()), min_size=1, unique=True))
        new = data.draw(st.lists(st.integers(0, 5), min_size=len(chosen),
                                 max_size=len(chosen)))
        rows = self.cache.rows_of(chosen)
        old_lens = {s: len(self.tokens[s]) for s in chosen}
        batch = self._try_step(
            {s: [t] for s, t in zip(chosen, new, strict=True)},
            lambda: self.cache.prepare_decode(rows, np.array(new)), "prepare_decode()")
        if batch is None:
            return
        kvs = []
        for seq_id, token in zip(chosen, new, strict=True):
            self.pending[seq_id] = self.pending[seq_id][1:]
            kvs += self._append(seq_id, [token])
        self._write(kvs, batch)
        self._check_window_rows(old_lens, one_token=True)

    # -- lifecycle ------------------------------------------------------------------------
    @rule(parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens:
            return
        child = self._new_id()
        self.cache.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.kv[child] = list(self.kv[parent])
        self.pending[child] = list(self.pending[parent])

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        if seq_id not in self.tokens:
            with pytest.raises(KeyError):
                self.cache.free(seq_id)
            return
        self.cache.free(seq_id)
        for model in (self.tokens, self.kv, self.pending):
            del model[seq_id]

    @rule(seq_id=seqs, keep=st.floats(0, 1))
    def truncate(self, seq_id, keep):
        """Roll back; refused (changing nothing) where a window gave back blocks the
        query after the kept tokens would read."""
        if seq_id not in self.tokens:
            return
        num_tokens = int(len(self.tokens[seq_id]) * keep)
        allowed = all(
            int((g.tables.blocks(seq_id) == 0).sum())
            <= first_seen(g.kind, num_tokens) // self.block_size for g in self.cache.groups)
        before = snapshot(self.cache)
        if not allowed:
            with pytest.raises(ValueError, match="gave back"):
                self.cache.truncate(seq_id, num_tokens)
            assert_same_snapshot(before, snapshot(self.cache), "refused truncate()")
            return
        self.cache.truncate(seq_id, num_tokens)
        self.tokens[seq_id] = self.tokens[seq_id][:num_tokens]
        self.kv[seq_id] = self.kv[seq_id][:num_tokens]

    @rule()
    def reset_prefix_cache(self):
        cached = self.cache.stats().num_cached_blocks
        assert self.cache.reset_prefix_cache() == cached
        assert self.cache.stats().num_cached_blocks == 0

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.cache.check()
        stats = self.cache.stats()
        assert (stats.num_live_blocks + stats.num_cached_blocks + stats.num_free_blocks
                == stats.num_blocks - 1)
        assert set(self.cache.tables.seq_ids) == set(self.tokens)
        for seq_id, tokens in self.tokens.items():
            assert self.cache.tables.num_tokens_of(seq_id) == len(tokens)
        for group in self.cache.groups:
            for layer in group.layers:
                self._check_layer(group, layer)

    def _check_layer(self, group, layer: int) -> None:
        bs = self.block_size
        for seq_id, kvs in self.kv.items():
            n = len(kvs)
            k, v = self.cache.gather(layer, [seq_id])
            blocks = group.tables.blocks(seq_id)
            given_back = int((blocks == 0).sum())
            assert (blocks[:given_back] == 0).all(), f"{seq_id}: a null block past live ones"
            # what the next query reads was never given back
            assert given_back <= first_seen(group.kind, n) // bs, (
                f"{seq_id} ({group.kind}, {n} tokens) gave back {given_back} blocks")
            start = min(given_back * bs, n)
            assert not k[0, :start].any() and not v[0, :start].any(), (
                f"{seq_id}: positions its {group.kind} window gave back are not zeros")
            if n > start:
                want = self.read_back(torch.stack(kvs[start:]))
                assert torch.equal(k[0, start:n], want[:, layer, 0]), (
                    f"K of {seq_id} layer {layer} ({group.kind}) corrupted")
                assert torch.equal(v[0, start:n], want[:, layer, 1]), (
                    f"V of {seq_id} layer {layer} ({group.kind}) corrupted")

    def read_back(self, kv: torch.Tensor) -> torch.Tensor:
        """What the pages give back for `kv`: itself, or its 8-bit round trip."""
        if not self.cache.config.is_quantized:
            return kv
        codes, scale = quantize_reference(kv.flatten(0, 2), self.cache.config.cache_dtype)
        out = dequantize_reference(codes, scale, torch.empty_like(kv.flatten(0, 2)))
        return out.view_as(kv)

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free(seq_id)
        self.cache.check()
        assert self.cache.stats().num_live_blocks == 0, "blocks leaked after freeing all"


class WindowOnlyMachine(HybridMachine):
    """Every layer a window (two widths): the leading group gives blocks back too."""

    kinds = (LayerKind.sliding(3), LayerKind.sliding(5), LayerKind.sliding(3),
             LayerKind.sliding(5))
    block_size = 3
    num_blocks = 30


class Int8HybridMachine(HybridMachine):
    """The mixed layout on int8 pages: scales follow hits, copies, give-backs."""

    kinds = (LayerKind.sliding(5), LayerKind.full(), LayerKind.sliding(5),
             LayerKind.chunked(8))
    block_size = 4
    kv_cache_dtype = "int8"


_SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = _SETTINGS
TestWindowOnlyMachine = WindowOnlyMachine.TestCase
TestWindowOnlyMachine.settings = settings(_SETTINGS, max_examples=25)
TestInt8HybridMachine = Int8HybridMachine.TestCase
TestInt8HybridMachine.settings = settings(_SETTINGS, max_examples=15)
