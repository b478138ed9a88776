"""The engine's parts beside a model with recurrent layers.

The tiers: its state checkpoints are stored beside its blocks (block-sized chunks under
their own keys, verified and fingerprinted as blocks are), and a fresh engine over the
same disk directory (a restart) serves a repeated prompt's prefix from the disk, blocks
and state together, with the first engine's tokens; a tenant's checkpoints stay under its
salt. 8-bit attention pages beside float states give the float pages' tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.engine import Engine  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.tiers import TierConfig  # noqa: E402

from .conftest import save_random_checkpoints  # noqa: E402
from .test_recurrent_models import (  # noqa: E402
    BLOCK,
    greedy,
    prompts,
    recurrent_configs,
)

FAMILIES = ["qwen3_next", "bamba", "jamba", "lfm2", "mamba2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    configs = recurrent_configs()
    return save_random_checkpoints(tmp_path_factory, {f: configs[f][0] for f in FAMILIES})


@pytest.fixture(autouse=True)
def fetch_always(monkeypatch):
    """Fetch whenever a tier holds the blocks (the recompute estimate would make hits
    depend on this machine's load: not what these tests check)."""
    from paged_kv.tiers.manager import TierManager

    monkeypatch.setattr(TierManager, "observe_prefill", lambda self, num_tokens, seconds: None)


@pytest.fixture
def engines():
    """``engines(path, disk_dir)``: an engine with a disk tier; all closed at teardown."""
    made: list[Engine] = []

    def make(path, disk_dir, num_state_slots: int = 64) -> Engine:
        runner = HFCausalLM.from_pretrained(path)
        engine = Engine(runner, EngineConfig(
            cache=runner.cache_config(num_blocks=96, block_size=BLOCK,
                                      num_state_slots=num_state_slots),
            kv_tiers=TierConfig(disk_dir=str(disk_dir), disk_mib=16, fetch_deadline_s=10.0),
            max_num_seqs=16))
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


def generated(engine: Engine, name: str):
    return engine.generate([prompts()[name]], greedy())[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_restart_serves_a_hybrid_prefix_from_disk(family, checkpoints, engines, tmp_path):
    """A 149-token prompt served once; a fresh engine over the same directory serves it
    again hitting its 9 whole blocks from the disk (the checkpoint at block 9 came with
    them), with the first engine's (transformers') tokens."""
    first = engines(checkpoints[family], tmp_path)
    out = generated(first, "shared")
    assert out.prefix_hit_tokens == 0
    first.close()  # a clean stop: queued writes reach the disk

    restarted = engines(checkpoints[family], tmp_path)
    again = generated(restarted, "shared")
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.prefix_hit_tokens == 9 * BLOCK, restarted.stats().tiers
    assert restarted.cache.stats().checkpoints_hit == 1
    restarted.cache.check()



@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_a_restart_serves_a_next_turn_from_the_deepest_checkpoint_on_disk(
        family, checkpoints, engines, tmp_path):
    """A second turn (the first turn's prompt, its answer and 20 new tokens) after a
    restart: the disk holds the first turn's blocks and checkpoints up to block 9, none at
    the second turn's own last full block, so the fetch takes the deepest checkpoint the
    disk holds within the blocks it found and the turn hits 9 blocks, with the tokens an
    engine that never restarted gives."""
    first = engines(checkpoints[family], tmp_path)
    turn = prompts()["shared"]
    out = generated_prompt(first, turn)
    second = turn + out.outputs[0].token_ids + prompts()["len37"][:20]
    first.close()

    restarted = engines(checkpoints[family], tmp_path)
    again = generated_prompt(restarted, second)
    assert again.prefix_hit_tokens == 9 * BLOCK, restarted.stats().tiers
    fresh = engines(checkpoints[family], tmp_path / "fresh")
    assert again.outputs[0].token_ids == generated_prompt(fresh, second).outputs[0].token_ids
    restarted.cache.check()


def generated_prompt(engine: Engine, tokens: list[int]):
    return engine.generate([tokens], greedy())[0]


def served(engine: Engine, tokens: list[int], salt: str | None = None, limit: int = 2000):
    """`tokens`' output, greedy, under the tenant `salt`, stepping the engine by hand."""
    request_id = engine.add_request(tokens, greedy(), salt=salt)
    for _ in range(limit):
        for out in engine.step():
            if out.request_id == request_id:
                return out
    raise AssertionError("the request did not finish")


def test_a_tenants_checkpoints_go_to_the_tiers_under_its_salt(checkpoints, engines, tmp_path):
    """A checkpoint's chunks follow its tenant's salted chain: after a restart, the same
    prompt under another salt finds nothing (no block, no state), and under its own salt
    hits its 9 blocks with their state."""
    first = engines(checkpoints["bamba"], tmp_path)
    out = served(first, prompts()["shared"], salt="a")
    first.close()
    restarted = engines(checkpoints["bamba"], tmp_path)
    other = served(restarted, prompts()["shared"], salt="b")
    assert other.prefix_hit_tokens == 0
    again = served(restarted, prompts()["shared"], salt="a")
    assert again.prefix_hit_tokens == 9 * BLOCK
    assert again.outputs[0].token_ids == out.outputs[0].token_ids == other.outputs[0].token_ids
    restarted.cache.check()


@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])
def test_8_bit_attention_pages_beside_float_states(family, checkpoints):
    """int8 pages for the attention layers, the states in their own dtype (float32): the
    same greedy tokens as float pages, and a prefix hit from a checkpoint."""
    outputs = {}
    for dtype in ("auto", "int8"):
        runner = HFCausalLM.from_pretrained(checkpoints[family])
        engine = Engine(runner, EngineConfig(
            cache=runner.cache_config(num_blocks=96, block_size=BLOCK, num_state_slots=64,
                                      kv_cache_dtype=dtype), max_num_seqs=16))
        first, again = (generated(engine, "shared") for _ in range(2))
        assert again.prefix_hit_tokens == 9 * BLOCK
        assert all(t.dtype == torch.float32
                   for t in engine.cache.states(engine.cache.config.recurrent_layers[0]))
        outputs[dtype] = [first.outputs[0].token_ids, again.outputs[0].token_ids]
        engine.cache.check()
        engine.close()
    assert outputs["int8"] == outputs["auto"]
