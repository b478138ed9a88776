"""KV events of a model with recurrent layers: its state checkpoints reach a router.

A recurrent layer's prompt is served from a prefix only where a state checkpoint sits after
its last block (`paged_kv.core.groups.state_group`), so a router that counted a hybrid
replica's attention blocks alone would send it prompts it computes from scratch. The
publisher sends each checkpoint as a ``BlockStored`` / ``BlockRemoved`` of its state group
(vLLM's ``group_idx`` and ``kv_cache_spec_kind`` ``"mamba"``) and opens every batch of such
a replica with the group's declaration; `PrefixIndex` then matches that replica only up to
its deepest checkpoint. Checked over real ZMQ on loopback (free ports, bounded waits), and
against an engine serving a tiny Bamba (Mamba-2 beside attention): what the index claims is
what the engine then serves.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from paged_kv.events import KVEventsConfig, to_wire
from paged_kv.events.publisher import EventPublisher
from paged_kv.events.subscriber import EventSubscriber
from paged_kv.keys import BlockEvent, block_keys, encode_tokens, root_hash
from paged_kv.router import PrefixIndex, prompt_keys

from .test_kv_events import ANY, _drain, _sub, _until

BLOCK = 4
STATE = 2  # the state group's number (a key's 33rd byte), as a 3-group hybrid has it
TOKENS = np.arange(100, 100 + 5 * BLOCK)  # five full blocks
KEYS = block_keys(TOKENS, BLOCK, root_hash())
DECLARED = ["BlockStored", [], None, [], BLOCK, None, "GPU", None, None, STATE, "mamba"]


def checkpoint(i: int) -> bytes:
    """The key of the checkpoint after block `i` (`rules.group_key`)."""
    return KEYS[i] + bytes([STATE])


def stored_blocks() -> BlockEvent:
    return BlockEvent("stored", tuple(range(5)), tuple(KEYS), (root_hash(), *KEYS[:-1]),
                      encode_tokens(TOKENS))


def state_event(kind: str, *blocks: int) -> BlockEvent:
    keys = tuple(checkpoint(i) for i in blocks)
    parents = tuple(KEYS[i] for i in blocks) if kind == "state_stored" else ()
    return BlockEvent(kind, tuple(range(len(blocks))), keys, parents)


def test_a_checkpoint_is_a_store_of_its_state_group_and_every_batch_declares_it():
    """vLLM's array positions: group_idx 9, kv_cache_spec_kind 10 ("mamba"); no parent
    and no tokens of its own; the declaration (a store of no blocks) leads the batch."""
    events = [stored_blocks(), state_event("state_stored", 1, 4),
              state_event("state_removed", 1), BlockEvent("cleared", ())]
    wire = to_wire(events, block_size=BLOCK, state_groups=(STATE,))
    assert wire[0] == DECLARED
    assert wire[1][:2] == ["BlockStored", KEYS] and len(wire[1]) == 7  # blocks: unchanged
    assert wire[2] == ["BlockStored", [checkpoint(1), checkpoint(4)], None, [], BLOCK, None,
                       "GPU", None, None, STATE, "mamba"]
    assert wire[3] == ["BlockRemoved", [checkpoint(1)], "GPU", STATE]
    assert wire[4] == ["AllBlocksCleared"]
    # an attention-only model's batches are what they were, declaration-free
    assert to_wire([stored_blocks()], block_size=BLOCK) == wire[1:2]
    assert to_wire([BlockEvent("allocated", (1,))], block_size=BLOCK,
                   state_groups=(STATE,)) == []  # nothing to say: no declaration alone


@pytest.fixture
def replicas():
    """``(publish, indexes, subscribe)``: a hybrid replica's publisher and an attention-only
    one's, each followed by a subscriber into one `PrefixIndex` (``indexes[0]``);
    `subscribe` starts another follower of the hybrid one into a fresh index."""
    hybrid = EventPublisher(KVEventsConfig(ANY, ANY), block_size=BLOCK, state_groups=(STATE,))
    plain = EventPublisher(KVEventsConfig(ANY, ANY), block_size=BLOCK)
    index = PrefixIndex()
    raw = _sub(hybrid.endpoint)
    subscribers = []

    def follow(publisher: EventPublisher, name: str, into: PrefixIndex) -> EventSubscriber:
        subscriber = EventSubscriber(
            publisher.endpoint, replay_endpoint=publisher.replay_endpoint,
            on_batch=lambda stamp, events: into.apply(name, events),
            on_reset=lambda: into.clear(name))
        subscribers.append(subscriber)
        return subscriber

    followers = {"hybrid": follow(hybrid, "hybrid", index),
                 "plain": follow(plain, "plain", index)}
    time.sleep(0.3)  # the subscriptions reach the publishers before anything is sent

    def publish(*events: BlockEvent) -> None:
        """Publish `events` at the hybrid replica (its blocks at the plain one too), and
        wait until both followers applied everything."""
        hybrid.publish(list(events))
        plain.publish([event for event in events if not event.kind.startswith("state")])
        for publisher, name in ((hybrid, "hybrid"), (plain, "plain")):
            _until(lambda p=publisher, n=name: followers[n].counts["batches"]
                   == p.num_batches)

    def subscribe() -> PrefixIndex:
        late = PrefixIndex()
        subscriber = follow(hybrid, "hybrid", late)
        _until(lambda: subscriber.counts["batches"] == hybrid.num_batches)
        return late

    try:
        yield publish, index, subscribe, raw
    finally:
        for subscriber in subscribers:
            subscriber.close()
        raw.close(0)
        hybrid.close()
        plain.close()


def test_a_hybrid_replica_matches_up_to_its_deepest_checkpoint(replicas):
    publish, index, subscribe, raw = replicas
    both = ["hybrid", "plain"]

    publish(stored_blocks())  # blocks, no checkpoint yet: the declaration says enough
    assert index.state_groups("hybrid") == {STATE} and index.state_groups("plain") == set()
    assert index.match(KEYS, both) == {"hybrid": 0.0, "plain": 5.0}

    publish(state_event("state_stored", 1, 3))  # after blocks 2 and 4
    assert index.checkpoints_of("hybrid") == {checkpoint(1), checkpoint(3)}
    assert index.match(KEYS, both) == {"hybrid": 4.0, "plain": 5.0}
    assert index.match(KEYS[:3], both) == {"hybrid": 2.0, "plain": 3.0}

    publish(state_event("state_removed", 3))  # evicted: its state is no longer claimed
    assert index.match(KEYS, both) == {"hybrid": 2.0, "plain": 5.0}

    # the blocks go; the cache keeps its checkpoints, which serve again with the blocks
    publish(BlockEvent("cleared", ()))
    assert index.match(KEYS, both) == {"hybrid": 0.0, "plain": 0.0}
    assert index.checkpoints_of("hybrid") == {checkpoint(1)}
    publish(stored_blocks())
    assert index.match(KEYS, both) == {"hybrid": 2.0, "plain": 5.0}

    # every batch a subscriber decodes with plain msgpack opens with the declaration
    batches = [msgpack.unpackb(frames[2], raw=False) for frames in _drain(raw)]
    assert len(batches) == 5 and all(batch[1][0] == DECLARED for batch in batches)

    # a router that starts now replays the same index; a replica that leaves, leaves it
    late = subscribe()
    assert late.state_groups("hybrid") == {STATE}
    assert late.checkpoints_of("hybrid") == index.checkpoints_of("hybrid")
    assert late.blocks_of("hybrid") == index.blocks_of("hybrid")
    assert late.match(KEYS, ["hybrid"]) == {"hybrid": 2.0}
    index.clear("hybrid")
    assert index.state_groups("hybrid") == set() and not index.checkpoints_of("hybrid")
    assert index.match(KEYS, both) == {"hybrid": 0.0, "plain": 5.0}


# -- an engine serving a model with recurrent layers -------------------------------------

@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """A tiny random Bamba checkpoint (Mamba-2 layers and one attention layer)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from ..engine import test_recurrent_models as recurrent

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bamba")
    config = recurrent.recurrent_configs()["bamba"][0]
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture
def served(bamba):
    """``serve(num_state_slots)``: an engine over `bamba` publishing its events, followed
    into a `PrefixIndex` as replica ``"r"``; returns ``(engine, generate, index)``, where
    ``generate(prompt)`` serves one prompt and returns its prefix hit in tokens once the
    index applied every batch the engine published."""
    from paged_kv.engine import Engine, SamplingParams
    from paged_kv.engine.config import EngineConfig
    from paged_kv.engine.hf import HFCausalLM

    opened = []

    def serve(num_state_slots: int):
        runner = HFCausalLM.from_pretrained(bamba)
        engine = Engine(runner, EngineConfig(
            cache=runner.cache_config(num_blocks=96, block_size=16,
                                      num_state_slots=num_state_slots),
            kv_events=KVEventsConfig(ANY, ANY), max_num_seqs=1))
        index = PrefixIndex()
        subscriber = EventSubscriber(engine.events.endpoint,
                                     replay_endpoint=engine.events.replay_endpoint,
                                     on_batch=lambda stamp, events: index.apply("r", events))
        opened.append((engine, subscriber))
        time.sleep(0.3)  # the subscription reaches the publisher before anything is sent

        def generate(prompt: list[int]) -> int:
            output = engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
            _until(lambda: subscriber.counts["batches"] == engine.events.num_batches)
            return output[0].prefix_hit_tokens

        return engine, generate, index

    yield serve
    for engine, subscriber in opened:
        subscriber.close()
        engine.close()


def test_the_index_claims_the_prefix_the_engine_serves(served):
    """After the 149-token prompt the index matches its 9 blocks for the replica (a
    checkpoint after the 9th), and for each prompt below claims exactly the hit the engine
    then serves; after a reset the blocks are gone (no claim), and once they are back the
    checkpoints the cache kept serve again."""
    from ..engine import test_recurrent_models as recurrent

    size, prompts = recurrent.BLOCK, recurrent.prompts
    engine, generate, index = served(num_state_slots=64)
    shared = prompts()["shared"]
    assert len(shared) == 149 and generate(shared) == 0
    state_group = engine.cache.state_group.index
    assert index.state_groups("r") == {state_group}
    assert engine.events.info()["state_groups"] == [state_group]
    assert index.match(prompt_keys(shared, size, None), ["r"]) == {"r": 9.0}
    for name in ("3 blocks", "inside a block", "shared"):
        claim = index.match(prompt_keys(prompts()[name], size, None), ["r"])["r"]
        assert generate(prompts()[name]) == claim * size, name

    engine.cache.reset_prefix_cache()
    assert generate(shared) == 0  # (the reset's events went out with this step's)
    assert index.match(prompt_keys(shared, size, None), ["r"]) == {"r": 9.0}
    assert generate(shared) == 9 * size


def test_an_evicted_checkpoint_is_no_longer_claimed(served):
    """Three state slots, one request at a time: one live state and two checkpoints. The
    149-token prompt keeps checkpoints after its first 2 blocks (the later ones find no
    slot); a second prompt's checkpoints evict them. Its 9 blocks stay cached, and a
    router reading blocks alone would claim them all: the index claims nothing, and the
    engine serves nothing."""
    from ..engine import test_recurrent_models as recurrent

    size, prompts = recurrent.BLOCK, recurrent.prompts
    _, generate, index = served(num_state_slots=3)
    shared, keys = prompts()["shared"], prompt_keys(prompts()["shared"], size, None)
    generate(shared)
    claim = index.match(keys, ["r"])["r"]
    assert 0 < claim < 9
    assert generate(shared) == claim * size

    generate(prompts()["len70"])
    assert set(keys) <= index.blocks_of("r")  # the blocks are all there
    assert index.match(keys, ["r"]) == {"r": 0.0}
    assert generate(shared) == 0


def test_a_tiers_checkpoint_chunks_are_published_as_the_checkpoint(monkeypatch):
    """A tier's write of a checkpoint's chunks (`TierManager.watch`) is the checkpoint of
    its state group in that medium, by its first chunk; the other chunks are not blocks
    to a router; a removed first chunk removes it."""
    publisher = EventPublisher(KVEventsConfig(ANY, ANY), block_size=BLOCK, state_groups=(STATE,))
    sent: list[tuple[list[BlockEvent], str]] = []
    monkeypatch.setattr(publisher, "publish", lambda events, medium=None: sent.append(
        (events, medium)))
    try:
        chunks = [checkpoint(3) + j.to_bytes(2, "little") for j in range(3)]
        publisher.publish_tier("DISK", [KEYS[0], *chunks], [])
        publisher.publish_tier("DISK", [], chunks[1:])
        publisher.publish_tier("DISK", [], chunks[:1])
    finally:
        publisher.close()
    (first, medium), (second, _), (third, _) = sent
    assert medium == "DISK"
    assert [(e.kind, e.keys) for e in first] == [("stored", (KEYS[0],)),
                                                 ("state_stored", (checkpoint(3),))]
    assert first[1].parents == (KEYS[3],)
    assert second == []
    assert [(e.kind, e.keys) for e in third] == [("state_removed", (checkpoint(3),))]
    wire = to_wire(first, block_size=BLOCK, medium="DISK", state_groups=(STATE,))
    assert ["BlockStored", [checkpoint(3)], None, [], BLOCK, None, "DISK", None, None, STATE,
            "mamba"] in wire
