"""Random programs of add / prepare / write / fork / free / swap / truncate / reset, vs a model.

K/V of a token is a deterministic function of its prefix of token ids, so K/V served from
the prefix cache must equal what the sequence would have written itself; after every rule
the cache passes `check()` and every resident sequence reads back exactly its model.
"""

from __future__ import annotations

import os
import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from paged_kv import OutOfBlocksError, PagedKVCache
from paged_kv.core.cache import snapshot
from paged_kv.core.decode_rows import numba
from paged_kv.kernels.quant import dequantize_reference, quantize_reference

from ..conftest import assert_same_snapshot, tiny_config

SYSTEM_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 13)


def kv_for(prefix: tuple) -> torch.Tensor:
    """``[num_layers, 2, H, D]`` K/V of the last token of `prefix` (None = unknown ids)."""
    if None in prefix:
        return torch.randn(2, 2, 2, 4)
    seed = zlib.crc32(np.asarray(prefix, dtype="<i4").tobytes())
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((2, 2, 2, 4))).float()


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    kv_cache_dtype = "auto"
    compiled: bool | None = None  # the default variant (compiled where numba imports)

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(tiny_config(num_blocks=20, num_host_blocks=10,
                                              kv_cache_dtype=self.kv_cache_dtype),
                                  compiled=self.compiled)
        self.tokens: dict[str, list] = {}     # seq -> token ids so far (None = unknown)
        self.kv: dict[str, list] = {}         # seq -> per token [layers, 2, H, D]
        self.pending: dict[str, list] = {}    # seq -> prompt tokens not yet prepared
        self.swapped: set[str] = set()       # seqs whose blocks are in the host pool
        self.counter = 0

    def _is_swapped(self, seq_id: str) -> bool:
        return seq_id in self.swapped

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    @rule(target=seqs, system=st.integers(0, len(SYSTEM_PROMPTS)),
          suffix=st.lists(st.integers(0, 5), max_size=6))
    def add(self, system, suffix):
        prompt = (list(SYSTEM_PROMPTS[system]) if system < len(SYSTEM_PROMPTS) else []) + suffix
        seq_id = self._new_id()
        hit = self.cache.add_sequence(seq_id, prompt or None)
        assert hit % self.cache.config.block_size == 0 and (hit < len(prompt) or hit == 0)
        assert self.cache.tables.num_tokens_of(seq_id) == hit
        self.tokens[seq_id] = prompt[:hit]
        self.kv[seq_id] = [kv_for(tuple(prompt[: i + 1])) for i in range(hit)]
        self.pending[seq_id] = prompt[hit:]
        return seq_id

    @rule(data=st.data())
    def step(self, data):
        resident = [s for s in self.tokens if not self._is_swapped(s)]
        if not resident:
            return
        chosen = data.draw(st.lists(st.sampled_from(resident), min_size=1, unique=True))
        request = {}
        for seq_id in chosen:
            kind = data.draw(st.sampled_from(["ids", "ids", "count"]))
            size = data.draw(st.integers(1, 6))
            if kind == "count":
                request[seq_id] = size
            else:
                new = self.pending[seq_id][:size] or data.draw(
                    st.lists(st.integers(0, 5), min_size=1, max_size=size))
                request[seq_id] = new
        before = snapshot(self.cache)
        try:
            batch = self.cache.prepare(request)
        except OutOfBlocksError as exc:
            assert exc.requested > exc.free
            assert_same_snapshot(before, snapshot(self.cache), "prepare() out of blocks")
            return
        keys, values = [], []
        for seq_id, new in request.items():
            new_ids = [None] * new if isinstance(new, int) else list(new)
            if not isinstance(new, int):
                self.pending[seq_id] = self.pending[seq_id][len(new):]
            for token in new_ids:
                self.tokens[seq_id].append(token)
                kv = kv_for(tuple(self.tokens[seq_id]))
                self.kv[seq_id].append(kv)
                keys.append(kv[:, 0])
                values.append(kv[:, 1])
        k, v = torch.stack(keys, 1), torch.stack(values, 1)  # (layers, tokens, H, D)
        for layer in range(2):
            self.cache.write(layer, k[layer].contiguous(), v[layer].contiguous(), batch)

    @rule(data=st.data())
    def decode(self, data):
        """One token for each of some resident sequences through the array API."""
        resident = [s for s in self.tokens if not self._is_swapped(s)]
        if not resident:
            return
        chosen = data.draw(st.lists(st.sampled_from(resident), min_size=1, unique=True))
        new = data.draw(st.lists(st.integers(0, 5), min_size=len(chosen),
                                 max_size=len(chosen)))
        rows = self.cache.rows_of(chosen)
        before = snapshot(self.cache)
        try:
            batch = self.cache.prepare_decode(rows, np.array(new))
        except OutOfBlocksError as exc:
            assert exc.requested > exc.free
            assert_same_snapshot(before, snapshot(self.cache), "prepare_decode() out of blocks")
            return
        assert batch.seq_ids == tuple(chosen)
        kvs = []
        for seq_id, token in zip(chosen, new, strict=True):
            self.pending[seq_id] = self.pending[seq_id][1:]
            self.tokens[seq_id].append(token)
            kvs.append(kv_for(tuple(self.tokens[seq_id])))
            self.kv[seq_id].append(kvs[-1])
        kv = torch.stack(kvs, 2)  # (layers, 2, tokens, H, D)
        for layer in range(2):
            self.cache.write(layer, kv[layer, 0].contiguous(), kv[layer, 1].contiguous(), batch)

    @rule(parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens or self._is_swapped(parent):
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

    @rule(seq_id=seqs)
    def swap(self, seq_id):
        if seq_id not in self.tokens:
            return
        before = snapshot(self.cache)
        try:
            if self._is_swapped(seq_id):
                self.cache.swap_in(seq_id)
                self.swapped.discard(seq_id)
            else:
                self.cache.swap_out(seq_id)
                self.swapped.add(seq_id)
        except OutOfBlocksError:
            assert_same_snapshot(before, snapshot(self.cache), "swap out of blocks")

    @rule(seq_id=seqs, keep=st.floats(0, 1))
    def truncate(self, seq_id, keep):
        if seq_id not in self.tokens or self._is_swapped(seq_id):
            return
        num_tokens = int(len(self.tokens[seq_id]) * keep)
        self.cache.truncate(seq_id, num_tokens)
        self.tokens[seq_id] = self.tokens[seq_id][:num_tokens]
        self.kv[seq_id] = self.kv[seq_id][:num_tokens]

    @rule()
    def reset_prefix_cache(self):
        cached = self.cache.stats().num_cached_blocks
        assert self.cache.reset_prefix_cache() == cached
        assert self.cache.stats().num_cached_blocks == 0

    @invariant()
    def consistent(self):
        self.cache.check()
        stats = self.cache.stats()
        assert (stats.num_live_blocks + stats.num_cached_blocks + stats.num_free_blocks
                == stats.num_blocks - 1)
        assert set(self.cache.tables.seq_ids) == set(self.tokens)
        resident = [s for s in self.tokens if not self._is_swapped(s)]
        for seq_id in resident:
            assert self.cache.tables.num_tokens_of(seq_id) == len(self.tokens[seq_id])
        if not resident:
            return
        for layer in range(2):
            k, v = self.cache.gather(layer, resident)
            for row, seq_id in enumerate(resident):
                n = len(self.kv[seq_id])
                if n == 0:
                    continue
                want = self.read_back(torch.stack(self.kv[seq_id]))  # (n, layers, 2, H, D)
                assert torch.equal(k[row, :n], want[:, layer, 0]), f"K of {seq_id} corrupted"
                assert torch.equal(v[row, :n], want[:, layer, 1]), f"V of {seq_id} corrupted"
                assert not k[row, n:].any(), f"padding of {seq_id} not zero"

    def read_back(self, kv: torch.Tensor) -> torch.Tensor:
        """What the pages give back for `kv`: itself, or its 8-bit round trip, which is a
        function of the token's own K/V alone (one scale per token and head) and within
        half a scale step of it."""
        if not self.cache.config.is_quantized:
            return kv
        codes, scale = quantize_reference(kv.flatten(0, 2), self.cache.config.cache_dtype)
        out = dequantize_reference(codes, scale, torch.empty_like(kv.flatten(0, 2)))
        assert ((out - kv.flatten(0, 2)).abs() <= scale.float()[..., None] / 2 + 1e-6).all()
        return out.view_as(kv)

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free(seq_id)
        self.cache.check()
        stats = self.cache.stats()
        assert stats.num_live_blocks == 0, "blocks leaked after freeing every sequence"
        assert stats.num_swapped_blocks == 0


class NumpyCacheMachine(CacheMachine):
    """The same programs with the numpy page-table path (numba, when installed, is the
    default for decode steps)."""

    compiled = False

    def __init__(self) -> None:
        super().__init__()
        assert not self.cache.tables.compiled


TestCacheMachine = CacheMachine.TestCase
TestNumpyCacheMachine = NumpyCacheMachine.TestCase


class Int8CacheMachine(CacheMachine):
    """The same programs on int8 pages: scales must follow copies, forks, swaps, truncation."""

    kv_cache_dtype = "int8"


TestInt8CacheMachine = Int8CacheMachine.TestCase
# 150 programs of 40 rules find a truncated-then-overwritten prefix block (checked by
# planting that bug); the rerun under the Triton interpreter keeps to fewer
for name, examples, steps in (("paged_kv", 150, 40), ("paged_kv_interpreter", 40, 30)):
    settings.register_profile(name, max_examples=examples, stateful_step_count=steps,
                              deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine.settings = settings.get_profile(
    os.environ.get("PAGED_KV_HYPOTHESIS_PROFILE", "paged_kv"))
settings.register_profile("paged_kv_numpy", max_examples=60, stateful_step_count=40,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestNumpyCacheMachine.settings = settings.get_profile(
    "paged_kv_interpreter" if os.environ.get("PAGED_KV_HYPOTHESIS_PROFILE") else "paged_kv_numpy")
if numba is None:  # the main machine already runs the numpy path
    TestNumpyCacheMachine = pytest.mark.skip("numba not installed")(TestNumpyCacheMachine)
# the int8 rerun: fewer programs, the same rules (the float run finds the block-level bugs)
TestInt8CacheMachine.settings = settings(TestCacheMachine.settings,
                                         max_examples=TestCacheMachine.settings.max_examples // 3)
