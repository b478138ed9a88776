"""The recurrent state group by example: the config, the slab, each rule of a prefix hit
with state (rounded down to a checkpoint, the zero state at 0, copied on admission and on
fork), running out of state slots (nothing changes), the checkpoint policy's order, a
failed step's checkpoints, and the refusals, each named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_kv import CacheConfig, LayerKind, OutOfBlocksError, PagedKVCache, PagedKVError
from paged_kv.config import StateSpec, group_layers
from paged_kv.core.cache import snapshot
from paged_kv.core.groups.checkpoints import DENSE, INTERVAL, LATEST, SHARED, CheckpointPolicy
from paged_kv.core.groups.rules import group_key
from paged_kv.core.groups.state import OutOfStateSlotsError, StateSlots
from paged_kv.integrations.recurrent import StateSpec as ReExported

from ..conftest import assert_same_snapshot

CONV = StateSpec("conv", (3, 2), torch.bfloat16)
SSM = StateSpec("ssm", (2, 3), torch.float32)
REC = LayerKind.recurrent((CONV, SSM))
FULL, W8 = LayerKind(), LayerKind.sliding(8)
BS = 4


def _cache(kinds=(REC, FULL, REC), slots: int = 8, num_blocks: int = 40, **overrides,
           ) -> PagedKVCache:
    fields = dict(num_layers=len(kinds), num_kv_heads=1, head_dim=4, block_size=BS,
                  num_blocks=num_blocks, dtype=torch.float32, layer_kinds=kinds,
                  num_state_slots=slots)
    fields.update(overrides)
    return PagedKVCache(CacheConfig(**fields))


def _recurrent(cache: PagedKVCache) -> list[int]:
    return list(cache.config.recurrent_layers)


def _fill(cache: PagedKVCache, shape_of, value: float) -> tuple:
    return tuple(torch.full(shape_of(spec), value, dtype=spec.dtype)
                 for spec in (CONV, SSM))


def _write(cache: PagedKVCache, batch, final: float, emitted: list[float]) -> None:
    """The model's part of a step: `final` everywhere in each row's live slot, and
    ``emitted[e]`` in the e-th checkpoint the batch saves."""
    states = batch.groups[-1]
    for layer in _recurrent(cache):
        final_states = _fill(cache, lambda s: (states.batch_size, *s.shape), final)
        emitted_states = tuple(torch.stack([torch.full(s.shape, v, dtype=s.dtype)
                                            for v in emitted]) if emitted
                               else torch.empty(0, *s.shape, dtype=s.dtype)
                               for s in (CONV, SSM))
        cache.write_states(layer, batch, final_states, emitted_states)


def _run(cache: PagedKVCache, seq_id: str, prompt: list[int], final: float) -> None:
    """Admit `seq_id` with its whole prompt and write its states: `final` in its live
    slot, and in each checkpoint the batch saves the boundary's token count."""
    _, batch = cache.admit(seq_id, prompt)
    _write(cache, batch, final, [float(t + 1) for t in batch.groups[-1].emit_tokens.tolist()])


def _live(cache: PagedKVCache, seq_id: str, layer: int | None = None) -> tuple:
    """The live states of `seq_id` in `layer` (default: the first recurrent one)."""
    group = cache.groups[-1]
    slot = int(group.slots.live_of([cache.tables.row_of[seq_id]])[0])
    layer = _recurrent(cache)[0] if layer is None else layer
    return tuple(t[slot] for t in cache.states(layer))


def _key(cache: PagedKVCache, seq_id: str, column: int) -> bytes:
    """The prefix key of `seq_id`'s block `column` (its leading group's)."""
    return cache.allocator.block_hash(int(cache.tables.blocks(seq_id)[column]))


def _value(states: tuple) -> float:
    """The one value every element of `states` holds (they were filled with it)."""
    values = {float(v) for t in states for v in t.flatten().tolist()}
    assert len(values) == 1, values
    return values.pop()


# -- the config ---------------------------------------------------------------------------
def test_a_recurrent_kind_needs_states_and_no_span():
    assert str(REC) == "recurrent" and REC.is_recurrent and not REC.is_full
    assert REC.state_bytes == 3 * 2 * 2 + 2 * 3 * 4
    with pytest.raises(ValueError, match="at least one StateSpec"):
        LayerKind.recurrent(())
    with pytest.raises(ValueError, match="no span"):
        LayerKind("recurrent", 4, (SSM,))
    with pytest.raises(ValueError, match="keeps no recurrent state"):
        LayerKind("full", 0, (SSM,))
    with pytest.raises(ValueError, match="shape"):
        StateSpec("ssm", (2, 0), torch.float32)
    assert ReExported is StateSpec  # the integration re-exports the config's


def test_recurrent_layers_are_one_last_group_that_does_not_size_the_others():
    kinds = (REC, REC, REC, FULL, REC, REC, REC, FULL, W8, W8)
    groups = group_layers(kinds)
    assert [(str(kind), layers) for kind, layers in groups] == [
        ("full", (3, 7)), ("sliding:8", (8, 9)), ("recurrent", (0, 1, 2, 4, 5, 6))]
    with pytest.raises(ValueError, match="recurrent layers only is not supported yet"):
        group_layers((REC, REC))


def test_the_slab_is_counted_in_the_config_and_sized_once():
    config = _cache().config
    assert config.group_size == 1 and config.num_attention_layers == 1
    plain = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS,
                        num_blocks=40, dtype=torch.float32)
    assert config.bytes_per_block == plain.bytes_per_block  # no block-size inflation
    assert config.state_bytes_per_slot == 2 * REC.state_bytes
    assert config.total_bytes == plain.total_bytes + 8 * config.state_bytes_per_slot
    cache = _cache()
    assert cache.pool.nbytes + cache.stats().state_bytes == config.total_bytes
    assert cache.stats().total_bytes == config.total_bytes
    for layer in (0, 2):
        conv, ssm = cache.states(layer)
        assert conv.shape == (8, 3, 2) and conv.dtype == torch.bfloat16
        assert ssm.shape == (8, 2, 3) and ssm.dtype == torch.float32
        assert not conv.any() and not ssm.any()
    sized = CacheConfig.for_memory(config.total_bytes, num_layers=3, num_kv_heads=1,
                                   head_dim=4, block_size=BS, dtype=torch.float32,
                                   layer_kinds=config.layer_kinds, num_state_slots=8)
    assert sized.num_blocks == 40


def test_state_slots_are_asked_for_exactly_when_there_are_recurrent_layers():
    with pytest.raises(ValueError, match=r"num_state_slots.*expected >= 1"):
        _cache(slots=0)
    with pytest.raises(ValueError, match=r"num_state_slots.*expected 0"):
        _cache(kinds=(FULL, W8), slots=2)


# -- prefix hits and their states ---------------------------------------------------------
def test_a_hit_rounds_down_to_the_last_checkpoint_and_copies_it():
    """Three slots: the first sequence's live state and two checkpoints (after blocks 0
    and 1); its third boundary finds no slot. A repeat of its prompt hits 8 tokens, not
    the 12 the attention blocks hold, and starts from the state saved after token 7."""
    cache = _cache(slots=3)
    prompt = list(range(13))
    _run(cache, "a", prompt, final=99.0)
    cache.free("a")
    cache.check()
    assert cache.stats().num_checkpoints == 2
    hit, batch = cache.admit("b", prompt)
    assert hit == 8
    for layer in _recurrent(cache):
        assert _value(_live(cache, "b", layer)) == 8.0  # the state after 8 tokens
        assert [_value(s) for s in zip(*cache.read_states(layer, batch), strict=True)] == [8.0]
    stats = cache.stats()
    assert stats.num_checkpoints == 2 and stats.checkpoints_hit == 1  # it stays cached
    cache.check()


def test_an_admission_asks_blocks_of_the_attention_groups_only():
    """The state group holds no block: an admission of a 13-token prompt over one full
    and two recurrent layers asks the full group's 4 blocks, not 4 per group (the
    scheduler then never admitted a prompt that filled half the pool, and waited
    forever)."""
    cache = _cache()
    plan = cache.plan_admission("a", list(range(13)))
    assert plan.requested == 4
    cache.admit("b", list(range(13)))
    assert cache.stats().num_live_blocks == 4
    cache.check()


def test_no_checkpoint_no_hit_and_the_zero_state():
    """Without a checkpoint a prompt starts from zeros whatever its attention blocks hit,
    even in a slot whose last owner left a state in it."""
    cache = _cache(slots=1)  # the live slot alone: never a checkpoint
    _run(cache, "a", list(range(9)), final=5.0)
    cache.free("a")
    assert cache.stats().num_checkpoints == 0 and cache.stats().num_cached_blocks == 2
    hit, _ = cache.admit("b", list(range(9)))
    assert hit == 0
    assert _value(_live(cache, "b")) == 0.0


def test_a_pending_checkpoint_is_not_served():
    """A checkpoint is taken when its step commits, before its forward writes it: a
    sequence admitted meanwhile does not start from it (it starts from zeros), and is
    served it once the last recurrent layer wrote it (or the writer's next step shows its
    forward ran)."""
    cache = _cache()
    prompt = list(range(9))
    _, batch = cache.admit("a", prompt)
    assert cache.add_sequence("b", prompt) == 0  # a's checkpoints are pending
    _write(cache, batch, 1.0, [float(t + 1) for t in batch.groups[-1].emit_tokens.tolist()])
    assert cache.add_sequence("c", prompt) == 8
    assert _value(_live(cache, "c")) == 8.0
    cache.free("c")
    _, batch = cache.admit("d", [7] * 9)
    cache.prepare({"d": [42]})  # its next step: the forward ran
    assert cache.add_sequence("e", [7] * 9) == 8
    cache.check()


def test_written_checkpoints_are_evictable_before_the_next_step():
    """A step whose filled blocks took every free slot as checkpoints: once written they
    give way to the next admission's live state (else it found no slot)."""
    cache = _cache(slots=3)
    _run(cache, "a", list(range(13)), final=1.0)  # live + 2 checkpoints: the slab is full
    assert cache.stats().num_checkpoints == 2
    cache.add_sequence("b", [50, 51])
    assert cache.stats().num_checkpoints == 1
    cache.check()


def test_a_full_sliding_recurrent_hit_needs_every_group():
    cache = _cache(kinds=(REC, FULL, W8, REC), slots=6)
    prompt = list(range(17))
    _run(cache, "a", prompt, final=3.0)
    cache.free("a")
    hit, _ = cache.admit("b", prompt)
    assert hit == 16 and _value(_live(cache, "b")) == 16.0
    cache.check()


def test_emitted_tokens_are_the_last_token_of_each_filled_block_in_packed_order():
    cache = _cache()
    cache.admit("a", [1, 2])
    cache.admit("b", [11, 12, 13, 14, 15, 16])  # block 0 filled and checkpointed here
    batch = cache.prepare({"a": [3, 4, 5, 6, 7, 8, 9], "b": [17, 18, 19]})
    states = batch.groups[-1]
    # a: 2 -> 9 tokens fills blocks 0 and 1 (tokens 3 and 7 of it: packed 1 and 5);
    # b: 6 -> 9 fills block 1 (its token 7: packed 7 + 1)
    assert states.emit_tokens.tolist() == [1, 5, 8]
    assert states.batch_size == 2 and states.num_emitted == 3
    assert len(set(states.emit_slots.tolist()) | set(states.slots.tolist())) == 5


# -- fork, free, truncate -------------------------------------------------------------------
def test_a_fork_copies_the_state_into_a_slot_of_its_own():
    cache = _cache()
    _run(cache, "a", [1, 2, 3], final=7.0)
    cache.fork("a", "b")
    assert _value(_live(cache, "b")) == 7.0
    batch = cache.prepare({"b": [4]})  # fills block 0: a checkpoint after it
    _write(cache, batch, 2.0, [4.0])
    assert _value(_live(cache, "a")) == 7.0 and _value(_live(cache, "b")) == 2.0
    cache.check()


def test_free_returns_the_live_slot_and_keeps_the_checkpoints():
    cache = _cache()
    _run(cache, "a", list(range(9)), final=1.0)
    cache.free("a")
    stats = cache.stats()
    assert stats.num_live_states == 0 and stats.num_checkpoints == 2
    assert stats.checkpoints_written == 2
    assert stats.checkpoint_bytes == 2 * cache.config.state_bytes_per_slot


def test_truncate_restores_a_checkpoint_or_refuses_by_name():
    cache = _cache()
    _run(cache, "a", list(range(13)), final=1.0)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="no state checkpoint at 6"):
        cache.truncate("a", 6)
    assert_same_snapshot(before, snapshot(cache), "refused truncate()")
    cache.truncate("a", 8)
    assert _value(_live(cache, "a")) == 8.0
    cache.truncate("a", 0)
    assert _value(_live(cache, "a")) == 0.0
    cache.check()


def test_a_failed_step_drops_its_checkpoints_and_loses_a_state_it_cannot_restore():
    cache = _cache()
    _run(cache, "a", list(range(6)), final=1.0)  # a checkpoint after 4 tokens
    _run(cache, "b", list(range(100, 108)), final=1.0)  # ... after 4 and 8
    written = cache.stats().checkpoints_written
    batch = cache.prepare({"a": [6, 7, 8, 9, 10, 11, 12], "b": [108, 109, 110, 111]})
    assert batch.groups[-1].num_emitted == 3  # after 8 (a), 12 (a) and 12 (b)
    # a forward that failed half-way: its first recurrent layer wrote garbage
    states, first = batch.groups[-1], _recurrent(cache)[0]
    cache.write_states(first, batch, _fill(cache, lambda s: (states.batch_size, *s.shape), -5.0),
                       _fill(cache, lambda s: (states.num_emitted, *s.shape), -5.0))
    cache.truncate("a", 6, unwritten=True)
    cache.truncate("b", 8, unwritten=True)
    assert cache.stats().checkpoints_written == written
    assert _value(_live(cache, "b")) == 8.0  # restored from its checkpoint at 8
    before = snapshot(cache)
    with pytest.raises(PagedKVError, match="recurrent state of 'a' was lost"):
        cache.prepare({"a": [6]})
    with pytest.raises(PagedKVError, match="recurrent state of 'a' was lost"):
        cache.fork("a", "a2")
    assert_same_snapshot(before, snapshot(cache), "refused step of a lost state")
    cache.prepare({"b": [108]})
    cache.free("a")
    cache.check()


# -- running out of state slots -------------------------------------------------------------
def test_out_of_state_slots_is_named_and_changes_nothing():
    cache = _cache(slots=1)
    cache.admit("a", [1, 2, 3])
    before = snapshot(cache)
    for call in (lambda: cache.admit("b", [4, 5]), lambda: cache.add_sequence("b", [4]),
                 lambda: cache.fork("a", "b")):
        with pytest.raises(OutOfBlocksError, match="out of state slots") as info:
            call()
        assert isinstance(info.value, OutOfStateSlotsError)
        assert_same_snapshot(before, snapshot(cache), "out of state slots")
    cache.check()


def test_an_admission_never_evicts_the_checkpoint_it_copies_from():
    cache = _cache(slots=2)
    _run(cache, "a", list(range(6)), final=1.0)  # its live slot and one checkpoint
    cache.prepare({"a": [6]})  # the checkpoint is written now
    before = snapshot(cache)
    with pytest.raises(OutOfStateSlotsError):
        cache.admit("b", list(range(6)))  # would copy the only evictable slot
    assert_same_snapshot(before, snapshot(cache), "out of state slots")
    cache.admit("c", [50, 51])  # another prompt may evict it
    assert cache.stats().checkpoints_evicted == 1 and cache.stats().num_checkpoints == 0
    cache.check()


def test_under_pressure_interior_boundaries_go_first_and_a_finished_tail_stays():
    """Three slots, one live: a's newest boundary is LATEST, those before it DENSE; under
    pressure a new boundary evicts the least recently used DENSE one, never a tail of a
    finished request (LATEST) while a DENSE one is left."""
    cache = _cache(slots=3)
    _run(cache, "a", list(range(9)), final=1.0)  # checkpoints after 4 (DENSE), 8 (LATEST)
    cache.prepare({"a": list(range(9, 13))})  # after 12: evicts the DENSE one after 4
    group = cache.groups[-1]
    assert cache.stats().checkpoints_evicted == 1
    cache.free("a")
    held = {group.slots.position_of(s): group.slots.policy.tier_of(s) for s in range(3)
            if s in group.slots.policy}
    assert held == {8: DENSE, 12: LATEST}  # a's tail: its next turn starts there
    _, batch = cache.admit("b", [70, 71, 72, 73, 74])  # b's boundary after 4 evicts 8
    assert batch.groups[-1].num_emitted == 1
    row = cache.tables.row_of["b"]  # pending: its forward has not run
    assert group.slots.find(group_key(_key(cache, "b", 0), group.index), row) is not None
    cache.check()


def test_a_junction_is_kept_as_shared_and_a_served_checkpoint_as_latest():
    """Two prompts sharing 2 blocks: the first's checkpoint after them is gone, so the
    second hits its attention blocks but no state: it checkpoints that junction, shared,
    and a third prompt hits it. A checkpoint served to a hit (an interior one, DENSE)
    rises to LATEST: served once, as a conversation's last tail is, not shared."""
    cache = _cache(slots=6)
    shared = list(range(8))
    _run(cache, "a", [*shared, 90, 91, 92, 93, 94], final=1.0)
    group = cache.groups[-1]
    junction = group.slots.find(group_key(_key(cache, "a", 1), group.index))
    group.slots._evict(junction)  # as pressure would have (its slot is free again)
    group.slots._free.append(junction)
    cache.free("a")
    hit, batch = cache.admit("b", [*shared, 50, 51, 52, 53, 54])
    assert hit == 4  # the attention blocks hit 8; the state only 4
    assert group.junction == {cache.tables.row_of["b"]: 8}
    _write(cache, batch, 2.0, [float(t + 1) for t in batch.groups[-1].emit_tokens.tolist()])
    tiers = {group.slots.position_of(s): group.slots.policy.tier_of(s) for s in range(6)
             if s in group.slots.policy}
    assert tiers[8] == SHARED and tiers[4] == LATEST  # the junction; the one served
    assert cache.admit("c", [*shared, 7, 7, 7, 7, 7])[0] == 8
    cache.check()


def test_the_policy_evicts_the_lowest_tier_then_the_least_recently_used():
    policy = CheckpointPolicy()
    for slot, tier in ((0, SHARED), (1, DENSE), (2, LATEST), (3, DENSE)):
        policy.add(slot, tier)
    assert policy.victim() == 1  # DENSE, the older of the two
    policy.touch(1)
    assert policy.victim() == 3 and policy.victim(exclude=3) == 1
    assert policy.admits(DENSE, 3) and not policy.admits(DENSE, 0)
    policy.retier(3, SHARED)
    assert policy.victim() == 1 and policy.tier_of(3) == SHARED
    policy.remove(1)
    assert policy.victim() == 2 and len(policy) == 3


def test_slots_offer_densely_then_by_tier():
    slots = StateSlots(3)
    slots.take_live(0)
    assert slots.offer(b"k4", 4, row=0) is not None
    assert slots.offer(b"k4", 4, row=0) is None  # indexed already
    assert slots.offer(b"k8", 8, row=0) is not None
    assert slots.offer(b"k12", 12, row=0) is None  # both pending: nothing evictable
    slots.confirm([0])
    assert slots.offer(b"k12", 12, row=0) is not None and slots.num_evicted == 1
    assert slots.find(b"k4") is None and slots.find(b"k8") is not None  # k4 was DENSE
    slots.check([0])


# -- refusals -------------------------------------------------------------------------------
def test_swap_moves_the_live_state_to_the_host_and_back():
    """The state leaves its slot with the blocks (the slot goes free) and comes back into
    a fresh one, unchanged; past num_state_slots host copies a swap-out is refused as out
    of blocks (the scheduler then recomputes), changing nothing."""
    cache = _cache(slots=2, num_host_blocks=16)
    for seq_id, final in (("a", 5.0), ("b", 6.0)):
        _, batch = cache.admit(seq_id, [1, 2, 3])
        _write(cache, batch, final, [])
    cache.swap_out("a")
    cache.check()
    assert cache.stats().num_live_states == 1
    _, batch = cache.admit("c", [4, 5])  # takes the slot "a" gave up
    _write(cache, batch, 7.0, [])
    cache.swap_out("b")
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError, match="host state copies"):
        cache.swap_out("c")
    assert_same_snapshot(before, snapshot(cache), "refused swap_out()")
    cache.admit("d", [6])  # the slot "b" gave up: none left to swap into
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError, match="state slots"):
        cache.swap_in("a")
    assert_same_snapshot(before, snapshot(cache), "refused swap_in()")
    cache.free("c")
    cache.free("d")
    cache.swap_in("a")
    cache.swap_in("b")
    assert _value(_live(cache, "a")) == 5.0 and _value(_live(cache, "b")) == 6.0
    cache.free("a")
    cache.check()
    assert cache.stats().num_live_states == 1


def test_kv_calls_on_a_recurrent_layer_and_state_calls_on_an_attention_one_are_refused():
    cache = _cache()
    _, batch = cache.admit("a", [1, 2, 3])
    with pytest.raises(ValueError, match="layer 0 is recurrent"):
        cache.write(0, torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), batch)
    with pytest.raises(ValueError, match="layer 2 is recurrent"):
        cache.gather(2, ["a"])
    with pytest.raises(ValueError, match="layer 1 is full attention"):
        cache.states(1)
    with pytest.raises(ValueError, match="no recurrent-state entry"):
        cache.read_states(0, dataclasses.replace(batch, groups=batch.groups[:1]))


def test_write_states_checks_every_tensor_before_writing_any():
    cache = _cache()
    _, batch = cache.admit("a", [1, 2, 3, 4, 5])  # saves one checkpoint
    good = _fill(cache, lambda s: (1, *s.shape), 1.0)
    before = snapshot(cache)
    bad_calls = {
        "expected a tuple of 2 tensors": (good[:1], good),
        r"final\['ssm'\]: expected dtype torch.float32": ((good[0], good[1].double()), good),
        r"emitted\['conv'\]: expected shape \(1, 3, 2\)": (good, (good[0][:0], good[1])),
        "saves 1 state checkpoints": (good, None),
    }
    for message, (final, emitted) in bad_calls.items():
        with pytest.raises((TypeError, ValueError), match=message):
            cache.write_states(0, batch, final, emitted)
    assert_same_snapshot(before, snapshot(cache), "refused write_states()")
    cache.write_states(0, batch, good, good)
    assert _value(_live(cache, "a", 0)) == 1.0


def test_interior_boundaries_on_the_sparse_interval_outlive_the_others():
    """Interval 8 tokens: of a's interior boundaries (4, 8, 12), the one after 8 is kept
    at the INTERVAL tier when a newer one supersedes it; 4 and 12 drop to DENSE."""
    slots = StateSlots(6, interval=8)
    slots.take_live(0)
    for position in (4, 8, 12, 16):
        slots.offer(b"k%d" % position, position, row=0)
    slots.confirm([0])
    tiers = {position: slots.policy.tier_of(slots.find(b"k%d" % position))
             for position in (4, 8, 12, 16)}
    assert tiers == {4: DENSE, 8: INTERVAL, 12: DENSE, 16: LATEST}
    slots.check([0])
