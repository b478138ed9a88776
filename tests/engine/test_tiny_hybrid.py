"""`TinyLlama` with hybrid layers (sliding window, chunked-local, sinks, soft-cap) served by the
engine, against its cache-free reference `TinyLlama.forward_dense`.

The engine's greedy tokens must equal a plain loop over ``forward_dense`` (whose hybrid layers
run an explicit float32 softmax written from the definitions) for prompts shorter and longer
than the window, block sizes that do and do not divide it, chunked prefill across the window
edge, ``n`` forks and prefix hits; int8 pages agree up to a near tie. Every step is followed by
``cache.check()``. The config names any bad field.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from paged_kv import LayerKind, PagedKVCache
from paged_kv.engine import Engine, SamplingParams, TinyLlama, TinyLlamaConfig
from paged_kv.engine.config import EngineConfig
from paged_kv.engine.parallel import ModelSpec
from paged_kv.engine.threads import intra_op_threads
from paged_kv.tiers.identity import model_fingerprint

from ..conftest import make_engine
from .conftest import prompt
from .test_serving import assert_drained, drive, tokens_of

SHAPE = dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
             intermediate_size=128, vocab_size=256, max_position=512)
MIXED = ("sliding:8", "full", "sliding:8", "full")
VARIANTS = {
    "mixed": dict(layer_kinds=MIXED),
    "sliding": dict(layer_kinds=("sliding:8",) * 4),
    "chunked": dict(layer_kinds=("chunked:16", "full", "chunked:16", "full")),
    "sinks": dict(layer_kinds=MIXED, sinks=True),
    "softcap": dict(layer_kinds=MIXED, softcap=2.0),
}
# shorter than the window (8), at it, one past it, several windows, past two chunks of 16
PROMPTS = [prompt(length, seed=length, vocab_size=SHAPE["vocab_size"])
           for length in (3, 8, 9, 23, 41)]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: on a loaded machine more torch threads only wait on each other (the
    engines below take ``num_threads=1`` for the same reason)."""
    with intra_op_threads(1):
        yield


@pytest.fixture(scope="module")
def models() -> dict[str, TinyLlama]:
    """Every variant, plus "plain" (no hybrid feature): the same seed, so the same weights."""
    built = {name: TinyLlama(TinyLlamaConfig(**SHAPE, **extra)) for name, extra in
             VARIANTS.items()}
    built["plain"] = TinyLlama(TinyLlamaConfig(**SHAPE))
    return built


@pytest.fixture(scope="module")
def dense(models):
    """``dense(variant, prompt)``: greedy tokens of ``forward_dense`` (memoised)."""
    memo: dict[tuple, list[int]] = {}

    def run(variant: str, tokens: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        out = memo.setdefault((variant, tuple(tokens)), [])
        while len(out) < max_tokens:
            logits = models[variant].forward_dense(torch.tensor(tokens + out))
            out.append(int(logits[-1].argmax()))
        return out[:max_tokens]

    return run


def serve(model: TinyLlama, prompts: list[list[int]], params: SamplingParams = GREEDY,
          block_size: int = 4, kv_cache_dtype: str = "auto", **engine_args) -> list:
    """The outputs of `prompts`, all added at once, in order; the cache is checked after
    every step and drained at the end."""
    engine = Engine(model, EngineConfig(
        cache=model.cache_config(num_blocks=96, block_size=block_size,
                                 kv_cache_dtype=kv_cache_dtype),
        num_threads=1, **engine_args))
    ids, outputs, _ = drive(engine, {0: [(p, params) for p in prompts]})
    assert_drained(engine)
    return [outputs[i] for i in ids]


# -- the reference itself --------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_feature_changes_the_dense_tokens(dense, variant):
    """The variants are not the plain model in disguise: a kernel that ignored the window,
    the chunk, the sinks or the soft-cap would fail the engine tests below."""
    assert any(dense(variant, p) != dense("plain", p) for p in PROMPTS[1:])


@pytest.mark.parametrize("extra", [dict(layer_kinds=("sliding:600",) * 4),
                                   dict(layer_kinds=("chunked:600", "full") * 2),
                                   dict(softcap=1e7)], ids=["window", "chunk", "softcap"])
def test_explicit_softmax_equals_sdpa_where_the_feature_reads_everything(models, extra):
    """A window / chunk past every position, or a cap far above every score, is plain causal
    attention: the explicit float32 path agrees with SDPA's."""
    tokens = torch.tensor(PROMPTS[-1])
    wide = TinyLlama(TinyLlamaConfig(**SHAPE, **extra))
    torch.testing.assert_close(wide.forward_dense(tokens), models["plain"].forward_dense(tokens))


def test_sinks_of_minus_infinity_are_no_sinks(models):
    sunk = TinyLlama(TinyLlamaConfig(**SHAPE, sinks=True))
    for layer in sunk.layers:
        layer.sinks.fill_(-math.inf)
    tokens = torch.tensor(PROMPTS[-1])
    torch.testing.assert_close(sunk.forward_dense(tokens), models["plain"].forward_dense(tokens))
    # and the sinks are drawn after every other weight: the rest is the plain model's
    plain = dict(models["plain"].named_parameters())
    for name, weight in models["sinks"].named_parameters():
        assert name.endswith(".sinks") or torch.equal(weight, plain[name]), name


# -- the engine against the reference --------------------------------------------------------
@pytest.mark.parametrize("block_size", [4, 6])
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_equal_the_dense_reference(models, dense, variant, block_size):
    outputs = serve(models[variant], PROMPTS, block_size=block_size)
    for tokens, out in zip(PROMPTS, outputs, strict=True):
        assert tokens_of(out) == [dense(variant, tokens)], f"prompt of {len(tokens)} tokens"


@pytest.mark.parametrize("variant", ["mixed", "chunked", "sinks"])
def test_chunked_prefill_across_the_window_edge(models, dense, variant):
    # 5 tokens a step: chunks end at 5, 10, 15, 20: across the window (8) and the chunk (16)
    long_prompts = PROMPTS[-2:]
    outputs = serve(models[variant], long_prompts, block_size=4, max_num_batched_tokens=5)
    assert [tokens_of(o) for o in outputs] == [[dense(variant, p)] for p in long_prompts]


def test_n_greedy_forks_each_equal_the_reference(models, dense):
    [out] = serve(models["mixed"], [PROMPTS[3]], SamplingParams(n=3, max_tokens=MAX_TOKENS),
                  block_size=6)
    assert tokens_of(out) == [dense("mixed", PROMPTS[3])] * 3


@pytest.mark.parametrize("variant", ["mixed", "sliding"])
def test_prefix_hits_give_the_reference_tokens(models, dense, variant):
    """The same prompt again, then one diverging inside a cached block: each hits the
    blocks before the point (all but the last token's for a repeat), with the same tokens."""
    first = PROMPTS[-1]  # 41 tokens
    diverging = first[:30] + prompt(11, seed=99, vocab_size=SHAPE["vocab_size"])
    engine = make_engine(models[variant], num_blocks=96, block_size=4, num_threads=1)
    hits = []
    for tokens in (first, first, diverging):
        ids, outputs, _ = drive(engine, {0: [(tokens, GREEDY)]})
        assert tokens_of(outputs[ids[0]]) == [dense(variant, tokens)]
        hits.append(outputs[ids[0]].prefix_hit_tokens)
    assert hits == [0, 40, 28]
    assert_drained(engine)


def test_int8_pages_agree_up_to_a_near_tie(models, dense):
    """tests/core/test_quantised.py's rule: tokens agree with the float32 reference until the
    first difference, which sits where the float32 top-2 logit gap is under 0.05."""
    model = models["mixed"]
    outputs = serve(model, PROMPTS, block_size=6, kv_cache_dtype="int8")
    identical = 0
    for tokens, out in zip(PROMPTS, outputs, strict=True):
        want, [got] = dense("mixed", tokens), tokens_of(out)
        logits = model.forward_dense(torch.tensor(tokens + want))[len(tokens) - 1:-1]
        top = logits.topk(2, dim=-1).values
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b),
                     len(want))
        assert first == len(want) or float(top[first, 0] - top[first, 1]) < 0.05, (
            f"prompt of {len(tokens)}: differs at {first} away from a near tie")
        identical += sum(a == b for a, b in zip(want, got, strict=True))
    assert identical >= 0.8 * len(PROMPTS) * MAX_TOKENS


# -- the config ------------------------------------------------------------------------------
def test_config_spells_kinds_once_and_the_cache_gets_them():
    config = TinyLlamaConfig(**SHAPE, layer_kinds=[LayerKind.sliding(8), "full", "sliding:08",
                                                   LayerKind.full()])
    assert config.layer_kinds == MIXED and hash(config) == hash(TinyLlamaConfig(**SHAPE,
                                                                               layer_kinds=MIXED))
    assert config.kinds == (LayerKind.sliding(8), LayerKind(), LayerKind.sliding(8), LayerKind())
    assert config.kind_of(2).window == 8 and config.kind_of(3).is_full
    assert TinyLlama(config).cache_config().layer_kinds == config.kinds
    all_full = TinyLlamaConfig(**SHAPE, layer_kinds=("full",) * 4)
    assert all_full == TinyLlamaConfig(**SHAPE) and all_full.kinds == ()
    default = TinyLlama()
    assert default.cache_config().layer_kinds == ()
    assert not any(name.endswith("sinks") for name, _ in default.named_parameters())


@pytest.mark.parametrize(("fields", "match"), [
    (dict(layer_kinds=("full", "sliding:0", "full", "full")), r"layer_kinds\[1\]: .*'sliding:0'"),
    (dict(layer_kinds=("full", "window:8", "full", "full")), r"layer_kinds\[1\]: .*'window:8'"),
    (dict(layer_kinds=("sliding:-8", "full", "full", "full")), r"layer_kinds\[0\]"),
    (dict(layer_kinds=("full", "full", "chunked:8.5", "full")), r"layer_kinds\[2\]"),
    (dict(layer_kinds=("full", "full", "full", 8)), r"layer_kinds\[3\]: .*got 8"),
    (dict(layer_kinds=("sliding:8",) * 3), r"layer_kinds: expected one per layer \(4\), got 3"),
    (dict(layer_kinds="sliding:8"), r"layer_kinds: expected a tuple"),
    (dict(sinks=1), r"sinks: expected a bool, got 1"),
    (dict(softcap=-1.0), r"softcap: .*got -1\.0"),
    (dict(softcap=math.nan), r"softcap"),
    (dict(softcap=True), r"softcap"),
    (dict(num_heads=0), r"num_heads: expected > 0, got 0"),
], ids=["span0", "name", "negative", "float-span", "int", "count", "str", "sinks", "softcap",
        "nan", "bool-softcap", "heads"])
def test_bad_config_names_the_field(fields, match):
    with pytest.raises(ValueError, match=r"TinyLlamaConfig\." + match):
        TinyLlamaConfig(**{**SHAPE, **fields})


def test_a_cache_of_other_layer_kinds_is_refused(models):
    """Full attention over a window layer's cache, or the reverse, would give wrong tokens
    without a word: the model refuses the step first."""
    for variant, kinds in (("mixed", ()), ("plain", models["mixed"].config.kinds)):
        model = models[variant]
        cache = PagedKVCache(model.cache_config(num_blocks=8, block_size=4, layer_kinds=kinds))
        cache.add_sequence("s")
        batch = cache.prepare({"s": 3})
        with pytest.raises(ValueError, match=r"layer_kinds .* are not the model's"):
            model(torch.tensor([1, 2, 3]), torch.arange(3), cache, batch)


# -- what travels with the model -------------------------------------------------------------
def test_the_kinds_sinks_and_softcap_change_the_tier_fingerprint(models):
    """The tiers name a model's blocks by its config and weights: every hybrid field is in
    the config (`dataclasses.asdict`), the sinks in the weights too."""
    def namespace(model):
        return model_fingerprint(model, model.cache_config(num_blocks=8)).namespace

    names = {variant: namespace(model) for variant, model in models.items()}
    assert len(set(names.values())) == len(names), names
    wider = TinyLlama(TinyLlamaConfig(**SHAPE, layer_kinds=("sliding:9", *MIXED[1:])))
    assert namespace(wider) != names["mixed"]
    assert namespace(TinyLlama(TinyLlamaConfig(**SHAPE, **VARIANTS["mixed"]))) == names["mixed"]


def test_tensor_parallel_workers_rebuild_the_same_hybrid_model(models):
    """Workers build their copy from the pickled `ModelSpec`: the same config and weights,
    sinks included."""
    model = models["sinks"]
    built = pickle.loads(pickle.dumps(ModelSpec.of(model))).build()
    assert built.config == model.config and built.config.kinds == model.config.kinds
    want = dict(model.named_parameters())
    assert all(torch.equal(weight, want[name]) for name, weight in built.named_parameters())
    assert len(want) == len(dict(built.named_parameters()))
