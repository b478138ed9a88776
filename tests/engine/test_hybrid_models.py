"""Hybrid-layer checkpoints served by the engine give transformers' own greedy tokens.

Tiny random checkpoints (no download) of each family with layers that read less than the
whole past — Mistral (a window on every layer), Qwen2 (``use_sliding_window`` above
``max_window_layers``), Gemma 2 (local/global alternation, soft-capped logits), Gemma 3 text
(``sliding_window_pattern``), gpt-oss (window layers, learned sinks on every layer) and
Llama 4 text (chunked local attention) — all with a window or chunk of 16, against
``generate`` on the same checkpoint (eager attention, greedy, float32). Prompts of 10 and 80
tokens sit inside and far past the window; block sizes 4 and 6 divide the window and do
not; a prefill budget of 12 tokens splits the 80-token prompt into chunks that straddle the
window's edge.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.config import LayerKind  # noqa: E402
from paged_kv.engine import Engine, SamplingParams  # noqa: E402
from paged_kv.engine.config import EngineConfig  # noqa: E402
from paged_kv.engine.hf import HFCausalLM  # noqa: E402
from paged_kv.integrations.hf_support import layer_kinds  # noqa: E402

from .conftest import prompt  # noqa: E402

WINDOW = 16
PROMPT_LENGTHS = (10, 80)
MAX_TOKENS = 8
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              head_dim=16, initializer_range=0.3)
SLIDING, FULL, CHUNKED = LayerKind.sliding(WINDOW), LayerKind.full(), LayerKind.chunked(WINDOW)


def hybrid_configs() -> dict[str, tuple[object, tuple[LayerKind, ...]]]:
    """``{family: (config, the layer kinds it must be served with)}``."""
    t = transformers
    four = {**COMMON, "num_hidden_layers": 4}
    return {
        "mistral": (t.MistralConfig(sliding_window=WINDOW, **COMMON), (SLIDING, SLIDING)),
        "qwen2": (t.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                max_window_layers=1, **{**COMMON, "num_hidden_layers": 3}),
                  (FULL, SLIDING, SLIDING)),
        # a soft-cap of 5 bites into these logits (Gemma 2's default 50 hardly would); with
        # tied embeddings this wide init makes a random Gemma say one token whatever it reads
        "gemma2": (t.Gemma2Config(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                  attn_logit_softcapping=5.0, tie_word_embeddings=False,
                                  **COMMON), (SLIDING, FULL)),
        "gemma3": (t.Gemma3TextConfig(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                      sliding_window_pattern=3, tie_word_embeddings=False,
                                      **four),
                   (SLIDING, SLIDING, FULL, SLIDING)),
        "gpt-oss": (t.GptOssConfig(sliding_window=WINDOW, num_local_experts=4,
                                   num_experts_per_tok=2, **COMMON), (SLIDING, FULL)),
        "llama4": (t.Llama4TextConfig(attention_chunk_size=WINDOW, num_local_experts=2,
                                      intermediate_size_mlp=128, **four),
                   (CHUNKED, CHUNKED, CHUNKED, FULL)),
    }


FAMILIES = sorted(hybrid_configs())


def save_checkpoint(config: object, path) -> None:
    """A seeded random model of `config` saved to `path`; gpt-oss's sinks are drawn large
    enough to take a real share of each softmax."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for name, parameter in model.named_parameters():
        if name.endswith(".sinks"):
            torch.nn.init.uniform_(parameter, 1.0, 4.0)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    paths = {}
    for family, (config, _) in hybrid_configs().items():
        paths[family] = tmp_path_factory.mktemp(family)
        save_checkpoint(config, paths[family])
    return paths


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[tuple[str, int], list[int]]:
    """transformers' greedy tokens per (family, prompt length), eager attention, float32."""
    found = {}
    for family, path in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        for length in PROMPT_LENGTHS:
            ids = torch.tensor([prompts()[length]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
            found[family, length] = out[0, length:].tolist()
    return found


def prompts() -> dict[int, list[int]]:
    return {length: prompt(length, seed=length, vocab_size=128) for length in PROMPT_LENGTHS}


def engine_for(path, block_size: int, **kwargs) -> Engine:
    runner = HFCausalLM.from_pretrained(path)
    return Engine(runner, EngineConfig(
        cache=runner.cache_config(num_blocks=128, block_size=block_size), **kwargs))


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_kinds_follow_the_config(family):
    config, kinds = hybrid_configs()[family]
    assert layer_kinds(config) == kinds


def edge_configs() -> dict[str, tuple[object, tuple[LayerKind, ...]]]:
    """Configs whose kinds are easy to get wrong: ``{case: (config, kinds)}``."""
    t = transformers
    return {
        # Mistral's modeling applies sliding_window to every layer; a stray layer_types
        # attribute (MistralConfig has no such field) is never read
        "mistral ignores layer_types": (
            t.MistralConfig(sliding_window=WINDOW, layer_types=["full_attention"] * 2,
                            **COMMON), (SLIDING, SLIDING)),
        "a window past every position is full": (
            t.MistralConfig(sliding_window=256, **COMMON), (FULL, FULL)),
        "qwen2 without use_sliding_window": (
            t.Qwen2Config(use_sliding_window=False, sliding_window=WINDOW, max_window_layers=0,
                          **COMMON), (FULL, FULL)),
        "qwen2 max_window_layers=0": (
            t.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                          **COMMON), (SLIDING, SLIDING)),
        "a chunk past every position is full": (
            t.Llama4TextConfig(attention_chunk_size=256, **{**COMMON, "num_hidden_layers": 4}),
            (FULL,) * 4),
        "legacy 'attention' layer type": (
            t.Gemma2Config(sliding_window=WINDOW, query_pre_attn_scalar=16,
                           layer_types=["attention", "sliding_attention"], **COMMON),
            (FULL, SLIDING)),
    }


@pytest.mark.parametrize("case", sorted(edge_configs()))
def test_layer_kinds_edge_cases(case):
    config, kinds = edge_configs()[case]
    assert layer_kinds(config) == kinds


@pytest.mark.parametrize("block_size", [4, 6])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_generate(family, block_size, checkpoints, expected):
    """Both prompts in one batch; block 4 divides the window, block 6 does not."""
    engine = engine_for(checkpoints[family], block_size)
    assert engine.cache.config.layer_kinds == hybrid_configs()[family][1]
    outputs = engine.generate(list(prompts().values()), greedy())
    for length, output in zip(PROMPT_LENGTHS, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[family, length], \
            f"{family}, block {block_size}, prompt of {length} tokens"
    engine.cache.check()
    assert engine.cache.stats().num_live_blocks == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_across_the_window_edge(family, checkpoints, expected):
    """A 12-token prefill budget: the 80-token prompt runs in chunks of 12, each of whose
    queries reads keys of the chunk before it (window 16), with block 6 (no divisor)."""
    engine = engine_for(checkpoints[family], 6, max_num_batched_tokens=12)
    output = engine.generate([prompts()[80]], greedy())[0]
    assert output.outputs[0].token_ids == expected[family, 80]
    engine.cache.check()


@pytest.mark.parametrize("family", FAMILIES)
def test_forks_and_a_repeated_prompt_match_generate(family, checkpoints, expected):
    """n=2 forks share the prompt's blocks; the same prompt again is a prefix hit; every
    sample's tokens are transformers' own."""
    engine = engine_for(checkpoints[family], 4)
    first = engine.generate([prompts()[80]], greedy(n=2))[0]
    assert [sample.token_ids for sample in first.outputs] == [expected[family, 80]] * 2
    again = engine.generate([prompts()[80]], greedy())[0]
    assert again.outputs[0].token_ids == expected[family, 80]
    assert again.prefix_hit_tokens > 0, "a repeated prompt must hit the prefix cache"
    engine.cache.check()
