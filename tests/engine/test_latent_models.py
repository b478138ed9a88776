"""DeepSeek V2 / V3 (multi-head latent attention), served on latent pages, give transformers'
own greedy tokens.

Tiny random checkpoints (no download): hidden 64, 4 heads, ``kv_lora_rank`` 16, rope 8, nope
16, values 16, two layers (a dense one, then a small MoE), with ``q_lora_rank`` unset (V2, and
V3 with plain ``rotate_half`` rope) and set (V3, interleaved rope). Each against ``generate``
on the same checkpoint (float32, greedy, eager attention over per-head K/V). The pool holds
each token's latent row — one kv head of ``(16 + 8) / 2 = 12`` values, the row's halves in
the K and V planes — and every step attends over it in the absorbed form, prefill and decode
alike: a 24-token budget splits prompts into chunks starting inside a block, prefix hits
serve cached latents, samples fork them, preemption recomputes or swaps them.
"""

from __future__ import annotations

import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.engine import Engine, SamplingParams  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.integrations.hf_support import UnsupportedModelError  # noqa: E402
from paged_kv.integrations.transformers import PagedCache  # noqa: E402

from .conftest import generate_greedy, prompt, save_random_checkpoints  # noqa: E402

MAX_TOKENS = 6
BLOCK = 16
LENGTHS = (5, 16, 37, 70)
RANK, ROPE, NOPE, VALUE, HEADS, LAYERS = 16, 8, 16, 16, 4, 2
# eager attention (the reference) repeats kv heads by num_key_value_heads: as many as heads
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=RANK,
              qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE,
              max_position_embeddings=512, initializer_range=0.3, first_k_dense_replace=1,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              n_shared_experts=1, n_group=1, topk_group=1)
SHARED = prompt(9 * BLOCK + 5, seed=99, vocab_size=128)


def latent_configs() -> dict[str, object]:
    """``{family: config}``: V2 without a query LoRA, V3 with one (interleaved rope, its
    default) and V3 without one and with plain rope."""
    return {
        "deepseek_v2": transformers.DeepseekV2Config(**COMMON, q_lora_rank=None),
        "deepseek_v3": transformers.DeepseekV3Config(**COMMON, q_lora_rank=32),
        "deepseek_v3 plain rope": transformers.DeepseekV3Config(**COMMON, q_lora_rank=None,
                                                                rope_interleave=False),
    }


FAMILIES = sorted(latent_configs())


def prompts() -> dict[str, list[int]]:
    """Mixed lengths, and prompts sharing `SHARED` whole or diverging inside block 10."""
    found = {f"len{n}": prompt(n, seed=n, vocab_size=128) for n in LENGTHS}
    found["shared"] = SHARED
    found["inside a block"] = SHARED[:9 * BLOCK + 3] + prompt(7, seed=9, vocab_size=128)
    return found


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    return save_random_checkpoints(tmp_path_factory, latent_configs())


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[tuple[str, str], list[int]]:
    """transformers' greedy tokens per (family, prompt): float32, eager, its own cache."""
    return generate_greedy(checkpoints, prompts(), MAX_TOKENS, attn_implementation="eager")


def engine_for(path, num_blocks: int = 64, **kwargs) -> Engine:
    runner = HFCausalLM.from_pretrained(path)
    return Engine(runner, EngineConfig(
        cache=runner.cache_config(num_blocks=num_blocks, block_size=BLOCK,
                                  num_host_blocks=kwargs.pop("num_host_blocks", 0),
                                  kv_cache_dtype=kwargs.pop("kv_cache_dtype", "auto")),
        max_num_seqs=kwargs.pop("max_num_seqs", 16), **kwargs))


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pool_holds_the_latent_not_per_head_kv(family, checkpoints):
    """One kv head of (R + P) / 2 values per layer: a token's bytes are its latent rows'
    (R + P values per layer), against H x (nope + rope + v) for per-head K/V: 160 / 24 =
    6.7x fewer here (DeepSeek V3: 128 x (192 + 128) / 576 = 71x)."""
    engine = engine_for(checkpoints[family])
    assert engine.model.kv_shape == (LAYERS, 1, (RANK + ROPE) // 2)
    itemsize = torch.float32.itemsize
    latent_bytes = (RANK + ROPE) * itemsize * LAYERS
    per_head_bytes = HEADS * (NOPE + ROPE + VALUE) * itemsize * LAYERS
    assert engine.cache.config.bytes_per_token == latent_bytes <= 1.25 * latent_bytes
    assert per_head_bytes / engine.cache.config.bytes_per_token == pytest.approx(160 / 24)
    assert engine.cache.pool.nbytes == 64 * BLOCK * latent_bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_batch_in_chunks_matches_generate(family, checkpoints, expected):
    """Four prompts (5 to 70 tokens) in one batch with a 24-token budget: steps mix prefill
    chunks starting inside a block with the shorter prompts' decodes."""
    engine = engine_for(checkpoints[family], max_num_batched_tokens=24)
    names = [f"len{n}" for n in LENGTHS]
    outputs = engine.generate([prompts()[name] for name in names], greedy())
    for name, output in zip(names, outputs, strict=True):
        assert output.error is None, output.error
        assert output.outputs[0].token_ids == expected[family, name], f"{family}, {name}"
    engine.cache.check()
    assert engine.cache.stats().num_live_blocks == 0


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_prefix_hits_serve_cached_latents(family, checkpoints, expected):
    """After a 149-token prompt, the same prompt hits its 9 whole blocks, one diverging
    inside block 10 hits 9 too: the cached latents give transformers' tokens."""
    engine = engine_for(checkpoints[family])
    first = engine.generate([prompts()["shared"]], greedy())[0]
    assert first.prefix_hit_tokens == 0
    assert first.outputs[0].token_ids == expected[family, "shared"]
    for name in ("shared", "inside a block"):
        output = engine.generate([prompts()[name]], greedy())[0]
        assert output.prefix_hit_tokens == 9 * BLOCK, name
        assert output.outputs[0].token_ids == expected[family, name], name
        engine.cache.check()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_samples_fork_the_latent_pages(family, checkpoints, expected):
    """n=3: the samples share the prompt's latent blocks and decode alike."""
    engine = engine_for(checkpoints[family])
    output = engine.generate([prompts()["len37"]], greedy(n=3))[0]
    assert [s.token_ids for s in output.outputs] == [expected[family, "len37"]] * 3
    engine.cache.check()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_preemption_matches_generate(family, preemption, checkpoints, expected):
    """A pool of 7 usable blocks for four prompts that would hold 11 at once: the engine
    preempts, recomputing the latents or swapping them to the host and back."""
    engine = engine_for(checkpoints[family], num_blocks=8, max_num_batched_tokens=24,
                        preemption=preemption, num_host_blocks=16)
    names = ["len70", "len37", "len16", "len5"]
    outputs = engine.generate([prompts()[name] for name in names], greedy())
    for name, output in zip(names, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[family, name], name
    assert sum(output.num_preemptions for output in outputs) > 0
    if preemption == "swap":
        assert engine.cache.stats().num_swap_outs > 0
    engine.cache.check()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_int8_latent_pages_stay_close(family, checkpoints, expected):
    """int8 pages (a scale per token and half row): a quarter of the float32 bytes plus the
    scales, and the first greedy token of every prompt unchanged, most of the rest too."""
    engine = engine_for(checkpoints[family], kv_cache_dtype="int8", max_num_batched_tokens=24)
    assert engine.cache.config.bytes_per_token == 2 * LAYERS * ((RANK + ROPE) // 2 + 2)
    names = [f"len{n}" for n in LENGTHS]
    outputs = engine.generate([prompts()[name] for name in names], greedy())
    tokens = [output.outputs[0].token_ids for output in outputs]
    want = [expected[family, name] for name in names]
    assert [t[0] for t in tokens] == [w[0] for w in want]
    same = sum(a == b for got, ref in zip(tokens, want, strict=True)
               for a, b in zip(got, ref, strict=True))
    assert same >= 0.75 * MAX_TOKENS * len(names), (tokens, want)


def test_latents_come_back_from_the_host_tier(checkpoints, expected, monkeypatch):
    """A host tier takes the prompt's 9 latent blocks; after the device's prefix cache is
    reset, the same prompt hits them through the tier (fetched, not recomputed) and gives
    transformers' tokens."""
    from paged_kv.tiers import TierConfig
    from paged_kv.tiers.manager import TierManager

    # always fetch: on this tiny model a fetch and a recompute cost about the same
    monkeypatch.setattr(TierManager, "observe_prefill", lambda self, num_tokens, seconds: None)
    engine = engine_for(checkpoints["deepseek_v3"], kv_tiers=TierConfig(host_mib=8,
                                                                         fetch_deadline_s=5.0))
    try:
        engine.generate([prompts()["shared"]], greedy())
        assert engine.tiers.flush(timeout=10)
        engine.cache.reset_prefix_cache()
        output = engine.generate([prompts()["shared"]], greedy())[0]
        assert output.prefix_hit_tokens == 9 * BLOCK
        assert engine.stats().tiers.loaded_blocks == 9
        assert output.outputs[0].token_ids == expected["deepseek_v3", "shared"]
    finally:
        engine.close()


def test_tensor_parallelism_is_refused_at_start(checkpoints):
    runner = HFCausalLM.from_pretrained(checkpoints["deepseek_v3"])
    with pytest.raises(ValueError, match="tensor_parallel_size=2: not supported yet for a "
                                         "model with latent attention"):
        Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32),
                                    tensor_parallel_size=2))


@pytest.mark.parametrize("pages", [dict(kv_cache_dtype="int4"), dict(kv_rotation=True)])
def test_four_bit_or_rotated_pages_are_refused_at_start(checkpoints, pages):
    """The latent attention reads one scale per row half and unrotated rows: 4-bit or
    rotated pages under latent layers are refused when the engine starts, never at the
    first step."""
    runner = HFCausalLM.from_pretrained(checkpoints["deepseek_v3"])
    # this shape's latent half (12 values) cannot hold 4-bit groups of 16 at all: the
    # config refuses it first; V3's (288) can, and the engine refuses it
    with pytest.raises(ValueError, match=r"without rotation|expected a multiple of 16"):
        Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32, **pages)))


def test_paged_cache_still_refuses_latent_attention():
    """`PagedCache` pages what the model's own attention hands its cache (per-head K/V of
    other head dims): still refused, while the engine serves the model."""
    config = latent_configs()["deepseek_v3"]
    with pytest.raises(UnsupportedModelError, match="multi-head latent attention"):
        PagedCache(config, num_blocks=8)


@pytest.mark.parametrize(("config", "reason"), [
    pytest.param(lambda: transformers.CONFIG_MAPPING["deepseek_v32"](**COMMON),
                 "a sparse attention indexer", id="v3.2 indexer"),
    pytest.param(lambda: transformers.DeepseekV3Config(**{**COMMON, "kv_lora_rank": 15}),
                 "kv_lora_rank + qk_rope_head_dim = 15 + 8, odd", id="odd latent row"),
    pytest.param(lambda: transformers.DeepseekV3Config(**COMMON, index_topk=64),
                 "index_topk=64 (a sparse attention indexer)", id="v3 with an indexer"),
])
def test_what_latent_pages_cannot_serve_is_refused_by_name(config, reason):
    model = transformers.AutoModelForCausalLM.from_config(config())
    with pytest.raises(UnsupportedModelError, match="is not supported") as info:
        HFCausalLM(model)
    assert reason in str(info.value)


def test_tenants_and_kv_events_see_latent_blocks_as_any(checkpoints, expected):
    """Latent rows are pages like any: under a tenant policy each tenant hits only its own
    prompt's blocks (another's salt misses), and the KV events a router reads rebuild the
    engine's index of latent blocks (stored minus removed)."""
    pytest.importorskip("zmq")
    from paged_kv.events import KVEventsConfig
    from paged_kv.tenants import TenantLimits, TenantPolicy

    from ..events.test_kv_events import _drain, _sub, decode

    runner = HFCausalLM.from_pretrained(checkpoints["deepseek_v3"])
    policy = TenantPolicy({name: TenantLimits(quota=30) for name in ("acme", "beta")})
    engine = Engine(runner, EngineConfig(
        cache=runner.cache_config(num_blocks=64, block_size=BLOCK, tenants=policy),
        kv_events=KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")))
    socket = _sub(engine.events.endpoint)
    try:
        time.sleep(0.3)  # the subscription reaches the publisher before anything is sent
        shared = prompts()["shared"]
        hits = {}
        for salt in ("acme", "beta", "acme"):
            rid = engine.add_request(shared, greedy(), salt=salt)
            while engine.has_unfinished_requests:
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        assert out.outputs[0].token_ids == expected["deepseek_v3", "shared"]
                        hits.setdefault(salt, []).append(out.prefix_hit_tokens)
        batches = [decode(frames) for frames in _drain(socket)]
    finally:
        socket.close(0)
        engine.close()
    assert hits == {"acme": [0, 9 * BLOCK], "beta": [0]}  # a salt never hits another's
    held: set[bytes] = set()
    for _, _, _, events in batches:
        for event in events:
            if event[0] == "BlockStored":
                held.update(event[1])
            elif event[0] == "BlockRemoved":
                held.difference_update(event[1])
    allocator = engine.cache.allocator
    assert held == {allocator.block_hash(b) for b in range(allocator.num_blocks)} - {None}
