"""Every model type the engine serves gives transformers' own greedy tokens; the others are
refused at load, by model type and reason, never served 500s or wrong tokens.

Each served type (`SERVED_MODEL_TYPES`) is built tiny from its own config class — 2 layers,
hidden 64, 4 query heads over 2 KV heads of 16, a window or chunk of 16 where the config
has one — with seeded random weights, and a 40-token prompt (past the window) gets 6 new
tokens through `Engine` on blocks of 6, against the same model's ``generate`` (eager
attention, greedy, float32). Each refused family is saved as ``config.json`` alone: the
refusal reads no weight.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.engine import Engine, SamplingParams  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.integrations.hf_architectures import (  # noqa: E402
    CAUSAL_ONLY_AS_DECODER,
    SERVED_MODEL_TYPES,
    engine_features,
)
from paged_kv.integrations.hf_support import UnsupportedModelError  # noqa: E402
from paged_kv.integrations.transformers import PagedCache  # noqa: E402

from ..conftest import ROOT, save_configs  # noqa: E402

PROMPT_LEN, MAX_TOKENS, BLOCK_SIZE = 40, 6, 6
# every field any served config class names for its size; each class takes those it has
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, initializer_range=0.3, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, n_layer=2, n_head=4, n_embd=64, n_positions=256,
            rotary_dim=8, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, intermediate_size_mlp=128,
            first_k_dense_replace=1, n_group=1, topk_group=1,
            # a window or chunk the 40-token prompt crosses (Qwen2-style: layer 1 up)
            sliding_window=16, attention_chunk_size=16, use_sliding_window=True,
            max_window_layers=1)
NO_WINDOW = dict(sliding_window=None, use_sliding_window=False)
EXTRA = {
    # the BERT family serves as a decoder only (BertLMHeadModel's is_decoder=True)
    **{model_type: dict(is_decoder=True) for model_type in CAUSAL_ONLY_AS_DECODER},
    # their modules pass no window to the attention function: served without one (a
    # window is refused, test_refused_family_at_load)
    **{model_type: NO_WINDOW for model_type in ("doge", "phimoe", "qwen2_moe")},
    "moshi": dict(sliding_window=256),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(moe_num_experts=2, moe_top_k=1, ffn_hidden_size=64)),
    "dots1": dict(n_shared_experts=1),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["full_attention"] * 2),
    "modernbert-decoder": dict(local_attention=32),  # a window of 16 on its local layers
}


def config_fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {field.name for field in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters)


def tiny_config(model_type: str, **fields: object) -> transformers.PreTrainedConfig:
    """`model_type`'s config class with the `TINY` fields it has, then `fields`."""
    cls = transformers.CONFIG_MAPPING[model_type]
    names = config_fields(cls)
    wanted = {**TINY, **EXTRA.get(model_type, {}), **fields}
    return cls(**{name: value for name, value in wanted.items() if name in names})


def tiny_model(config: transformers.PreTrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().float()


def assert_engine_gives_generate_tokens(model: torch.nn.Module, case: str) -> None:
    assert engine_features(model.config) == [], case
    model.config._attn_implementation = "eager"  # the reference: transformers' own
    tokens = torch.randint(3, 128, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    ids = tokens[None]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    runner = HFCausalLM(model)
    engine = Engine(runner, EngineConfig(
        cache=runner.cache_config(num_blocks=64, block_size=BLOCK_SIZE)))
    output = engine.generate([tokens.tolist()],
                             SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert output.error is None, output.error
    assert output.outputs[0].token_ids == want[0, PROMPT_LEN:].tolist(), case
    assert engine.cache.stats().num_live_blocks == 0


@pytest.mark.parametrize("model_type", sorted(SERVED_MODEL_TYPES))
def test_served_model_type_gives_generate_tokens(model_type):
    assert_engine_gives_generate_tokens(tiny_model(tiny_config(model_type)), model_type)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_head_dim_other_than_hidden_over_heads_gives_generate_tokens(model_type):
    """``head_dim`` 32 with hidden 64 over 4 heads (Gemma's and Qwen 3's checkpoints have
    such): the pages hold the config's head_dim, not hidden / heads."""
    model = tiny_model(tiny_config(model_type, head_dim=32))
    assert model.model.layers[0].self_attn.k_proj.out_features == 2 * 32
    assert_engine_gives_generate_tokens(model, model_type)


def _refused() -> dict[str, tuple[transformers.PreTrainedConfig, str]]:
    """``{family: (config, what the refusal must name)}``: one per refused family."""
    mla = dict(kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16, num_key_value_heads=4)
    return {
        "deepseek v3.2 sparse indexer": (tiny_config("deepseek_v32", **mla),
                                         "a sparse attention indexer"),
        "minicpm3 latent attention": (tiny_config("minicpm3", **mla),
                                      "multi-head latent attention (kv_lora_rank=16)"),
        "mimo v2 values of their own head dim": (tiny_config("mimo_v2_flash", v_head_dim=8),
                                                 "values of head dim 8"),
        "qwen3.5 multimodal with linear layers": (
            transformers.Qwen3_5Config(text_config=dict(TINY, num_hidden_layers=4)),
            "'linear_attention' layers"),
        # Falcon-H1's hybrid layers are served (tests/engine/test_recurrent_models.py);
        # Zamba2's shared attention blocks are not
        "zamba2 hybrid layers": (tiny_config("zamba2", layers_block_type=["mamba", "hybrid"]),
                                 "'hybrid' layers"),
        "gemma 3 multimodal": (transformers.Gemma3Config(text_config=dict(TINY)),
                               "composite (multimodal) config"),
        "llama 4 multimodal": (transformers.Llama4Config(text_config=dict(TINY)),
                               "composite (multimodal) config"),
        "gemma 4 head dims per layer": (tiny_config("gemma4_text"),
                                        "head_dim varying by layer"),
        "bloom alibi": (tiny_config("bloom"), "ALiBi position biases"),
        "falcon attention without the step's arguments": (tiny_config("falcon"),
                                                          "without the step's arguments"),
        "gpt-neo attention outside the interface": (tiny_config("gpt_neo", num_layers=2,
                                                                attention_types=[[["global"],
                                                                                  2]]),
                                                    "does not dispatch"),
        "bart decoder": (tiny_config("bart"), "decoder of an encoder-decoder"),
        "bert encoder": (tiny_config("bert", is_decoder=False), "is_decoder=False"),
        "diffllama differential attention": (tiny_config("diffllama"), "differential"),
        "qwen2-moe window its modules do not pass": (
            tiny_config("qwen2_moe", sliding_window=16, use_sliding_window=True),
            "a sliding window its attention modules"),
        "a model type not checked": (tiny_config("dory"), "not checked"),
    }


REFUSED = sorted(_refused())


@pytest.fixture(scope="module")
def refused_checkpoints(tmp_path_factory):
    """Each refused config saved alone (``config.json``, no weights)."""
    return save_configs(tmp_path_factory, _refused())


@pytest.mark.parametrize("family", REFUSED)
def test_refused_family_at_load(family, refused_checkpoints):
    """`HFCausalLM.from_pretrained` refuses before reading a weight, naming the model type,
    the reason, and the model types the engine serves."""
    config, reason = _refused()[family]
    with pytest.raises(UnsupportedModelError) as info:
        HFCausalLM.from_pretrained(refused_checkpoints[family])
    message = str(info.value)
    assert f"model type {config.model_type!r} is not supported" in message, message
    assert reason in message and any(reason in f for f in info.value.features), message
    assert "paged_kv's engine serves these model types" in message
    assert "llama, llama4_text, mamba, mamba2, mellum" in message  # the served types, by name


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_is_served_by_the_engine_and_refused_by_paged_cache(model_type):
    """The issue's case: a tiny random DeepSeek loaded in `HFCausalLM` and failed every step
    on ``write(): key: expected shape (40, 4, 8), got (40, 4, 24)``. The engine now pages
    its latent (one kv head of half a latent row: tests/engine/test_latent_models.py checks
    its tokens); `PagedCache`, which pages the per-head K/V the model's own attention hands
    its cache, still refuses it."""
    config = tiny_config(model_type, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
    assert engine_features(config) == []
    assert HFCausalLM(tiny_model(config)).kv_shape == (2, 1, 12)
    with pytest.raises(UnsupportedModelError, match="keys of head dim 24"):
        PagedCache(config, num_blocks=8)


def test_serve_refuses_to_start_on_deepseek_v32(tmp_path):
    """``paged-kv serve --model DIR`` on a whole tiny DeepSeek V3.2 checkpoint (a sparse
    indexer) exits 2 with the reason at parse time — no engine core, no port, no 500s."""
    config, reason = _refused()["deepseek v3.2 sparse indexer"]
    tiny_model(config).save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "paged_kv.cli", "serve", "--model",
                           str(tmp_path), "--port", "0"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "model type 'deepseek_v32' is not supported" in done.stderr
    assert reason in done.stderr and "Uvicorn running" not in done.stderr + done.stdout
