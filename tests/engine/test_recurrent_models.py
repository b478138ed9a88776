"""Models with recurrent layers, served by the engine, give transformers' own greedy tokens.

Tiny random checkpoints (no download) of each recurrent family the engine serves — Qwen3-Next
and Qwen3.5 (gated delta nets), Jamba (Mamba-1), LFM2 (short convolutions), Nemotron-H
(Mamba-2 beside attention and an MLP-only layer), Granite 4 hybrids and Bamba (Mamba-2),
Falcon-H1 (attention and Mamba-2 side by side in every layer: two cache layers each, its µP
multipliers off one), and Mamba, Falcon-Mamba and Mamba-2 (recurrent layers only, a key-only
layer leading) —
each against ``generate`` on the same checkpoint (float32, greedy, transformers' torch
recurrences). The recurrent layers' states live in the cache's state slab: a packed step
mixes prefill chunks and decodes, a 24-token budget splits the long prompts into chunks
that start inside a block, and prefix hits at block 16 serve a prompt only where a state
checkpoint sits.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.engine import Engine, SamplingParams  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.integrations.hf_layers import model_layers  # noqa: E402

from .conftest import prompt  # noqa: E402

MAX_TOKENS = 6
BLOCK = 16
LENGTHS = (5, 16, 37, 70)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3)
LIN, FULL = "linear_attention", "full_attention"
# two 3-block prefixes each prompt family below shares or not
SHARED = prompt(9 * BLOCK + 5, seed=99, vocab_size=128)


def recurrent_configs() -> dict[str, tuple[object, tuple[str, ...], tuple[int | None, ...]]]:
    """``{family: (config, each cache layer's kind, each model layer's cache layer)}``."""
    t = transformers
    delta = dict(num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL], head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4)
    mamba2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, num_hidden_layers=4)
    three_one = ("recurrent", "recurrent", "full", "recurrent")
    pure = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, initializer_range=0.3)
    key_only = ("recurrent", "recurrent", "full")
    # Falcon-H1: every multiplier off one, so a multiplier the engine dropped or applied
    # twice changes the tokens; the gated norm on, gating after it
    falcon = dict(num_hidden_layers=4, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                  mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                  mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=True,
                  ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], ssm_in_multiplier=0.8,
                  ssm_out_multiplier=1.3, attention_in_multiplier=0.9,
                  attention_out_multiplier=1.1, key_multiplier=0.7,
                  mlp_multipliers=[1.2, 0.8], embedding_multiplier=1.5,
                  lm_head_multiplier=0.9)
    return {
        "qwen3_next": (t.Qwen3NextConfig(**COMMON, **delta, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=1,
                                         shared_expert_intermediate_size=32),
                       ("recurrent",) * 3 + ("full",), (0, 1, 2, 3)),
        "qwen3_5_text": (t.Qwen3_5TextConfig(**COMMON, **delta),
                         ("recurrent",) * 3 + ("full",), (0, 1, 2, 3)),
        "jamba": (t.JambaConfig(**COMMON, num_hidden_layers=4, attn_layer_period=4,
                                attn_layer_offset=2, expert_layer_period=2,
                                expert_layer_offset=1, num_experts=2, mamba_d_state=8,
                                mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
                  three_one, (0, 1, 2, 3)),
        "lfm2": (t.Lfm2Config(**COMMON, num_hidden_layers=4, conv_L_cache=3,
                              layer_types=["conv", "conv", FULL, "conv"]),
                 three_one, (0, 1, 2, 3)),
        "nemotron_h": (t.NemotronHConfig(**COMMON, head_dim=16, num_hidden_layers=4,
                                         hybrid_override_pattern="M*M-", mamba_num_heads=8,
                                         mamba_head_dim=16, ssm_state_size=8, n_groups=2,
                                         conv_kernel=4, mamba_chunk_size=16),
                       ("recurrent", "full", "recurrent"), (0, 1, 2, None)),
        "granitemoehybrid": (t.GraniteMoeHybridConfig(
            **COMMON, **mamba2, layer_types=["mamba", "mamba", "attention", "mamba"],
            num_local_experts=2, num_experts_per_tok=1), three_one, (0, 1, 2, 3)),
        "bamba": (t.BambaConfig(**COMMON, **mamba2, attn_layer_indices=[2]),
                  three_one, (0, 1, 2, 3)),
        # attention and a state in every layer: its attention's cache layer, then its state's
        "falcon_h1": (t.FalconH1Config(**COMMON, **falcon), ("full", "recurrent") * 4,
                      (0, 2, 4, 6)),
        # recurrent layers only: a key-only attention layer (no model layer's) leads
        "mamba": (t.MambaConfig(**pure, state_size=8, expand=2), key_only, (0, 1)),
        "falcon_mamba": (t.FalconMambaConfig(**pure, state_size=8, expand=2), key_only,
                         (0, 1)),
        "mamba2": (t.Mamba2Config(**pure, num_heads=8, head_dim=16, state_size=8, n_groups=2,
                                  chunk_size=16), key_only, (0, 1)),
    }


FAMILIES = sorted(recurrent_configs())
# each model layer's state layer where it is not its cache layer (a hybrid layer's)
STATE_LAYERS = {"falcon_h1": (1, 3, 5, 7)}


def prompts() -> dict[str, list[int]]:
    """Mixed lengths (shorter than a block, one block, several chunks), and prompts that
    share `SHARED`'s first 3 blocks, all of it, or its 9 blocks and 5 more tokens."""
    found = {f"len{n}": prompt(n, seed=n, vocab_size=128) for n in LENGTHS}
    found["shared"] = SHARED
    found["3 blocks"] = SHARED[:3 * BLOCK] + prompt(20, seed=3, vocab_size=128)
    found["inside a block"] = SHARED[:9 * BLOCK + 3] + prompt(7, seed=9, vocab_size=128)
    return found


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    paths = {}
    for family, (config, _, _) in recurrent_configs().items():
        torch.manual_seed(0)
        paths[family] = tmp_path_factory.mktemp(family)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(paths[family])
    return paths


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[tuple[str, str], list[int]]:
    """transformers' greedy tokens per (family, prompt), float32, its own cache."""
    found = {}
    for family, path in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for name, ids in prompts().items():
            ids = torch.tensor([ids])
            out = model.eval().generate(ids, attention_mask=torch.ones_like(ids),
                                        do_sample=False, max_new_tokens=MAX_TOKENS,
                                        eos_token_id=None, pad_token_id=0)
            found[family, name] = out[0, ids.shape[1]:].tolist()
    return found


def engine_for(path, num_blocks: int = 96, **kwargs) -> Engine:
    runner = HFCausalLM.from_pretrained(path)
    return Engine(runner, EngineConfig(
        cache=runner.cache_config(num_blocks=num_blocks, block_size=BLOCK,
                                  num_state_slots=kwargs.pop("num_state_slots", 64),
                                  num_host_blocks=kwargs.pop("num_host_blocks", 0)),
        max_num_seqs=kwargs.pop("max_num_seqs", 16), **kwargs))


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_layers_follow_the_config(family):
    config, kinds, cache_layers = recurrent_configs()[family]
    layers = model_layers(config)
    assert tuple(str(kind) for kind in layers.kinds) == kinds
    assert layers.cache_layers == cache_layers
    recurrent = tuple(layer if layer is not None and kinds[layer] == "recurrent" else None
                      for layer in cache_layers)
    assert layers.state_layers == STATE_LAYERS.get(family, recurrent)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_batch_in_chunks_matches_generate(family, checkpoints, expected):
    """Four prompts (5 to 70 tokens) in one batch with a 24-token budget: steps mix
    prefill chunks (starting mid-block) with decodes of the shorter prompts."""
    engine = engine_for(checkpoints[family], max_num_batched_tokens=24)
    names = [f"len{n}" for n in LENGTHS]
    outputs = engine.generate([prompts()[name] for name in names], greedy())
    for name, output in zip(names, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[family, name], f"{family}, {name}"
    engine.cache.check()
    stats = engine.cache.stats()
    assert stats.num_live_blocks == 0 and stats.num_live_states == 0
    assert stats.checkpoints_written > 0  # the 70-token prompt filled 4 blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_serve_their_state(family, checkpoints, expected):
    """After a 149-token prompt, the same prompt hits its 9 whole blocks, one sharing 3
    blocks hits 3, one diverging inside block 10 hits 9: each hit at a state checkpoint,
    with transformers' tokens."""
    engine = engine_for(checkpoints[family])
    cases = {"shared": 9 * BLOCK, "3 blocks": 3 * BLOCK, "inside a block": 9 * BLOCK}
    first = engine.generate([prompts()["shared"]], greedy())[0]
    assert first.prefix_hit_tokens == 0
    assert first.outputs[0].token_ids == expected[family, "shared"]
    for name, hit in cases.items():
        output = engine.generate([prompts()[name]], greedy())[0]
        assert output.prefix_hit_tokens == hit, name
        assert output.outputs[0].token_ids == expected[family, name], name
        engine.cache.check()
    assert engine.cache.stats().checkpoints_hit == len(cases)


@pytest.mark.parametrize("family", FAMILIES)
def test_samples_fork_the_state(family, checkpoints, expected):
    """n=3: the samples fork off the prompt's state (each copies it) and decode alike."""
    engine = engine_for(checkpoints[family])
    output = engine.generate([prompts()["len37"]], greedy(n=3))[0]
    assert [s.token_ids for s in output.outputs] == [expected[family, "len37"]] * 3
    engine.cache.check()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "jamba", "falcon_h1"])
def test_preemption_matches_generate(family, preemption, checkpoints, expected):
    """A pool of 7 blocks for four prompts that would hold 11 at once: the engine
    preempts, and recomputes (the state starts again from zeros or a checkpoint) or swaps
    (the state goes to the host and back with the blocks); the tokens do not change."""
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


def test_too_few_state_slots_and_parts_that_move_pages_are_refused_at_start(checkpoints):
    runner = HFCausalLM.from_pretrained(checkpoints["bamba"])
    with pytest.raises(ValueError, match="num_state_slots"):
        Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32, num_state_slots=4),
                                    max_num_seqs=8))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32),
                                    tensor_parallel_size=2))


def test_a_miss_for_want_of_a_state_is_named_and_the_states_are_metered(checkpoints,
                                                                          expected):
    """One state slot: the live state takes it and no checkpoint fits, so a repeated
    prompt finds its attention blocks cached but no state: no hit, miss ``state_missing``,
    tokens unchanged. The slab's use and the checkpoints' counters reach /metrics."""
    engine = engine_for(checkpoints["bamba"], num_state_slots=1, max_num_seqs=1)
    for _ in range(2):
        output = engine.generate([prompts()["shared"]], greedy())[0]
        assert output.outputs[0].token_ids == expected["bamba", "shared"]
    assert output.prefix_hit_tokens == 0
    assert output.miss == {"reason": "state_missing", "block": 0}
    text = engine.metrics_text()
    assert 'paged_kv_prefix_misses_total{reason="state_missing",tenant=""} 1.0' in text
    assert 'paged_kv_state_bytes{use="slab"}' in text
    assert 'paged_kv_states{use="live"} 0.0' in text

    roomy = engine_for(checkpoints["bamba"])
    for _ in range(2):
        roomy.generate([prompts()["shared"]], greedy())
    text = roomy.metrics_text()
    assert 'paged_kv_state_checkpoints{event="written"} 9.0' in text
    assert 'paged_kv_state_checkpoints{event="hit"} 1.0' in text


def test_a_memory_budget_holds_the_state_slab_and_the_blocks(checkpoints):
    """`pool_config` (demo, serve) takes the slab out of the budget before the blocks:
    the whole pool, states included, fits the budget, and the start-up line says how
    many checkpoints fit beside the live states."""
    from paged_kv.engine.sizing import pool_config, state_line

    runner = HFCausalLM.from_pretrained(checkpoints["qwen3_next"])
    config, budget = pool_config(runner, block_size=BLOCK, memory_mib=4)
    assert config.state_bytes > 0 and config.num_blocks >= 2
    assert config.total_bytes <= budget < config.total_bytes + config.bytes_per_block
    assert state_line(config, 64).endswith(f"live states of 64 sequences, "
                                           f"{config.num_state_slots - 64} prefix checkpoints")
