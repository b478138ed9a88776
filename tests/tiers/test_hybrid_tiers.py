"""The tiers behind a hybrid layout: a prompt longer than the window, served once, is
served again from the disk tier by a fresh engine (a restart), every layer group's blocks
found under its own keys; a model of other layer kinds over the same directory is another
model to the tiers.

Tokens are compared with `TinyLlama.forward_dense`.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv.core.groups.rules import group_key
from paged_kv.engine import Engine, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.tiers import TierConfig, codec

from .conftest import MAX_TOKENS, random_prompts, serve_prompts, tier_stats, tokens_of

pytestmark = pytest.mark.usefixtures("fetch_always")  # hits must not depend on load

SHAPE = dict(num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
             intermediate_size=128, vocab_size=256, max_position=512)
KINDS = {
    "mixed": ("sliding:8", "full") * 3,  # two groups of three layers
    "gemma": ("sliding:8",) * 5 + ("full",),  # six groups of one layer
    "chunked": ("chunked:16", "full") * 3,
}
BLOCK = 4
PROMPT = random_prompts(1, 41, seed=26)[0]  # five windows of 8, past two chunks of 16


def reference(model: TinyLlama, tokens: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(int(model.forward_dense(torch.tensor(tokens + out))[-1].argmax()))
    return out


def test_each_layer_groups_block_has_its_own_store_key_and_verifies_only_as_itself():
    """A group's key is the chained key and one byte: cut to the chain, every group's block
    of one prompt shared a store key and a header, and a chunked group's K/V was served as
    the full group's (wrong tokens, no error)."""
    chain, digest, payload = bytes(range(32)), bytes(16), bytes(range(200))
    keys = [group_key(chain, group) for group in range(3)]
    assert len({codec.store_key("ns", key) for key in keys}) == 3
    assert codec.store_key("ns", keys[0]) == f"ns:{chain.hex()}"  # group 0's as before
    value = codec.encode(keys[1], digest, payload)
    assert bytes(codec.decode(value, keys[1], digest, len(payload))) == payload
    assert codec.decode(value, keys[0], digest, len(payload)) is None
    assert codec.decode(value, keys[2], digest, len(payload)) is None


@pytest.fixture
def engines():
    """``engines(model, disk_dir)``: an `Engine` with a disk tier; every one made is closed
    at teardown."""
    made: list[Engine] = []

    def make(model: TinyLlama, disk_dir) -> Engine:
        tiers = TierConfig(disk_dir=str(disk_dir), disk_mib=8, fetch_deadline_s=5.0)
        engine = Engine(model, EngineConfig(
            cache=model.cache_config(num_blocks=96, block_size=BLOCK), kv_tiers=tiers,
            num_threads=1))
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


@pytest.mark.parametrize("kinds", list(KINDS))
def test_a_hybrid_prefix_is_served_from_disk_after_a_restart(tmp_path, engines, kinds):
    model = TinyLlama(TinyLlamaConfig(**SHAPE, layer_kinds=KINDS[kinds]), seed=0)
    expected = [reference(model, PROMPT)]
    first = engines(model, tmp_path)
    [out] = serve_prompts(first, [PROMPT])
    assert tokens_of([out]) == expected and out.prefix_hit_tokens == 0
    first.close()  # a clean stop: queued writes reach the disk
    groups = len(model.cache_config().layer_groups)
    full_blocks = (len(PROMPT) - 1) // BLOCK
    assert tier_stats(first)["disk"].blocks > full_blocks  # other groups' blocks too

    restarted = engines(model, tmp_path)
    [again] = serve_prompts(restarted, [PROMPT])
    assert tokens_of([again]) == expected
    assert again.prefix_hit_tokens == full_blocks * BLOCK, restarted.stats().tiers
    stats = restarted.stats().tiers
    # the leading group's blocks, and each other group's last window (or chunk) of them
    assert full_blocks < stats.loaded_blocks <= groups * full_blocks
    # prompt tokens served from the disk: each once, whichever groups' blocks came with it
    assert tier_stats(restarted)["disk"].hit_tokens == again.prefix_hit_tokens
    restarted.check()
    assert restarted.cache.stats().num_live_blocks == 0


def test_a_model_of_other_layer_kinds_is_not_served_the_blocks(tmp_path, engines):
    """The same weights with another window: its blocks are other numbers, so the tiers'
    fingerprint (their namespace) differs and nothing is served across."""
    writer = TinyLlama(TinyLlamaConfig(**SHAPE, layer_kinds=KINDS["mixed"]), seed=0)
    other = TinyLlama(TinyLlamaConfig(**SHAPE, layer_kinds=("sliding:12", "full") * 3), seed=0)
    first = engines(writer, tmp_path)
    serve_prompts(first, [PROMPT])
    first.close()
    assert first.tiers.fingerprint.namespace != engines(other, tmp_path / "x").tiers \
        .fingerprint.namespace
    reader = engines(other, tmp_path)
    assert tier_stats(reader)["disk"].blocks > 0  # the first engine's files are there
    [out] = serve_prompts(reader, [PROMPT])
    assert out.prefix_hit_tokens == 0 and tier_stats(reader)["disk"].hit_tokens == 0
    assert tokens_of([out]) == [reference(other, PROMPT)]
    reader.check()
