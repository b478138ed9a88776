"""Which transformers model types paged_kv's engine serves, and why the others are refused.

The engine (`paged_kv.engine.hf.HFCausalLM`, ``paged-kv demo|serve --model``) runs a
model's own modules and swaps its attention function for the paged one, which writes each
layer's K/V into the pool and attends from the pages. That gives the model's own tokens
only when every layer reaches that function with keys and values of the pool's one shape
and asks for what it computes — and a config does not always say so: ALiBi biases,
attention code that never calls the function, an encoder's bidirectional attention, keys
and values of other head dims. A model accepted on its config alone was served 500s (every
DeepSeek V3 step failed on its keys' head dim, before the engine ran latent attention
itself) or, worse, wrong tokens (a BERT encoder).

So the engine serves the model types of `SERVED_MODEL_TYPES`, each checked on a tiny random
checkpoint against transformers' own greedy ``generate``
(tests/integrations/test_architectures.py runs every one), and refuses every other type
by name before any weight is read, saying why where it is known (`REFUSED_MODEL_TYPES`).
DeepSeek V2 / V3 (`LATENT_MODEL_TYPES`) are served with latent pages: the engine gives their
attention modules a forward of its own (`paged_kv.engine.hf_latent`); a sparse indexer
(V3.2) is refused.
A served type is still refused for settings its config turns on that paged_kv does not
serve (`hf_support.unsupported_features`: linear or recurrent layers, cross-attention,
latent attention, ...), and for the few settings only its model type tells apart
(`engine_features`).

`PagedCache` (``generate`` with the model's own attention) needs none of this: it reads
`hf_support.unsupported_features` alone.
"""

from __future__ import annotations

from .hf_layers import RECURRENT_MODEL_TYPES, model_layers
from .hf_support import (
    UnsupportedModelError,
    _message,
    layer_kinds,
    require_supported,
    unsupported_features,
)

__all__ = ["LATENT_MODEL_TYPES", "REFUSED_MODEL_TYPES", "SERVED_MODEL_TYPES", "engine_features",
           "latent_head_dim", "require_served"]

# multi-head latent attention the engine runs itself (`paged_kv.engine.hf_latent`: the
# latent paged, attention in the absorbed form), each checked against transformers' generate
# (tests/engine/test_latent_models.py)
LATENT_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
# config fields of a sparse attention indexer (DeepSeek V3.2's lightning indexer picks the
# keys each query reads): the latent attention would read them all, other tokens
INDEXER_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")

# each one's tiny random checkpoint gives generate's greedy tokens through the engine, its
# window or chunk (where its config has one) cutting the prompt
SERVED_MODEL_TYPES = frozenset({
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "bert",
    "bert-generation", "biogpt", "bitnet", "camembert", "codegen", "cohere", "cohere2",
    "cohere2_moe", "ctrl", "cwm", "data2vec-text", "dbrx", "doge", "dots1", "electra",
    "ergo", "ernie", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe",
    "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe",
    "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox", "gpt_oss", "gptj", "granite",
    "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "helium",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3",
    "iquestcoder", "jais2", "kolibri1", "laguna", "lfm2", "lfm2_moe", "llama",
    "llama4_text", "mellum", "minicpm5_moe", "minimax_m2", "minimax_m3_vl_text",
    "ministral", "ministral3", "mistral", "mixtral", "modernbert-decoder", "moshi",
    "nanochat", "olmo", "olmo2", "olmo3", "olmoe", "opt", "param2moe", "persimmon",
    "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "roberta",
    "roberta-prelayernorm", "roc_bert", "sarvam_moe", "seed_oss", "smollm3",
    "solar_open", "starcoder2", "vaultgemma", "xlm-roberta", "xlm-roberta-xl"
})

# encoders whose self-attention is causal only as a decoder (``is_decoder=True``, as
# BertLMHeadModel asks); an encoder checkpoint attends both ways
CAUSAL_ONLY_AS_DECODER = frozenset({
    "bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie",
    "roberta", "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl"
})

# attention modules that never pass their window to the attention function: transformers
# windows them through its attention mask alone, which the paged attention neither reads
# nor can check against the cache's layer kinds (the step fails on the disagreement)
WINDOW_IN_MASK_ONLY = frozenset({"doge", "moshi", "phimoe", "qwen2_moe"})

_REASONS = {
    "ALiBi position biases": "bloom mpt",
    "attention modules that call the attention function without the step's arguments "
    "(the paged cache never reaches it)": "falcon nemotron stablelm",
    "attention that does not dispatch through config._attn_implementation (the paged "
    "attention never runs)": "big_bird gpt_neo gpt_neox_japanese hrm_text megatron-bert "
                             "openai-gpt rembert roformer trocr xglm",
    "the decoder of an encoder-decoder model (decoder_attention_heads, cross-attention to "
    "an encoder)": "bart bigbird_pegasus blenderbot blenderbot-small marian mbart mvp "
                   "pegasus plbart prophetnet whisper",
    "multi-head latent attention (keys and values of other head dims than the pages')":
        "axk1 glm4_moe_lite longcat_flash minicpm3 sarvam_mla youtu",
    "a sparse attention indexer (each query attends to the top-k keys an indexer picks)":
        "axk2 deepseek_v32 deepseek_v4",
    "keys and values of other head dims or heads than head_dim and num_key_value_heads":
        "jetmoe mimo_v2_flash",
    "differential attention (two softmax maps per head, subtracted)": "diffllama",
    "recurrent state (no attention K/V to page)":
        "recurrent_gemma rwkv xlstm zamba zamba2",
    "language adapters chosen per input (set_default_language)": "xmod",
    "two-stream relative attention with no position limit": "xlnet",
}
# every model type the engine serves
ENGINE_MODEL_TYPES = SERVED_MODEL_TYPES | RECURRENT_MODEL_TYPES | LATENT_MODEL_TYPES
# why each of these model types is refused whatever its config says (the others outside
# SERVED_MODEL_TYPES: not checked)
REFUSED_MODEL_TYPES = {model_type: reason for reason, types in _REASONS.items()
                       for model_type in types.split()}


def engine_features(config: object) -> list[str]:
    """What of `config` the engine does not serve: `unsupported_features`, a composite
    (multimodal) config, a model type outside `SERVED_MODEL_TYPES`, an encoder that is not a
    decoder, a window its modules do not pass.

    Parameters
    ----------
    config : transformers.PreTrainedConfig
        The checkpoint's config (``config.json``), as loaded: its own ``model_type`` decides.

    Returns
    -------
    list of str
        Reasons, empty when the engine serves the model.
    """
    model_type = getattr(config, "model_type", None)
    latent = model_type in LATENT_MODEL_TYPES
    found = unsupported_features(config, layers=model_type not in RECURRENT_MODEL_TYPES,
                                 latent=latent)
    if latent:
        found += _latent_features(config)
    if model_type in RECURRENT_MODEL_TYPES:  # its recurrent layers run through mixers
        try:
            model_layers(config)
        except UnsupportedModelError as error:
            found += error.features
    getter = getattr(config, "get_text_config", None)
    if model_type in REFUSED_MODEL_TYPES:
        found.append(REFUSED_MODEL_TYPES[model_type])
    elif getter is not None and getter(decoder=True) is not config:
        found.append("a composite (multimodal) config around its text model's: the engine "
                     "serves text-only causal LMs, so serve the text model's checkpoint")
    elif model_type not in ENGINE_MODEL_TYPES:
        found.append("attention the engine is not checked to compute (model type not among "
                     "those it serves, listed below)")
    if model_type in CAUSAL_ONLY_AS_DECODER and not getattr(config, "is_decoder", False):
        found.append("is_decoder=False (an encoder: bidirectional attention)")
    if model_type in WINDOW_IN_MASK_ONLY and not found \
            and any(kind.window or kind.chunk for kind in layer_kinds(config)):
        found.append("a sliding window its attention modules do not pass to the attention "
                     "function (transformers applies it in the mask alone)")
    return list(dict.fromkeys(found))


def latent_head_dim(config: object) -> int:
    """The pages' head_dim of a latent layer: half of ``kv_lora_rank + qk_rope_head_dim``
    (the engine keeps a token's latent as one kv head, its first half in the K plane and its
    second in the V plane: 288 for DeepSeek V3's 512 + 64).

    Raises
    ------
    UnsupportedModelError
        The sum is odd (it does not split in two halves), naming both settings.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config
    width = text.kv_lora_rank + text.qk_rope_head_dim
    if width % 2:
        raise UnsupportedModelError(_message(text, [_odd(text)], "paged_kv"), [_odd(text)])
    return width // 2


def _latent_features(config: object) -> list[str]:
    """What of a latent model type's config the engine does not serve: an indexer, a latent
    row of odd width."""
    found = [f"{name}={getattr(config, name)!r} (a sparse attention indexer)"
             for name in INDEXER_FIELDS if getattr(config, name, None) is not None]
    width = (getattr(config, "kv_lora_rank", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0)
                                                          or 0)
    if width % 2:
        found.append(_odd(config))
    return found


def _odd(config: object) -> str:
    return (f"kv_lora_rank + qk_rope_head_dim = {config.kv_lora_rank} + "
            f"{config.qk_rope_head_dim}, odd (the latent pages hold the row in two halves)")


def require_served(config: object, who: str) -> None:
    """Raise `UnsupportedModelError` (a ValueError) naming the model type, every reason of
    `engine_features` and the model types the engine serves; return when there is none.

    Examples
    --------
    >>> from transformers import BloomConfig
    >>> try:
    ...     require_served(BloomConfig(hidden_size=64, n_head=4), "HFCausalLM")
    ... except ValueError as error:
    ...     print(str(error)[:56])
    HFCausalLM: model type 'bloom' is not supported: it uses
    """
    require_supported(config, who, engine_features(config),
                      note=f". paged_kv's engine serves these model types, each checked "
                           f"against transformers' own generate: "
                           f"{', '.join(sorted(ENGINE_MODEL_TYPES))}")
