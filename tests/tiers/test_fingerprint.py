"""The tiers' fingerprint covers everything a block's K/V depends on: all the weights' bytes,
the model's config (RoPE, norms, attention) and the layers' kinds, for the embedded
TinyLlama and for a transformers model behind `HFCausalLM`; fields that cannot change K/V
(names, token ids, generation defaults) leave it as it is. Engines whose fingerprints
differ never share a block through a tier; the control (the same model again) does."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_kv.config import CacheConfig
from paged_kv.engine import TinyLlama, TinyLlamaConfig
from paged_kv.tiers import TierConfig
from paged_kv.tiers.identity import config_id, model_fingerprint, weights_id

from ..conftest import tiny_llama_config
from .conftest import TIER_MODEL, full_block_tokens, random_prompts, serve_prompts, tier_stats

PROMPT_LEN = 70  # 4 full blocks before the last token's block


def tiny(seed: int = 0, **config) -> TinyLlama:
    return TinyLlama(TinyLlamaConfig(**{**TIER_MODEL, **config}), seed=seed)


def with_row_changed(model: TinyLlama, row: int) -> TinyLlama:
    """A copy of `model` whose embedding differs in one element of one row (one bit)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        bits = other.embed.data.view(torch.int32)
        bits[row, other.config.hidden_size // 2 + 1] ^= 1  # the lowest mantissa bit
    return other


def middle_row(prompt: list[int]) -> int:
    """A token of `prompt` whose embedding row is neither in the first nor the last 4 KiB
    of the tensor (a sampling digest would read those)."""
    return next(t for t in prompt if 16 <= t < TIER_MODEL["vocab_size"] - 16)


def fingerprint_of(model) -> str:
    return model_fingerprint(model, model.cache_config(num_blocks=8)).namespace


def test_every_weight_byte_counts():
    model = tiny()
    assert weights_id(model) == weights_id(tiny())  # the same seed: the same weights
    for row in (0, 100, TIER_MODEL["vocab_size"] - 1):  # the middle of the tensor too
        changed = with_row_changed(model, row)
        assert weights_id(changed) != weights_id(model), row
        assert fingerprint_of(changed) != fingerprint_of(model), row


@pytest.mark.parametrize("field", [{"rope_theta": 500000.0}, {"rms_norm_eps": 1e-6}])
def test_tiny_llama_config_fields_count(field):
    model, other = tiny(), tiny(**field)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(),
                                                 strict=True)), "same weights"
    assert config_id(model) != config_id(other)
    assert fingerprint_of(model) != fingerprint_of(other)


def hf_pair(**changed):
    """Two `HFCausalLM` over tiny Llamas with the same weights; the second's config has
    `changed` fields."""
    transformers = pytest.importorskip("transformers")
    from paged_kv.engine.hf import HFCausalLM

    torch.manual_seed(0)
    first = transformers.LlamaForCausalLM(tiny_llama_config())
    second = transformers.LlamaForCausalLM(tiny_llama_config(**changed))
    second.load_state_dict(first.state_dict())
    return HFCausalLM(first), HFCausalLM(second)


@pytest.mark.parametrize("field", [
    {"rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rms_norm_eps": 1e-5},
])
def test_hf_config_fields_that_change_kv_count(field):
    first, second = hf_pair(**field)
    assert config_id(first) != config_id(second), field
    assert fingerprint_of(first) != fingerprint_of(second), field


@pytest.mark.parametrize("field", [{"eos_token_id": 5}, {"pad_token_id": 0},
                                   {"name_or_path": "/elsewhere/the-same-model"}])
def test_hf_fields_that_cannot_change_kv_are_left_out(field):
    first, second = hf_pair(**field)
    assert fingerprint_of(first) == fingerprint_of(second), field


def test_hf_weights_differing_in_one_row():
    first, second = hf_pair()
    assert fingerprint_of(first) == fingerprint_of(second)  # the control
    with torch.no_grad():
        second.model.model.embed_tokens.weight[77, 3] += 1e-3
    assert fingerprint_of(first) != fingerprint_of(second)


@pytest.mark.parametrize("model", ["tiny", "hf"])
def test_a_buffer_counts_like_a_weight(model):
    """RoPE tables are buffers, not parameters (TinyLlama's ``cos`` / ``sin``, a transformers
    model's ``inv_freq``): two models with the same parameters and config whose tables
    differ write other K/V for the same tokens, so their fingerprints differ."""
    if model == "tiny":
        first, second = tiny(), tiny()
        buffer = second.cos
    else:
        first, second = hf_pair()
        buffer = second.model.model.rotary_emb.inv_freq
    assert fingerprint_of(first) == fingerprint_of(second)  # the control
    with torch.no_grad():
        buffer[-1] *= 1.5  # the slowest-turning frequency: one element of one table
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(),
                                                 strict=True)), "same parameters"
    assert config_id(first) == config_id(second)
    assert weights_id(first) != weights_id(second)
    assert fingerprint_of(first) != fingerprint_of(second)


class Composite(torch.nn.Module):
    """A module under a composite transformers config (Llava: a Llama text config nested
    in it), one fixed weight: what a multimodal model's config looks like to
    `config_fields`."""

    def __init__(self, **text_fields) -> None:
        transformers = pytest.importorskip("transformers")
        super().__init__()
        text = dict(model_type="llama", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
        self.config = transformers.LlavaConfig(text_config={**text, **text_fields})
        self.proj = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.copy_(torch.arange(16.0).reshape(4, 4))
            self.proj.bias.zero_()


def composite_fingerprint(model: Composite) -> str:
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16,
                         num_blocks=8)
    return model_fingerprint(model, config).namespace


@pytest.mark.parametrize("field", [{"eos_token_id": 5}, {"pad_token_id": 0},
                                   {"_name_or_path": "/elsewhere/the-same-model"},
                                   {"initializer_range": 0.5}])
def test_fields_that_cannot_change_kv_are_left_out_of_nested_configs_too(field):
    """A text config nested in a composite config is filtered like a top-level one: it
    differing only in a field `IGNORED_CONFIG_FIELDS` names leaves the fingerprint as it
    is."""
    first, second = Composite(), Composite(**field)
    assert first.config.to_dict()["text_config"] != second.config.to_dict()["text_config"]
    assert config_id(first) == config_id(second), field
    assert composite_fingerprint(first) == composite_fingerprint(second), field


@pytest.mark.parametrize("field", [{"rms_norm_eps": 1e-5},
                                   {"rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 500000.0}}])
def test_nested_config_fields_that_change_kv_count(field):
    first, second = Composite(), Composite(**field)
    assert config_id(first) != config_id(second), field
    assert composite_fingerprint(first) != composite_fingerprint(second), field


# -- engines on one disk directory ------------------------------------------------------------
@pytest.mark.usefixtures("fetch_always")
@pytest.mark.parametrize("variant", ["rope_theta", "embedding_row"])
def test_engines_whose_kv_differ_share_nothing_on_one_disk(tmp_path, variant):
    from paged_kv.engine import Engine
    from paged_kv.engine.config import EngineConfig

    config = TierConfig(disk_dir=str(tmp_path / "disk"), disk_mib=8, fetch_deadline_s=5.0)
    prompts = random_prompts(3, PROMPT_LEN, seed=43)
    writer_model = tiny()
    other_model = (tiny(rope_theta=500000.0) if variant == "rope_theta"
                   else with_row_changed(writer_model, middle_row(prompts[0])))

    def serve(model) -> tuple[list[int], dict]:
        with Engine(model, EngineConfig(cache=model.cache_config(num_blocks=128),
                                        kv_tiers=config)) as engine:
            hits = [out.prefix_hit_tokens for out in serve_prompts(engine, prompts)]
            stats = tier_stats(engine)["disk"]
        return hits, stats

    assert serve(writer_model)[0] == [0, 0, 0]
    hits, stats = serve(other_model)
    assert hits == [0, 0, 0], stats
    assert stats.hit_tokens == stats.verify_failures == 0  # another namespace: never read
    # the control: the writer's model again hits every full block it wrote
    assert serve(tiny())[0] == [full_block_tokens(p) for p in prompts]


@pytest.mark.usefixtures("fetch_always")
def test_hf_engines_with_another_rope_theta_share_nothing(tmp_path):
    from paged_kv.engine import Engine
    from paged_kv.engine.config import EngineConfig

    config = TierConfig(disk_dir=str(tmp_path / "disk"), disk_mib=8, fetch_deadline_s=5.0)
    prompts = random_prompts(2, PROMPT_LEN, seed=47, vocab=128)
    first, second = hf_pair(rope_theta=500000.0)
    control, _ = hf_pair()

    def hits(model) -> list[int]:
        with Engine(model, EngineConfig(cache=model.cache_config(num_blocks=64),
                                        kv_tiers=config)) as engine:
            return [out.prefix_hit_tokens for out in serve_prompts(engine, prompts)]

    assert hits(first) == [0, 0]
    assert hits(second) == [0, 0]  # the same weights under another RoPE: other K/V
    assert hits(control) == [full_block_tokens(p) for p in prompts]
