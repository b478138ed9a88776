"""Models whose attention the paged kernels do not implement are refused, never served.

A sliding window, chunked local attention, soft-capped attention logits or learned sinks,
each ignored by the kernels, gave wrong tokens silently (greedy output differed from
transformers' own `generate` once the sequence passed the window; gpt-oss's even with no
window in play). Every entry point — `HFCausalLM`, `paged-kv demo --model`, `paged-kv serve
--model` — refuses them with the model type and the setting; `PagedCache`, whose model runs
its own attention on the K/V it returns, refuses windows only.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.cli import main  # noqa: E402
from paged_kv.integrations.hf_support import (  # noqa: E402
    UnsupportedModelError,
    loaded_model_features,
    unsupported_features,
)
from paged_kv.serving import Engine, SamplingParams  # noqa: E402
from paged_kv.serving.hf import HFCausalLM  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              head_dim=16, initializer_range=0.3)


def _configs() -> dict[str, tuple[object, str]]:
    """``{name: (config, a setting the refusal must name)}``: one per feature and family."""
    t = transformers
    return {
        "mistral window": (t.MistralConfig(sliding_window=16, **COMMON),
                           "sliding_window=16 on every layer"),
        "qwen2 window": (t.Qwen2Config(use_sliding_window=True, sliding_window=16,
                                       max_window_layers=0, **COMMON), "sliding_window=16"),
        "gemma2 window and softcap": (t.Gemma2Config(sliding_window=16, query_pre_attn_scalar=16,
                                                     **COMMON), "attn_logit_softcapping=50.0"),
        "gemma2 softcap alone": (t.Gemma2Config(query_pre_attn_scalar=16,
                                                layer_types=["full_attention"] * 2, **COMMON),
                                 "attn_logit_softcapping=50.0"),
        "gemma3 five local to one global": (
            t.Gemma3TextConfig(sliding_window=16, query_pre_attn_scalar=16,
                               **{**COMMON, "num_hidden_layers": 6}),
            "sliding_window=16 on 5 'sliding_attention' layers"),
        "gpt-oss sinks, no window": (
            t.GptOssConfig(num_local_experts=4, num_experts_per_tok=2,
                           layer_types=["full_attention"] * 2, **COMMON), "attention sinks"),
        "llama4 chunked": (t.Llama4TextConfig(attention_chunk_size=16, **COMMON),
                           "attention_chunk_size=16"),
    }


CASES = sorted(_configs())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each config saved as a tiny random checkpoint (no download)."""
    paths = {}
    for name, (config, _) in _configs().items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name.replace(" ", "-").replace(",", ""))
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[name] = path
    return paths


@pytest.mark.parametrize("name", CASES)
def test_hf_causal_lm_refuses_the_model_naming_type_and_setting(name, checkpoints):
    config, setting = _configs()[name]
    with pytest.raises(UnsupportedModelError) as info:
        HFCausalLM.from_pretrained(checkpoints[name])
    message = str(info.value)
    assert repr(config.model_type) in message and setting in message
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name])
    with pytest.raises(UnsupportedModelError, match=setting.split("=")[0]):
        HFCausalLM(model)  # a model built in Python, not only a checkpoint, is refused


@pytest.mark.parametrize("command", ["demo", "serve"])
@pytest.mark.parametrize("name", ["mistral window", "gpt-oss sinks, no window"])
def test_command_line_refuses_before_starting(name, command, checkpoints, capsys):
    """Exit 2 with the reason at parse time: no engine core is spawned, no port bound."""
    config, setting = _configs()[name]
    with pytest.raises(SystemExit) as info:
        main([command, "--model", str(checkpoints[name]), "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert repr(config.model_type) in err and setting in err


def test_sinks_are_found_on_the_loaded_modules_when_the_config_is_silent():
    config, _ = _configs()["gpt-oss sinks, no window"]
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert loaded_model_features(model) == ["attention sinks (2 layers with a 'sinks' "
                                            "parameter)"]
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    assert loaded_model_features(llama) == [] and unsupported_features(llama.config) == []


def test_a_window_no_sequence_can_reach_is_served_and_matches_generate(tmp_path):
    """``sliding_window >= max_position_embeddings`` never cuts a sequence: not refused, and
    the tokens are transformers' own."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(sliding_window=256, **COMMON)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    runner = HFCausalLM.from_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = torch.tensor([prompt])
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=8, pad_token_id=127)[0, 40:].tolist()
    engine = Engine(runner, runner.cache_config(num_blocks=32))
    assert engine.generate([prompt], SamplingParams(max_tokens=8))[0].outputs[0].token_ids \
        == want


def test_a_window_set_after_loading_fails_the_step_instead_of_serving_it(tmp_path):
    """The attention function's own guard: a layer asking for a window at run time (a model
    the config check did not know) raises instead of attending to everything."""
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **COMMON)
                                    ).save_pretrained(tmp_path)
    runner = HFCausalLM.from_pretrained(tmp_path)
    runner.model.config.sliding_window = 8  # Mistral's attention reads it on every call
    engine = Engine(runner, runner.cache_config(num_blocks=32))
    output = engine.generate([list(range(20))], SamplingParams(max_tokens=2))[0]
    assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == []
    assert "sliding_window=8" in output.error and "UnsupportedModelError" in output.error
    assert engine.cache.stats().num_live_blocks == 0
