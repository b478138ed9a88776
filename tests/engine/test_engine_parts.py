"""An engine's optional parts (`paged_kv.parts.EnginePart`): a new part is one class, and
the engine calls each of its hooks at its point in a request's life and a step's."""

from __future__ import annotations

from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.events.publisher import EventPublisher
from paged_kv.parts import EnginePart
from paged_kv.tiers.manager import TierManager

CONFIG = TinyLlamaConfig(num_layers=2, hidden_size=64, intermediate_size=64, vocab_size=100,
                         num_heads=4, head_dim=16)


class Recorder(EnginePart):
    """Notes every hook's call; fails a request whose first token is `refuse`."""

    wants_events = True

    def __init__(self, refuse: int = -1) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def admit(self, request, handoff):
        self.calls.append(("admit", request.request_id, handoff))
        return "refused by the part" if request.prompt_token_ids[0] == self.refuse else None

    def tick(self, scheduler):
        self.calls.append(("tick",))
        return []

    def observe_prefill(self, num_tokens, seconds):
        assert seconds >= 0
        self.calls.append(("observe_prefill", num_tokens))

    def finished(self, request):
        self.calls.append(("finished", request.request_id))

    def after_step(self, events):
        self.calls.append(("after_step", len(events)))

    def forget(self, request):
        self.calls.append(("forget", request.request_id))

    def text(self):
        return "# the recorder's metrics\n"

    def close(self):
        self.calls.append(("close",))


def engine() -> Engine:
    model = TinyLlama(CONFIG, seed=1)
    return Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64, block_size=4)))


def test_every_hook_is_called_at_its_point():
    e, part = engine(), Recorder()
    e.parts.append(part)
    [out] = e.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=3, temperature=0))
    names = [call[0] for call in part.calls]
    assert part.calls[0] == ("admit", out.request_id, None)
    assert ("observe_prefill", 6) in part.calls  # the prompt's step ran six tokens
    assert {"tick", "after_step"} <= set(names)
    assert names.index("tick") < names.index("observe_prefill") < names.index("after_step")
    assert names.count("finished") == 1 and ("finished", out.request_id) in part.calls
    assert any(n for name, *n in part.calls if name == "after_step" and n[0] > 0)
    assert e.metrics_text().endswith("# the recorder's metrics\n")
    rid = e.add_request([7, 8, 9], SamplingParams(max_tokens=50))
    assert e.abort(rid) and ("forget", rid) in part.calls
    e.close()
    assert part.calls[-1] == ("close",)


def test_a_part_that_refuses_a_request_fails_it_alone():
    e, part = engine(), Recorder(refuse=42)
    e.parts.append(part)
    outs = e.generate([[42, 1, 2], [3, 4, 5]], SamplingParams(max_tokens=2, temperature=0))
    assert outs[0].outputs[0].finish_reason == "error"
    assert "refused by the part" in (outs[0].error or "")
    assert outs[1].outputs[0].finish_reason != "error" and len(outs[1].outputs[0].token_ids) == 2
    assert ("forget", outs[0].request_id) in part.calls
    e.close()


def test_the_engines_own_parts_are_engine_parts():
    """The tiers, the publisher and both hand-off roles plug in through the same hooks."""
    from paged_kv.handoff.peer import DecodeRole
    from paged_kv.handoff.prefill import PrefillRole

    for kind in (TierManager, EventPublisher, PrefillRole, DecodeRole):
        assert issubclass(kind, EnginePart), kind
    assert TierManager.wants_events and EventPublisher.wants_events
    assert not PrefillRole.wants_events and not DecodeRole.wants_events
