"""`hf_support` reads a config's attention as the model's own forward computes it: what it
cannot serve (a window layer the config turns off, keys and values of other head dims,
shapes that vary by layer) is refused by name, never guessed."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.integrations.hf_support import (  # noqa: E402
    UnsupportedModelError,
    layer_kinds,
    unsupported_features,
)
from paged_kv.integrations.transformers import PagedCache  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.3, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
WITHOUT_HEAD_DIM = {name: value for name, value in COMMON.items() if name != "head_dim"}
SLIDING_SECOND = ["full_attention", "sliding_attention"]


def smollm3(**fields: object) -> transformers.SmolLM3Config:
    return transformers.SmolLM3Config(sliding_window=16, **COMMON, **fields)


def greedy(config: transformers.PreTrainedConfig) -> list[int]:
    """The model's own greedy tokens (eager attention, seeded weights) after a 40-token
    prompt, well past the window of 16."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.config._attn_implementation = "eager"
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=8, eos_token_id=None, pad_token_id=0)[0, 40:].tolist()


def test_a_sliding_layer_that_use_sliding_window_turns_off_is_refused():
    """SmolLM3 keeps ``sliding_window`` when ``use_sliding_window=False``, and a
    ``"sliding_attention"`` layer in ``layer_types`` then contradicts itself: transformers'
    mask windows it (eager and sdpa: the tokens are those with the window on, not the
    all-full ones), while its module passes no window (flash attention reads none).
    Served as full attention — what ``use_sliding_window=False`` alone says — its tokens
    would not be the model's; so the layer is refused, by model type and setting, in
    `layer_kinds`, `HFCausalLM` and `PagedCache`. (Qwen2 and Qwen3 drop the window
    themselves when it is off: their layers are full, tests/engine/test_hybrid_models.py.)"""
    config = smollm3(use_sliding_window=False, layer_types=SLIDING_SECOND)
    windowed = greedy(smollm3(use_sliding_window=True, layer_types=SLIDING_SECOND))
    all_full = greedy(smollm3(use_sliding_window=False, layer_types=["full_attention"] * 2))
    assert greedy(config) == windowed != all_full
    setting = "'sliding_attention' layers with use_sliding_window=False (sliding_window=16)"
    with pytest.raises(UnsupportedModelError, match=r"'smollm3'") as info:
        layer_kinds(config)
    assert info.value.features == [setting]
    assert unsupported_features(config) == [setting]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for build in (lambda: HFCausalLM(model), lambda: PagedCache(config, num_blocks=8)):
        with pytest.raises(UnsupportedModelError, match=r"use_sliding_window=False"):
            build()


def test_qwen2_moe_window_of_zero_is_refused_too():
    """Qwen2-MoE turns an unused window into ``sliding_window=0`` (transformers' own mask
    builder then fails on a sliding layer): refused, not served as full."""
    config = transformers.Qwen2MoeConfig(use_sliding_window=False, layer_types=SLIDING_SECOND,
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, **COMMON)
    assert config.sliding_window == 0
    assert unsupported_features(config) == [
        "'sliding_attention' layers with use_sliding_window=False (sliding_window=0)"]


@pytest.mark.parametrize(("fields", "found"), [
    pytest.param(dict(head_dim=32), [], id="head_dim other than hidden/heads"),
    pytest.param(dict(head_dim=None), [], id="head_dim from hidden/heads"),
])
def test_head_dims_the_pages_hold_are_accepted(fields, found):
    assert unsupported_features(transformers.LlamaConfig(**{**COMMON, **fields})) == found


@pytest.mark.parametrize(("config", "found"), [
    pytest.param(lambda: transformers.DeepseekV3Config(
        kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        **{**WITHOUT_HEAD_DIM, "num_key_value_heads": 4}),  # its own: the rope head dim
        "multi-head latent attention (kv_lora_rank=16): keys of head dim 24 and values of "
        "head dim 16, where paged_kv's pages hold keys and values of one head_dim (8)",
        id="deepseek v3"),
    pytest.param(lambda: transformers.CONFIG_MAPPING["mimo_v2_flash"](v_head_dim=8, **COMMON),
                 "keys of head dim 16 and values of head dim 8, where paged_kv's pages hold "
                 "keys and values of one head_dim (16)", id="v_head_dim of its own"),
])
def test_keys_and_values_of_other_head_dims_are_named(config, found):
    assert unsupported_features(config()) == [found]


def test_latent_attention_is_left_to_a_caller_that_serves_it():
    """``latent=True`` (the engine, which pages DeepSeek's latent itself) names no head dim
    of a ``kv_lora_rank`` config; a plain ``v_head_dim`` of its own is still named."""
    deepseek = transformers.DeepseekV3Config(
        kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        **{**WITHOUT_HEAD_DIM, "num_key_value_heads": 4})
    assert unsupported_features(deepseek, latent=True) == []
    mimo = transformers.CONFIG_MAPPING["mimo_v2_flash"](v_head_dim=8, **COMMON)
    assert unsupported_features(mimo, latent=True) != []


@pytest.mark.parametrize(("per_layer", "found"), [
    pytest.param({1: {"intermediate_size": 64}}, [], id="mlp width: served"),
    pytest.param({1: {"num_key_value_heads": 1}},
                 ["num_key_value_heads varying by layer (per_layer_config)"], id="kv heads"),
    pytest.param({1: {"head_dim": 8}}, ["head_dim varying by layer (per_layer_config)"],
                 id="head_dim"),
    pytest.param({1: {"skip": ["self_attn"]}}, ["skip varying by layer (per_layer_config)"],
                 id="a skipped attention"),
])
def test_per_layer_attention_settings_are_named(per_layer, found):
    """transformers' heterogeneous configs (``per_layer_config``) raise on reading a
    per-layer setting globally; `unsupported_features` names those that shape a layer's
    K/V or kind (the pool has one shape) instead of raising."""
    config = transformers.LlamaConfig(per_layer_config=per_layer, **COMMON)
    assert unsupported_features(config) == found
