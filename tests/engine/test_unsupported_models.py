"""Models paged_kv cannot serve are refused, never served wrong tokens; the hybrid models it
once refused are served with transformers' own tokens.

Linear (recurrent, Mamba) layers, a layer type paged_kv does not know, cross-attention and
bidirectional attention would each be served wrong tokens, so every entry point —
`HFCausalLM`, `paged-kv demo --model`, `paged-kv serve --model`, `PagedCache` — refuses them
with the model type and the setting or layer type, reading only the config. Sliding
windows, chunked layers, soft-capped logits and learned sinks, refused until the kernels
computed them, are served (tests/engine/test_hybrid_models.py covers each family; here:
the cases that were refused alone, and the command line).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.cli import build_parser, main  # noqa: E402
from paged_kv.engine import Engine, SamplingParams  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.integrations.hf_architectures import engine_features  # noqa: E402
from paged_kv.integrations.hf_support import (  # noqa: E402
    UnsupportedModelError,
    unsupported_features,
)
from paged_kv.integrations.transformers import PagedCache  # noqa: E402

from ..conftest import save_configs  # noqa: E402
from .conftest import prompt  # noqa: E402
from .test_hybrid_models import COMMON, hybrid_configs, save_checkpoint  # noqa: E402


def _refused() -> dict[str, tuple[object, str]]:
    """``{name: (config, what the refusal must name)}``: one per kind paged_kv refuses."""
    t = transformers
    four = {**COMMON, "num_hidden_layers": 4}
    return {
        # attention and a recurrent state in one layer, in shared blocks (Zamba2's; the
        # engine serves Falcon-H1's, which run attention and one mixer side by side)
        "zamba2 hybrid layers": (t.Zamba2Config(**{**four, "layers_block_type": [
            "mamba", "hybrid", "mamba", "hybrid"]}), "2 'hybrid' layers"),
        "a linear_attention layer set on qwen2": (
            t.Qwen2Config(layer_types=["full_attention", "linear_attention"], **COMMON),
            "1 'linear_attention' layers"),
        "cross-attention": (t.LlamaConfig(add_cross_attention=True, **COMMON),
                            "add_cross_attention=True"),
        "bidirectional gemma3": (t.Gemma3TextConfig(use_bidirectional_attention=True,
                                                    query_pre_attn_scalar=16, **COMMON),
                                 "use_bidirectional_attention=True"),
    }


REFUSED = sorted(_refused())


@pytest.fixture(scope="module")
def refused_checkpoints(tmp_path_factory):
    """Each refused config saved alone: the refusal reads config.json, never the weights."""
    return save_configs(tmp_path_factory, _refused())


@pytest.mark.parametrize("name", REFUSED)
def test_hf_causal_lm_refuses_the_model_naming_type_and_layer_type(name, refused_checkpoints):
    config, setting = _refused()[name]
    with pytest.raises(UnsupportedModelError) as info:
        HFCausalLM.from_pretrained(refused_checkpoints[name])
    message = str(info.value)
    assert repr(config.model_type) in message and setting in message
    assert any(setting in feature for feature in info.value.features)
    with pytest.raises(UnsupportedModelError, match=setting):
        PagedCache(config, num_blocks=8)


def test_the_transformers_cache_refuses_recurrent_layers_the_engine_serves():
    """`PagedCache` pages attention only: a hybrid of recurrent layers is the engine's."""
    config = transformers.Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 4})
    with pytest.raises(UnsupportedModelError, match="3 'linear_attention' layers"):
        PagedCache(config, num_blocks=8)


def test_falcon_h1_is_served_by_the_engine_and_refused_by_paged_cache():
    """Falcon-H1's layers attend and keep a Mamba-2 state at once: the engine serves them
    (two cache layers each; tests/engine/test_recurrent_models.py checks the tokens),
    `PagedCache`, which pages the attention alone, still refuses them."""
    config = transformers.FalconH1Config(**{**COMMON, "num_hidden_layers": 4})
    assert engine_features(config) == []
    with pytest.raises(UnsupportedModelError, match="4 'hybrid' layers"):
        PagedCache(config, num_blocks=8)


def test_a_model_built_in_python_is_refused_too():
    config, setting = _refused()["a linear_attention layer set on qwen2"]
    model = transformers.AutoModelForCausalLM.from_config(config)  # builds: qwen2 ignores it
    with pytest.raises(UnsupportedModelError, match=setting):
        HFCausalLM(model)


@pytest.mark.parametrize("command", ["demo", "serve"])
@pytest.mark.parametrize("name", ["zamba2 hybrid layers", "cross-attention"])
def test_command_line_refuses_before_starting(name, command, refused_checkpoints, capsys):
    """Exit 2 with the reason at parse time: no engine core is spawned, no port bound."""
    config, setting = _refused()[name]
    with pytest.raises(SystemExit) as info:
        main([command, "--model", str(refused_checkpoints[name]), "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert repr(config.model_type) in err and setting in err


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    save_checkpoint(hybrid_configs()["gemma3"][0], path)
    return path


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_command_line_accepts_a_hybrid_checkpoint(command, gemma3_checkpoint):
    args = build_parser().parse_args([command, "--model", str(gemma3_checkpoint)])
    assert args.model == str(gemma3_checkpoint)


def test_demo_serves_a_hybrid_checkpoint(gemma3_checkpoint, capsys):
    assert main(["demo", "--model", str(gemma3_checkpoint), "--num-requests", "4",
                 "--memory-mib", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_requests"] == 4 and report["generated_tokens"] > 0
    assert "Gemma3ForCausalLM" in report["model"]


def _once_refused() -> dict[str, object]:
    """Configs whose soft-cap or sinks alone got them refused before the kernels had them."""
    t = transformers
    full = {**COMMON, "layer_types": ["full_attention"] * 2}
    return {
        "gemma2 softcap alone": t.Gemma2Config(query_pre_attn_scalar=24, tie_word_embeddings=False,
                                               attn_logit_softcapping=5.0, **full),
        "gpt-oss sinks, no window": t.GptOssConfig(num_local_experts=4, num_experts_per_tok=2,
                                                   **full),
    }


@pytest.mark.parametrize("name", sorted(_once_refused()))
def test_softcap_or_sinks_alone_are_served_with_generate_tokens(name, tmp_path):
    """gpt-oss gave wrong tokens with no window in play (its sinks were dropped): now its
    tokens, and a soft-capped Gemma 2's, are transformers' own, from a checkpoint and from a
    model built in Python."""
    config = _once_refused()[name]
    assert unsupported_features(config) == []
    save_checkpoint(config, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    tokens = prompt(40, seed=1, vocab_size=128)
    ids = torch.tensor([tokens])
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=8, eos_token_id=None,
                              pad_token_id=0)[0, 40:].tolist()
    for runner in (HFCausalLM.from_pretrained(tmp_path), HFCausalLM(reference)):
        engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32)))
        output = engine.generate([tokens], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert output.outputs[0].token_ids == want


def test_a_window_no_sequence_can_reach_is_served_and_matches_generate(tmp_path):
    """``sliding_window >= max_position_embeddings`` never cuts a sequence: the layers are
    full attention (so the window check in the attention function agrees), and the tokens
    are transformers' own."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(sliding_window=256, **COMMON)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    runner = HFCausalLM.from_pretrained(tmp_path)
    assert runner.cache_config().layer_kinds == ()  # all full: today's layout
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = prompt(40, seed=1, vocab_size=128)
    ids = torch.tensor([tokens])
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=8, pad_token_id=127)[0, 40:].tolist()
    engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32)))
    assert engine.generate([tokens], SamplingParams(max_tokens=8))[0].outputs[0].token_ids \
        == want


def test_a_window_set_after_loading_fails_the_step_instead_of_serving_it(tmp_path):
    """The attention function's own guard: a layer asking for a window the cache does not
    serve it with (its config changed after loading, or a model whose modules and config
    disagree) raises, naming the layer and both windows, instead of attending wrongly."""
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **COMMON)
                                    ).save_pretrained(tmp_path)
    runner = HFCausalLM.from_pretrained(tmp_path)
    runner.model.config.sliding_window = 8  # Mistral's attention reads it on every call
    engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32)))
    output = engine.generate([list(range(20))], SamplingParams(max_tokens=2))[0]
    assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == []
    assert "UnsupportedModelError" in output.error and "layer 0" in output.error
    assert "sliding_window=8" in output.error and "as full (window 0)" in output.error
    assert engine.cache.stats().num_live_blocks == 0


def test_a_layer_that_never_attends_through_the_cache_fails_the_step(tmp_path):
    """A layer whose attention does not reach the paged attention function (a recurrent
    layer, a module with its own attention code) kept no past: the step fails, naming it."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    runner = HFCausalLM.from_pretrained(tmp_path)
    attention = runner.model.model.layers[1].self_attn
    attention.forward = lambda hidden_states, *args, **kwargs: (torch.zeros_like(
        hidden_states), None)
    engine = Engine(runner, EngineConfig(cache=runner.cache_config(num_blocks=32)))
    output = engine.generate([list(range(20))], SamplingParams(max_tokens=2))[0]
    assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == []
    assert "layers [1] did not attend through the paged cache" in output.error
