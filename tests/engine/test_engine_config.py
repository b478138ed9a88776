"""`EngineConfig`: one object an `Engine` is built from. Every field is checked when it is
made (an error naming the field, before anything is built), and a part of the caller's own
plugs in through it with no edit of the engine."""

from __future__ import annotations

import dataclasses

import pytest

from paged_kv import CacheConfig
from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig, sizing
from paged_kv.engine import engine as engine_module
from paged_kv.engine.config import EngineConfig
from paged_kv.events import KVEventsConfig
from paged_kv.handoff import HandoffConfig
from paged_kv.parts import EnginePart, PartContext
from paged_kv.tiers import TierConfig
from paged_kv.tiers.manager import TierManager

CONFIG = TinyLlamaConfig(num_layers=2, hidden_size=64, intermediate_size=64, vocab_size=100,
                         num_heads=4, head_dim=16)
GREEDY = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(CONFIG, seed=1)


def pool(model, **overrides) -> CacheConfig:
    return model.cache_config(num_blocks=64, block_size=4, **overrides)


class Recorder(EnginePart):
    """Notes the hooks it sees (and, built by a factory, the context it was built from)."""

    wants_events = True

    def __init__(self, context: PartContext | None = None) -> None:
        self.context = context
        self.calls: list[str] = []

    def admit(self, request, handoff):
        self.calls.append("admit")

    def tick(self, scheduler):
        self.calls.append("tick")
        return []

    def observe_prefill(self, num_tokens, seconds):
        self.calls.append("observe_prefill")

    def finished(self, request):
        self.calls.append("finished")

    def after_step(self, events):
        self.calls.append("after_step")

    def text(self):
        return "# recorded\n"

    def close(self):
        self.calls.append("close")


# -- every field checked, naming it ---------------------------------------------------------
@pytest.mark.parametrize(("fields", "match"), [
    (dict(max_num_seqs=0), r"max_num_seqs: expected >= 1, got 0"),
    (dict(max_num_seqs=True), r"max_num_seqs: expected an int >= 1, got True"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens: expected >= 1, got 0"),
    (dict(max_num_batched_tokens=2.5), r"max_num_batched_tokens: expected an int >= 1"),
    (dict(preemption="drop"), r"preemption: expected 'recompute' or 'swap', got 'drop'"),
    (dict(memory_fraction=0), r"memory_fraction: expected a number in \(0, 1\]"),
    (dict(memory_fraction=1.5), r"memory_fraction: expected a number in \(0, 1\]"),
    (dict(num_threads=0), r"num_threads: expected >= 1, got 0"),
    (dict(num_threads="4"), r"num_threads: expected an int >= 1, got '4'"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size: expected >= 1, got 0"),
    (dict(tensor_parallel_size=2, kv_tiers=TierConfig(host_mib=8)),
     r"kv_tiers: not supported with tensor_parallel_size > 1"),
    (dict(tensor_parallel_size=2, handoff=HandoffConfig("prefill", secret="s")),
     r"handoff: not supported with tensor_parallel_size > 1"),
])
def test_a_bad_field_is_named(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**fields)


def test_fields_that_contradict_the_cache_are_named(model):
    with pytest.raises(ValueError, match=r"preemption='swap' needs cache.num_host_blocks > 0"):
        EngineConfig(cache=pool(model), preemption="swap")
    with pytest.raises(ValueError, match="memory_fraction: give it or cache, not both"):
        EngineConfig(cache=pool(model), memory_fraction=0.5)
    assert EngineConfig(cache=pool(model, num_host_blocks=8), preemption="swap").cache


@pytest.mark.parametrize(("fields", "match"), [
    (dict(cache={"num_blocks": 8}), r"cache: expected CacheConfig or None, got dict"),
    (dict(kv_tiers="host"), r"kv_tiers: expected TierConfig or None, got str"),
    (dict(kv_events="tcp://*:5557"), r"kv_events: expected KVEventsConfig or None, got str"),
    (dict(handoff="prefill"), r"handoff: expected HandoffConfig or None, got str"),
    (dict(parts=(Recorder(), 3)), r"parts\[1\]: expected an EnginePart or a callable"),
])
def test_a_config_of_the_wrong_type_is_named(fields, match):
    with pytest.raises(TypeError, match=match):
        EngineConfig(**fields)


def test_the_engine_takes_only_an_engine_config(model):
    with pytest.raises(TypeError, match=r"config: expected EngineConfig, got CacheConfig"):
        Engine(model, pool(model))


def test_a_sized_pool_is_checked_before_anything_is_built(model, monkeypatch):
    """Without a cache the pool is sized from the free memory, then checked again: a swap
    needs a host pool the sized one lacks, and nothing is built before that is known."""
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 1 << 20)
    built = []
    monkeypatch.setattr(engine_module, "PagedKVCache", lambda config: built.append(config))
    with pytest.raises(ValueError, match=r"preemption='swap' needs cache.num_host_blocks"):
        Engine(model, EngineConfig(preemption="swap"))
    assert built == []


def test_no_config_is_every_default(model, monkeypatch):
    per_block = model.cache_config(num_blocks=2).bytes_per_block
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 100 * per_block)
    engine = Engine(model)
    assert engine.cache.config.num_blocks == 90  # 0.9 of the free memory
    assert engine.config == dataclasses.replace(EngineConfig(), cache=engine.cache.config)
    assert engine.parts == [] and engine.tiers is engine.events is engine.handoff is None
    assert len(engine.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 3


def test_the_config_is_frozen_and_keeps_its_parts_as_a_tuple():
    config = EngineConfig(parts=[Recorder()])
    assert isinstance(config.parts, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 2  # type: ignore[misc]


# -- a part of the caller's own, through the config ----------------------------------------
def test_a_part_given_in_the_config_has_its_hooks_called(model):
    part = Recorder()
    engine = Engine(model, EngineConfig(cache=pool(model), parts=(part,)))
    assert engine.parts == [part] and engine.part("parts[0]") is part
    engine.generate([[1, 2, 3, 4, 5]], GREEDY)
    assert part.calls[0] == "admit"
    assert {"tick", "observe_prefill", "after_step", "finished"} <= set(part.calls)
    assert engine.metrics_text().endswith("# recorded\n")
    engine.close()
    assert part.calls[-1] == "close"


def test_a_factory_builds_its_part_from_the_engine_and_the_parts_before_it(model):
    """A factory gets the cache, the model and the parts built before it (here the tiers);
    its part's hooks come after the built-in parts' ones."""
    engine = Engine(model, EngineConfig(cache=pool(model), kv_tiers=TierConfig(host_mib=4),
                                        parts=(Recorder, lambda context: None)))
    try:
        [tiers, part] = engine.parts
        assert isinstance(tiers, TierManager) and engine.tiers is tiers
        assert part.context.cache is engine.cache and part.context.model is engine.model
        assert dict(part.context.parts) == {"tiers": tiers}
        assert engine.part("parts[1]") is None, "a factory's None: no part"
        engine.generate([[1, 2, 3]], GREEDY)
        assert "after_step" in part.calls
    finally:
        engine.close()


def test_a_part_that_fails_to_build_closes_the_parts_built_before_it(model):
    first = Recorder()
    with pytest.raises(TypeError, match=r"parts\[1\]: its factory returned str"):
        Engine(model, EngineConfig(cache=pool(model), parts=(first, lambda context: "part")))
    assert first.calls == ["close"]

    def broken(context):
        raise RuntimeError("cannot start")

    second = Recorder()
    with pytest.raises(RuntimeError, match="cannot start"):
        Engine(model, EngineConfig(cache=pool(model), parts=(second, broken)))
    assert second.calls == ["close"]


def test_the_built_in_parts_are_named_in_hook_order():
    config = EngineConfig(kv_tiers=TierConfig(host_mib=4),
                          kv_events=KVEventsConfig("tcp://127.0.0.1:*"),
                          handoff=HandoffConfig("prefill", secret="s"), parts=(Recorder(),))
    assert list(config.part_factories()) == ["tiers", "events", "handoff", "parts[0]"]
    decode = EngineConfig(handoff=HandoffConfig("decode", secret="s"))
    assert list(decode.part_factories()) == ["tiers", "handoff"], "a decode engine's tiers"
    assert EngineConfig(kv_tiers=TierConfig()).part_factories() == {}, "no tier configured"
