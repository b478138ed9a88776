"""Random programs over a cache with recurrent layers beside attention, the test playing
the model: never a prefix hit without its state.

A sequence's recurrent state after its tokens is a deterministic function of those tokens
(`model_state`: a hash of the token prefix spread into every state tensor, zeros for no
token; a state after tokens of unknown ids is a fresh random one). After every step the
test writes each row's final state and each checkpoint the batch asks for, computed from
the tokens the batch's ``emit_tokens`` name (so a checkpoint filed under the wrong block,
or saved after the wrong token, holds another prefix's state). The invariants, after every
rule and right after every admission: the live state of every sequence equals the state
of the tokens it consumed (a hit served without its state, or with another prefix's,
fails); every written checkpoint holds the state of the prefix its key names; a hit never
exceeds what the attention groups alone accept; `cache.check()`.
Failed steps are played too: a forward that wrote garbage before it failed, rolled back
with ``truncate(unwritten=True)``; the state is restored from a checkpoint or the sequence
is marked lost (and then refused until freed).
"""

from __future__ import annotations

import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from paged_kv import LayerKind, OutOfBlocksError, PagedKVCache, PagedKVError
from paged_kv.config import StateSpec
from paged_kv.core.cache import snapshot
from paged_kv.core.groups.admission import plan_groups
from paged_kv.core.groups.rules import group_key
from paged_kv.core.step.plan import plan_admission
from paged_kv.keys import block_keys, root_hash

from ..conftest import assert_same_snapshot, tiny_config

SYSTEM_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 13)
CONV = StateSpec("conv", (2, 3), torch.bfloat16)
SSM = StateSpec("ssm", (3, 2), torch.float32)
REC = LayerKind.recurrent((CONV, SSM))
MAX_BLOCKS = 16  # columns a page table starts with


def model_state(prefix: tuple, layers: tuple[int, ...]) -> dict[int, tuple[torch.Tensor, ...]]:
    """Every recurrent layer's states after `prefix` (known token ids): zeros for none, else
    small integers (exact in bfloat16) drawn from a hash of the prefix."""
    out = {}
    for layer in layers:
        states = []
        for index, spec in enumerate((CONV, SSM)):
            if not prefix:
                states.append(torch.zeros(spec.shape, dtype=spec.dtype))
                continue
            seed = zlib.crc32(np.asarray(prefix, dtype="<i4").tobytes()) + 131 * layer + index
            values = np.random.default_rng(seed).integers(-64, 64, spec.shape)
            states.append(torch.from_numpy(values).to(spec.dtype))
        out[layer] = tuple(states)
    return out


def random_state(layers: tuple[int, ...], value: float | None = None) -> dict:
    """States after tokens of unknown ids (or garbage `value`): any state at all."""
    return {layer: tuple(torch.full(spec.shape, value, dtype=spec.dtype) if value is not None
                         else torch.randint(-64, 64, spec.shape).to(spec.dtype)
                         for spec in (CONV, SSM)) for layer in layers}


class StateMachine(RuleBasedStateMachine):
    """Recurrent, full, recurrent in blocks of 2, with few state slots: checkpoints are
    evicted and admissions refused for want of a slot."""

    seqs = Bundle("seqs")
    kinds = (REC, LayerKind.full(), REC)
    block_size = 2
    num_blocks = 48
    num_state_slots = 7

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(tiny_config(
            num_layers=len(self.kinds), layer_kinds=self.kinds, block_size=self.block_size,
            num_blocks=self.num_blocks, num_host_blocks=self.num_blocks,
            num_state_slots=self.num_state_slots))
        self.layers = self.cache.config.recurrent_layers
        self.tokens: dict[str, list] = {}    # seq -> token ids so far (None = unknown)
        self.state: dict[str, dict] = {}     # seq -> its live states, as the model has them
        self.pending: dict[str, list] = {}   # seq -> prompt tokens not yet prepared
        self.lost: set[str] = set()          # seqs whose state a failed step lost
        self.swapped: set[str] = set()       # seqs swapped out (their state on the host)
        self.prefix_of: dict[bytes, tuple] = {}  # a checkpoint's key -> the tokens it names
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _room(self) -> list[str]:
        """Sequences that may grow without widening the tables (which `snapshot` would
        count as a change of a refused step), and whose state is known."""
        return sorted(s for s, t in self.tokens.items()
                      if len(t) + 6 <= MAX_BLOCKS * self.block_size
                      and s not in self.lost and s not in self.swapped)

    def _state_of(self, tokens: list) -> dict:
        return (model_state(tuple(tokens), self.layers) if None not in tokens
                else random_state(self.layers))

    def _live(self, seq_id: str) -> dict:
        group = self.cache.groups[-1]
        slot = int(group.slots.live_of([self.cache.tables.row_of[seq_id]])[0])
        return {layer: tuple(t[slot] for t in self.cache.states(layer)) for layer in self.layers}

    def _assert_state(self, seq_id: str, what: str) -> None:
        live = self._live(seq_id)
        for layer in self.layers:
            for spec, got, want in zip((CONV, SSM), live[layer], self.state[seq_id][layer],
                                       strict=True):
                assert torch.equal(got, want), (
                    f"{what}: {seq_id}'s {spec.name} state in layer {layer} is not the "
                    f"state of its {len(self.tokens[seq_id])} tokens")

    def _remember(self, tokens: list) -> None:
        """The checkpoint key of every whole block of `tokens`' known prefix."""
        known = tokens[:tokens.index(None)] if None in tokens else tokens
        bs, index = self.block_size, len(self.cache.groups) - 1
        for i, key in enumerate(block_keys(np.array(known, dtype=np.int64), bs,
                                           root_hash(None))):
            self.prefix_of[group_key(key, index)] = tuple(known[:(i + 1) * bs])

    def _write(self, batch, request: dict[str, list], old: dict[str, list]) -> None:
        """Play the model over a committed step: each row's final state, and the state
        after each token the batch saves (a block's last, which this test checks)."""
        states = batch.groups[-1]
        for seq_id in request:
            self._remember(old[seq_id] + request[seq_id])
        seq_ids = list(request)
        counts = [len(new) for new in request.values()]
        starts = np.cumsum([0, *counts])
        emitted = []
        for token in states.emit_tokens.tolist():
            i = int(np.searchsorted(starts, token, side="right")) - 1
            tokens = old[seq_ids[i]] + request[seq_ids[i]]
            consumed = len(old[seq_ids[i]]) + token - int(starts[i]) + 1
            assert consumed % self.block_size == 0, f"a checkpoint after token {consumed}"
            assert None not in tokens[:consumed], "a checkpoint of tokens of unknown ids"
            emitted.append(model_state(tuple(tokens[:consumed]), self.layers))
        for layer in self.layers:
            final = tuple(torch.stack([self.state[s][layer][k] for s in seq_ids])
                          for k in range(2))
            saved = tuple(torch.stack([e[layer][k] for e in emitted]) if emitted else
                          torch.empty(0, *spec.shape, dtype=spec.dtype)
                          for k, spec in enumerate((CONV, SSM)))
            self.cache.write_states(layer, batch, final, saved)

    def _attention_hit(self, seq_id: str, prompt: list[int]) -> int:
        """The hit the attention groups alone would accept for `prompt` now."""
        lead = plan_admission(self.cache.allocator, self.block_size, seq_id,
                              np.array(prompt, dtype=np.int32), root_hash(None))
        return plan_groups(list(self.cache.groups[:-1]), self.cache.allocator, lead,
                           self.block_size, None).num_hit

    def _admitted(self, seq_id: str, prompt: list[int], hit: int, attention: int) -> None:
        assert hit <= attention, f"a hit of {hit} tokens past the attention groups' {attention}"
        assert hit % self.block_size == 0 and (hit < len(prompt) or hit == 0)
        self.tokens[seq_id] = list(prompt[:hit])
        self.state[seq_id] = model_state(tuple(prompt[:hit]), self.layers)
        self._assert_state(seq_id, "admission")  # before anything is written

    # -- admissions -----------------------------------------------------------------------
    @rule(target=seqs, system=st.integers(0, len(SYSTEM_PROMPTS)),
          suffix=st.lists(st.integers(0, 3), max_size=6))
    def add(self, system, suffix):
        prompt = (list(SYSTEM_PROMPTS[system]) if system < len(SYSTEM_PROMPTS) else []) + suffix
        seq_id, before = self._new_id(), snapshot(self.cache)
        attention = self._attention_hit(seq_id, prompt) if prompt else 0
        try:
            hit = self.cache.add_sequence(seq_id, prompt or None)
        except OutOfBlocksError as exc:
            assert "state slots" in str(exc)
            assert_same_snapshot(before, snapshot(self.cache), "add_sequence() refused")
            return multiple()
        self._admitted(seq_id, prompt, hit, attention)
        self.pending[seq_id] = prompt[hit:]
        return seq_id

    @rule(target=seqs, system=st.integers(0, len(SYSTEM_PROMPTS)),
          suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
          max_tokens=st.none() | st.integers(1, 6))
    def admit(self, system, suffix, max_tokens):
        prompt = (list(SYSTEM_PROMPTS[system]) if system < len(SYSTEM_PROMPTS) else []) + suffix
        seq_id, before = self._new_id(), snapshot(self.cache)
        attention = self._attention_hit(seq_id, prompt)
        try:
            hit, batch = self.cache.admit(seq_id, prompt, max_tokens=max_tokens)
        except OutOfBlocksError:
            assert_same_snapshot(before, snapshot(self.cache), "admit() refused")
            return multiple()
        self._admitted(seq_id, prompt, hit, attention)
        new = prompt[hit:hit + batch.num_tokens]
        self.pending[seq_id] = prompt[hit + len(new):]
        self.tokens[seq_id] += new
        self.state[seq_id] = self._state_of(self.tokens[seq_id])
        self._write(batch, {seq_id: new}, {seq_id: prompt[:hit]})
        return seq_id

    # -- steps ----------------------------------------------------------------------------
    def _request(self, data, chosen: list[str]) -> dict[str, list]:
        request = {}
        for seq_id in chosen:
            size = data.draw(st.integers(1, 6))
            if data.draw(st.sampled_from(["ids", "ids", "count"])) == "count":
                request[seq_id] = [None] * size
            else:
                request[seq_id] = self.pending[seq_id][:size] or data.draw(
                    st.lists(st.integers(0, 3), min_size=1, max_size=size))
        return request

    def _prepare(self, request: dict[str, list]):
        """`prepare` of `request` (None ids as a count); None when refused (unchanged)."""
        before = snapshot(self.cache)
        try:
            return self.cache.prepare({s: len(new) if None in new else new
                                       for s, new in request.items()})
        except OutOfBlocksError:
            assert_same_snapshot(before, snapshot(self.cache), "prepare() refused")
            return None

    @rule(data=st.data())
    def step(self, data):
        if not self._room():
            return
        chosen = data.draw(st.lists(st.sampled_from(self._room()), min_size=1, unique=True))
        request = self._request(data, chosen)
        batch = self._prepare(request)
        if batch is None:
            return
        old = {s: list(self.tokens[s]) for s in request}
        for seq_id, new in request.items():
            if None not in new:
                self.pending[seq_id] = self.pending[seq_id][len(new):]
            self.tokens[seq_id] += new
            self.state[seq_id] = self._state_of(self.tokens[seq_id])
        self._write(batch, request, old)

    @rule(data=st.data())
    def decode(self, data):
        """One known token for each of some sequences through the array API."""
        if not self._room():
            return
        chosen = data.draw(st.lists(st.sampled_from(self._room()), min_size=1, unique=True))
        new = data.draw(st.lists(st.integers(0, 3), min_size=len(chosen),
                                 max_size=len(chosen)))
        rows, before = self.cache.rows_of(chosen), snapshot(self.cache)
        try:
            batch = self.cache.prepare_decode(rows, np.array(new))
        except OutOfBlocksError:
            assert_same_snapshot(before, snapshot(self.cache), "prepare_decode() refused")
            return
        old = {s: list(self.tokens[s]) for s in chosen}
        for seq_id, token in zip(chosen, new, strict=True):
            self.pending[seq_id] = self.pending[seq_id][1:]
            self.tokens[seq_id].append(token)
            self.state[seq_id] = self._state_of(self.tokens[seq_id])
        self._write(batch, {s: [t] for s, t in zip(chosen, new, strict=True)}, old)

    @rule(data=st.data(), garbage_layers=st.integers(0, 1))
    def failed_step(self, data, garbage_layers):
        """A step whose forward wrote `garbage_layers` layers' states (live and emitted),
        not the last one's, and then failed: rolled back with ``truncate(unwritten=True)``
        to each row's old length. Its state is restored from a checkpoint there, or marked
        lost. (Once the last recurrent layer wrote, every layer's states are the model's:
        its checkpoints are kept, a later failure notwithstanding.)"""
        if not self._room():
            return
        chosen = data.draw(st.lists(st.sampled_from(self._room()), min_size=1, unique=True))
        batch = self._prepare(self._request(data, chosen))
        if batch is None:
            return
        states = batch.groups[-1]
        for layer in self.layers[:garbage_layers]:
            junk = random_state(self.layers, -99.0)[layer]
            self.cache.write_states(
                layer, batch, tuple(t.expand(states.batch_size, *t.shape) for t in junk),
                tuple(t.expand(states.num_emitted, *t.shape) for t in junk))
        group = self.cache.groups[-1]
        for seq_id in chosen:
            self.cache.truncate(seq_id, len(self.tokens[seq_id]), unwritten=True)
            row = self.cache.tables.row_of[seq_id]
            if row in group.lost:
                self.lost.add(seq_id)

    # -- lifecycle ------------------------------------------------------------------------
    @rule(parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens or parent in self.swapped:
            return
        child, before = self._new_id(), snapshot(self.cache)
        if parent in self.lost:
            with pytest.raises(PagedKVError, match="was lost"):
                self.cache.fork(parent, child)
            assert_same_snapshot(before, snapshot(self.cache), "fork() of a lost state")
            return
        try:
            self.cache.fork(parent, child)
        except OutOfBlocksError as exc:
            assert "state slots" in str(exc)
            assert_same_snapshot(before, snapshot(self.cache), "fork() refused")
            return
        self.tokens[child] = list(self.tokens[parent])
        self.state[child] = dict(self.state[parent])
        self.pending[child] = list(self.pending[parent])

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        if seq_id not in self.tokens:
            return
        self.cache.free(seq_id)
        for model in (self.tokens, self.state, self.pending):
            del model[seq_id]
        self.lost.discard(seq_id)
        self.swapped.discard(seq_id)

    @rule(seq_id=seqs, keep=st.floats(0, 1))
    def truncate(self, seq_id, keep):
        """Roll back to a checkpoint (or 0); refused, changing nothing, elsewhere."""
        if seq_id not in self.tokens or seq_id in self.lost or seq_id in self.swapped:
            return
        num_tokens = int(len(self.tokens[seq_id]) * keep)
        before = snapshot(self.cache)
        try:
            self.cache.truncate(seq_id, num_tokens)
        except ValueError as exc:
            assert "checkpoint" in str(exc) or "gave back" in str(exc)
            assert_same_snapshot(before, snapshot(self.cache), "refused truncate()")
            return
        if num_tokens < len(self.tokens[seq_id]):  # restored: a checkpoint's, or zeros
            self.tokens[seq_id] = self.tokens[seq_id][:num_tokens]
            self.state[seq_id] = model_state(tuple(self.tokens[seq_id]), self.layers)
            self.pending[seq_id] = []

    @rule(seq_id=seqs)
    def swap_out(self, seq_id):
        """The live state moves to a host copy with the blocks (a lost one is refused)."""
        if seq_id not in self.tokens or seq_id in self.swapped:
            return
        before = snapshot(self.cache)
        if seq_id in self.lost:
            with pytest.raises(PagedKVError, match="was lost"):
                self.cache.swap_out(seq_id)
            assert_same_snapshot(before, snapshot(self.cache), "swap_out() of a lost state")
            return
        try:
            self.cache.swap_out(seq_id)
        except OutOfBlocksError:
            assert_same_snapshot(before, snapshot(self.cache), "swap_out() refused")
            return
        self.swapped.add(seq_id)

    @rule(seq_id=seqs)
    def swap_in(self, seq_id):
        """Back into fresh blocks and a fresh slot, holding the state it left with."""
        if seq_id not in self.swapped:
            return
        before = snapshot(self.cache)
        try:
            self.cache.swap_in(seq_id)
        except OutOfBlocksError:
            assert_same_snapshot(before, snapshot(self.cache), "swap_in() refused")
            return
        self.swapped.discard(seq_id)
        self._assert_state(seq_id, "after swap_in()")

    @rule(data=st.data())
    def a_lost_state_is_refused(self, data):
        if not self.lost:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.lost)))
        before = snapshot(self.cache)
        with pytest.raises(PagedKVError, match="was lost"):
            self.cache.prepare({seq_id: 1})
        assert_same_snapshot(before, snapshot(self.cache), "a step of a lost state")

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def every_live_state_is_its_tokens(self):
        self.cache.check()
        assert set(self.cache.tables.seq_ids) == set(self.tokens)
        stats = self.cache.stats()
        assert stats.num_live_states == len(self.tokens) - len(self.swapped)
        assert stats.num_live_states + stats.num_checkpoints <= self.num_state_slots
        for seq_id, tokens in self.tokens.items():
            assert self.cache.tables.num_tokens_of(seq_id) == len(tokens)
            if seq_id not in self.lost and seq_id not in self.swapped:
                self._assert_state(seq_id, "after a rule")

    @invariant()
    def every_checkpoint_is_its_prefix(self):
        group = self.cache.groups[-1]
        for key, slot, position in group.slots.checkpoints():
            assert key in self.prefix_of, (
                f"a checkpoint after {position} tokens that no sequence computed")
            prefix = self.prefix_of[key]
            assert len(prefix) == position
            want = model_state(prefix, self.layers)
            for layer in self.layers:
                for got, expected in zip(self.cache.states(layer), want[layer], strict=True):
                    assert torch.equal(got[slot], expected), (
                        f"the checkpoint after {position} tokens holds another state")

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free(seq_id)
        self.cache.check()
        stats = self.cache.stats()
        assert stats.num_live_blocks == 0 and stats.num_live_states == 0


class MixedStateMachine(StateMachine):
    """Sliding windows, full attention and recurrent layers: a hit needs the window's
    blocks, the full group's and a checkpoint."""

    kinds = (LayerKind.sliding(3), LayerKind.full(), REC, LayerKind.sliding(3), REC)
    block_size = 2
    num_blocks = 60
    num_state_slots = 9


_SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestStateMachine = StateMachine.TestCase
TestStateMachine.settings = _SETTINGS
TestMixedStateMachine = MixedStateMachine.TestCase
TestMixedStateMachine.settings = settings(_SETTINGS, max_examples=30)
