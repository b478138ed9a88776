"""paged_kv.integrations.recurrent against the states transformers' own cache holds: for each
recurrent family transformers builds, a tiny random model runs a prefill and a decode step
with ``use_cache=True``, and the conv / SSM / delta-rule tensors its cache layers hold (which
layers, shape without the batch dim, dtype, bytes) must be what `recurrent_layers` says."""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.integrations.recurrent import (  # noqa: E402
    CACHE_ATTRIBUTES,
    RECURRENCES,
    StateSpec,
    hybrid_layers,
    recurrent_layers,
    state_bytes_per_sequence,
)

BATCH, PROMPT = 2, 3
TINY = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# every dim that reaches a state differs from the others it could be confused with (heads
# 4, head dim 16 or 12, SSM state 6, groups 2, kernel 3 or 5, hidden 32), so a reader
# that takes the wrong field gives the wrong shape
GDN = dict(linear_conv_kernel_dim=5, linear_key_head_dim=8, linear_value_head_dim=12,
           linear_num_key_heads=2, linear_num_value_heads=4, head_dim=8)
GRANITE = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=6, mamba_d_head=16,
               mamba_d_conv=3, mamba_chunk_size=8)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)


def _configs() -> dict[str, object]:
    """Model type -> a builder of its tiny config (2-6 layers, recurrent and attention mixed
    where the family mixes them)."""
    t = transformers
    return {
        "qwen3_next": lambda: t.Qwen3NextConfig(
            **TINY, **GDN, **MOE, num_hidden_layers=4, num_experts=4,
            shared_expert_intermediate_size=16),
        "qwen3_5_text": lambda: t.Qwen3_5TextConfig(**TINY, **GDN, num_hidden_layers=4),
        "qwen3_5_moe_text": lambda: t.Qwen3_5MoeTextConfig(
            **TINY, **GDN, **MOE, num_hidden_layers=4, num_experts=4,
            shared_expert_intermediate_size=16),
        "olmo_hybrid": lambda: t.OlmoHybridConfig(**TINY, **GDN, num_hidden_layers=4),
        "mamba2": lambda: t.Mamba2Config(
            vocab_size=64, hidden_size=32, num_heads=4, head_dim=16, state_size=6, n_groups=2,
            conv_kernel=3, chunk_size=8, num_hidden_layers=2),
        "falcon_h1": lambda: t.FalconH1Config(  # mamba_d_ssm != mamba_expand * hidden_size
            **TINY, **{**GRANITE, "mamba_d_head": 12}, mamba_d_ssm=48, head_dim=8,
            num_hidden_layers=2),
        "granitemoehybrid": lambda: t.GraniteMoeHybridConfig(
            **TINY, **GRANITE, num_hidden_layers=4, num_local_experts=2,
            shared_intermediate_size=16,
            layer_types=["mamba", "attention", "mamba", "attention"]),
        "bamba": lambda: t.BambaConfig(**TINY, **GRANITE, num_hidden_layers=3,
                                       attn_layer_indices=[1]),
        "nemotron_h": lambda: t.NemotronHConfig(
            **TINY, head_dim=8, ssm_state_size=6, mamba_num_heads=4, mamba_head_dim=12,
            n_groups=2, conv_kernel=3, chunk_size=8, n_routed_experts=4,
            moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
            layers_block_type=["mamba", "attention", "moe", "mlp", "mamba"]),
        "zamba2": lambda: t.Zamba2Config(
            **{**TINY, "num_key_value_heads": 4}, num_hidden_layers=4, mamba_d_state=6,
            mamba_d_conv=3, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=8,
            adapter_rank=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
        "mamba": lambda: t.MambaConfig(vocab_size=64, hidden_size=32, state_size=6,
                                       conv_kernel=3, num_hidden_layers=2),
        "falcon_mamba": lambda: t.FalconMambaConfig(vocab_size=64, hidden_size=32, state_size=6,
                                                    conv_kernel=3, num_hidden_layers=2),
        "jamba": lambda: t.JambaConfig(
            **TINY, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
            num_experts=2, mamba_d_state=6, mamba_d_conv=3, mamba_expand=2),
        "zamba": lambda: t.ZambaConfig(  # hybrid layers 2 and 4
            **{**TINY, "num_key_value_heads": 4}, num_hidden_layers=5, attn_layer_period=2,
            attn_layer_offset=1, n_mamba_heads=2, mamba_d_state=6, mamba_d_conv=3),
        "lfm2": lambda: t.Lfm2Config(**TINY, num_hidden_layers=4, full_attn_idxs=[1, 3],
                                     conv_L_cache=3),
        "lfm2_moe": lambda: t.Lfm2MoeConfig(
            **TINY, **MOE, num_hidden_layers=4, num_experts=4, num_dense_layers=1,
            layer_types=["conv", "full_attention", "conv", "full_attention"]),
    }


CONFIGS = _configs()


def _held_states(cache) -> dict[int, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]]:
    """Layer index -> (cache attribute, shape without the batch dim, dtype) of every conv /
    recurrent state tensor the cache layer holds, in its order (conv_states, then
    recurrent_states, each by state index); layers holding none left out."""
    held = {}
    for index, layer in enumerate(cache.layers):
        found = tuple((attribute, tuple(tensor.shape[1:]), tensor.dtype)
                      for attribute in ("conv_states", "recurrent_states")
                      for _, tensor in sorted((getattr(layer, attribute, None) or {}).items())
                      if tensor is not None)
        if found:
            held[index] = found
    return held


def _state_tensors(cache) -> list[torch.Tensor]:
    return [tensor for layer in cache.layers for attribute in ("conv_states", "recurrent_states")
            for tensor in (getattr(layer, attribute, None) or {}).values() if tensor is not None]


def _run(config, dtype: torch.dtype):
    """A prefill of PROMPT tokens (shorter than some kernels: the window is padded) and one
    decode step on a tiny random model; the cache transformers returns."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(3, 64, (BATCH, PROMPT))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        return model(ids[:, -1:], cache=cache, use_cache=True).cache


def _expected(specs: dict[int, tuple[StateSpec, ...]]) -> dict:
    return {index: tuple((CACHE_ATTRIBUTES[spec.name], spec.shape, spec.dtype)
                         for spec in layer) for index, layer in specs.items()}


def test_every_mapped_type_is_checked_here():
    assert set(CONFIGS) == set(RECURRENCES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_specs_equal_the_states_transformers_holds(model_type, dtype):
    config = CONFIGS[model_type]()
    assert config.model_type == model_type
    specs = recurrent_layers(config, dtype)
    cache = _run(config, dtype)
    assert specs, "every family here has recurrent layers"
    assert _held_states(cache) == _expected(specs)
    assert all(tensor.shape[0] == BATCH for tensor in _state_tensors(cache))
    held_bytes = sum(t.numel() * t.element_size() for t in _state_tensors(cache))
    assert state_bytes_per_sequence(specs) == held_bytes // BATCH
    assert held_bytes % BATCH == 0
    # the layers that also attend: K/V beside their states
    attending = tuple(i for i, layer in enumerate(cache.layers)
                      if i in specs and getattr(layer, "keys", None) is not None
                      and layer.keys.numel())
    assert hybrid_layers(config) == attending


def test_falcon_h1_every_layer_attends_and_is_recurrent():
    config = CONFIGS["falcon_h1"]()
    assert sorted(recurrent_layers(config)) == list(range(config.num_hidden_layers))
    assert hybrid_layers(config) == tuple(range(config.num_hidden_layers))


def test_ssm_state_is_float32_and_conv_follows_the_model_dtype_float16():
    # one Mamba and one delta-rule family (a first float16 conv1d costs seconds on the CPU)
    for model_type in ("mamba2", "qwen3_next"):
        config = CONFIGS[model_type]()
        specs = recurrent_layers(config, torch.float16)
        assert _held_states(_run(config, torch.float16)) == _expected(specs)
        assert {spec.dtype for layer in specs.values() for spec in layer} \
            == {torch.float16, torch.float32}


def test_composite_config_reads_its_text_config():
    text = CONFIGS["qwen3_5_text"]()
    composite = transformers.Qwen3_5Config(text_config=text.to_dict())
    assert composite.model_type == "qwen3_5"
    assert recurrent_layers(composite, torch.bfloat16) == recurrent_layers(text, torch.bfloat16)
    assert recurrent_layers(text, "bfloat16") == recurrent_layers(text, torch.bfloat16)


def test_a_model_with_no_recurrent_layer_gives_nothing():
    config = transformers.LlamaConfig(**TINY, num_hidden_layers=2)
    assert recurrent_layers(config) == {}
    assert hybrid_layers(config) == ()
    assert state_bytes_per_sequence(recurrent_layers(config)) == 0
    assert _held_states(_run(config, torch.float32)) == {}


@pytest.mark.parametrize("layer_type", ["linear_attention", "mamba", "conv", "hybrid"])
def test_an_unmapped_recurrent_type_is_refused_by_name(layer_type):
    config = types.SimpleNamespace(model_type="made_up_ssm", num_hidden_layers=3,
                                   layer_types=["full_attention", layer_type, layer_type])
    with pytest.raises(NotImplementedError, match=rf"'made_up_ssm' has 2 '{layer_type}' layers"):
        recurrent_layers(config)


@pytest.mark.parametrize("make, model_type, layer_type", [
    (lambda: transformers.RecurrentGemmaConfig(num_hidden_layers=3), "recurrent_gemma",
     "linear_attention"),
    (lambda: transformers.KimiLinearConfig(num_hidden_layers=4), "kimi_linear",
     "linear_attention"),
    (lambda: transformers.RwkvConfig(num_hidden_layers=2), "rwkv", "RWKV time mixing"),
])
def test_transformers_recurrent_types_not_mapped_are_refused(make, model_type, layer_type):
    with pytest.raises(NotImplementedError) as error:
        recurrent_layers(make())
    assert repr(model_type) in str(error.value) and repr(layer_type) in str(error.value)


def test_state_spec_bytes():
    spec = StateSpec("ssm", (4, 16, 6), torch.float32)
    assert (spec.numel, spec.nbytes) == (384, 1536)
    conv = StateSpec("conv", (88, 3), torch.bfloat16)
    assert state_bytes_per_sequence((conv, spec)) == 88 * 3 * 2 + 1536
    assert state_bytes_per_sequence({0: (conv, spec), 2: (conv,)}) == 2 * 88 * 3 * 2 + 1536
    with pytest.raises(TypeError):
        recurrent_layers(CONFIGS["mamba"](), "not_a_dtype")
