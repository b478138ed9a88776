"""`PagedCache` under ``transformers``' own ``generate``, against ``DynamicCache``.

A tiny Llama with seeded random weights (no download). ``block_size`` 16 and prompts of 1,
15, 16, 17 and 33 tokens make every run cross block boundaries mid-prefill or mid-decode.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv import OutOfBlocksError  # noqa: E402
from paged_kv.config import LayerKind  # noqa: E402
from paged_kv.core.cache import snapshot  # noqa: E402
from paged_kv.integrations.transformers import PagedCache  # noqa: E402

from ..conftest import assert_same_snapshot  # noqa: E402
from ..engine.test_hybrid_models import FAMILIES, hybrid_configs  # noqa: E402

BLOCK_SIZE = 16
MAX_NEW_TOKENS = 20
PROMPT_LENGTHS = [1, 15, 16, 17, 33]
BATCH_PROMPT_LENGTHS = [5, 17, 33]  # left-padded to 33
PAD_TOKEN_ID = 0
# eos_token_id=None: every row generates exactly MAX_NEW_TOKENS, so lengths are known
GREEDY = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None,
              pad_token_id=PAD_TOKEN_ID)


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().float()


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + length)
    return torch.randint(3, 128, (1, length), generator=generator)  # (1, length)


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[3, 33]`` for prompts of 5, 17 and 33 tokens."""
    width = max(BATCH_PROMPT_LENGTHS)
    input_ids = torch.full((len(BATCH_PROMPT_LENGTHS), width), PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(BATCH_PROMPT_LENGTHS):
        input_ids[row, width - length:] = prompt(length, seed=row)
        attention_mask[row, width - length:] = 1
    return input_ids, attention_mask


def paged(model: transformers.LlamaForCausalLM, num_blocks: int = 128) -> PagedCache:
    return PagedCache(model.config, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                      dtype=torch.float32)


def dynamic(model: transformers.LlamaForCausalLM) -> transformers.DynamicCache:
    return transformers.DynamicCache(config=model.config)


def expected_blocks(output: torch.Tensor) -> int:
    """Blocks live after ``generate``: each row holds every token but the last generated
    one, which is sampled from the final step's logits and never fed back."""
    num_rows, length = output.shape
    return num_rows * math.ceil((length - 1) / BLOCK_SIZE)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_matches_dynamic_cache(model, length):
    input_ids = prompt(length)
    expected = model.generate(input_ids, cache=dynamic(model), **GREEDY)
    cache = paged(model)
    output = model.generate(input_ids, cache=cache, **GREEDY)
    assert torch.equal(output, expected), f"prompt of {length} tokens"
    assert output.shape[1] == length + MAX_NEW_TOKENS
    assert cache.get_seq_length() == length + MAX_NEW_TOKENS - 1
    assert cache.num_used_blocks == expected_blocks(output), f"prompt of {length} tokens"
    assert cache.stats().num_live_blocks == cache.num_used_blocks
    cache.kv_cache.check()


def test_left_padded_batch_matches_dynamic_cache(model):
    input_ids, attention_mask = left_padded_batch()
    expected = model.generate(input_ids, attention_mask=attention_mask, cache=dynamic(model),
                              **GREEDY)
    cache = paged(model)
    output = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **GREEDY)
    assert torch.equal(output, expected)
    # padding occupies slots too: 3 rows * ceil((33 + 20 - 1) / 16) = 3 * 4
    assert cache.num_used_blocks == expected_blocks(output) == 12
    assert [s.num_tokens for s in cache.stats().sequences] == [52, 52, 52]
    cache.kv_cache.check()


@pytest.mark.parametrize("num_beams", [2, 3])
def test_beam_search_matches_dynamic_cache_and_shares_blocks(model, num_beams):
    input_ids = prompt(17)
    beam = dict(GREEDY, num_beams=num_beams, output_scores=True, return_dict_in_generate=True)
    expected = model.generate(input_ids, cache=dynamic(model), **beam)
    cache = paged(model)
    peak_saved, reorders = [0], [0]
    reorder = cache.reorder_cache

    def reorder_and_record(beam_idx: torch.Tensor) -> None:
        reorder(beam_idx)
        reorders[0] += 1
        peak_saved[0] = max(peak_saved[0], cache.stats().bytes_saved_by_sharing)
        cache.kv_cache.check()

    cache.reorder_cache = reorder_and_record
    output = model.generate(input_ids, cache=cache, **beam)
    assert torch.equal(output.sequences, expected.sequences), f"{num_beams} beams"
    torch.testing.assert_close(output.sequences_scores, expected.sequences_scores,
                               atol=1e-4, rtol=0)
    assert reorders[0] == MAX_NEW_TOKENS
    assert peak_saved[0] > 0, "beams never shared a block"
    # every beam holds 17 + 20 - 1 tokens in 3 blocks; shared blocks count once in the pool
    stats = cache.stats()
    assert [s.num_blocks for s in stats.sequences] == [3] * num_beams
    num_saved = stats.bytes_saved_by_sharing // cache.kv_cache.config.bytes_per_block
    assert cache.num_used_blocks == 3 * num_beams - num_saved


def test_prompt_lookup_decoding_matches_greedy(model):
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10] * 6])  # repetitive: drafts come from it
    expected = model.generate(input_ids, **GREEDY)
    cache = paged(model)
    crops = []
    crop = cache.crop

    def crop_and_record(max_length: int) -> None:
        crops.append(max_length)
        crop(max_length)

    cache.crop = crop_and_record
    output = model.generate(input_ids, cache=cache, prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(output, expected)
    assert any(n < 0 for n in crops), f"no rejected draft was cropped: {crops}"
    assert cache.get_seq_length() == output.shape[1] - 1
    assert cache.num_used_blocks == expected_blocks(output)
    cache.kv_cache.check()


def test_generate_after_reset_gives_the_same_output(model):
    input_ids = prompt(17)
    cache = paged(model)
    first = model.generate(input_ids, cache=cache, **GREEDY)
    cache.reset()
    assert cache.num_used_blocks == 0
    assert cache.stats().num_live_blocks == 0 and cache.seq_ids == ()
    assert cache.get_seq_length() == 0
    assert torch.equal(model.generate(input_ids, cache=cache, **GREEDY), first)
    cache.reset()
    batch_ids, attention_mask = left_padded_batch()  # a new batch size on the same pool
    output = model.generate(batch_ids, attention_mask=attention_mask, cache=cache, **GREEDY)
    assert cache.num_used_blocks == expected_blocks(output)
    cache.reset()
    assert cache.num_used_blocks == 0
    cache.kv_cache.check()


@pytest.mark.parametrize(("num_blocks", "requested", "free"), [
    pytest.param(2, 2, 1, id="prefill"),   # 1 usable block; the 20-token prompt needs 2
    pytest.param(4, 1, 0, id="decode"),    # 3 usable blocks; token 49 needs a 4th
])
def test_out_of_blocks_leaves_the_cache_unchanged(model, num_blocks, requested, free):
    cache = paged(model, num_blocks=num_blocks)
    before: list[tuple] = []
    update = cache.update

    def update_with_snapshot(*args, **kwargs):
        before[:] = [(snapshot(cache.kv_cache), cache.stats(), cache.num_used_blocks,
                      cache.seq_ids, cache.get_seq_length())]
        return update(*args, **kwargs)

    cache.update = update_with_snapshot
    with pytest.raises(OutOfBlocksError) as error:
        model.generate(prompt(20), cache=cache, **dict(GREEDY, max_new_tokens=40))
    assert (error.value.requested, error.value.free) == (requested, free)
    state, stats, num_used_blocks, seq_ids, seq_length = before[0]
    assert_same_snapshot(state, snapshot(cache.kv_cache), "failing update")
    assert cache.stats() == stats
    assert (cache.num_used_blocks, cache.seq_ids) == (num_used_blocks, seq_ids)
    assert cache.get_seq_length() == seq_length
    cache.kv_cache.check()
    cache.reset()
    assert cache.num_used_blocks == 0


ROW_OPERATIONS = [
    pytest.param(lambda c: c.reorder_cache(torch.tensor([2, 0, 0])), id="reorder"),
    pytest.param(lambda c: c.batch_select_indices(torch.tensor([2, 0])), id="select"),
    pytest.param(lambda c: c.batch_repeat_interleave(2), id="repeat_interleave"),
    pytest.param(lambda c: c.crop(-5), id="crop"),
]


@pytest.mark.parametrize("operation", ROW_OPERATIONS)
def test_row_operations_match_dynamic_cache(model, operation):
    generator = torch.Generator().manual_seed(7)
    states = [torch.randn(3, 2, 20, 16, generator=generator) for _ in range(4)]
    cache, reference = paged(model), dynamic(model)
    for layer in range(2):
        cache.update(states[2 * layer], states[2 * layer + 1], layer)
        reference.update(states[2 * layer], states[2 * layer + 1], layer)
    operation(cache)
    operation(reference)
    cache.kv_cache.check()
    batch_size = reference.layers[0].keys.shape[0]
    new = torch.randn(batch_size, 2, 1, 16, generator=generator)
    for layer in range(2):
        assert cache.get_seq_length(layer) == reference.get_seq_length(layer)
        for got, want in zip(cache.update(new, -new, layer), reference.update(new, -new, layer),
                             strict=True):
            assert torch.equal(got, want), f"layer {layer}"


def test_crop_to_a_positive_length_keeps_that_many_tokens(model):
    cache = paged(model)
    cache.update(torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16), 0)
    cache.crop(17)
    assert cache.get_seq_length() == 17 and cache.num_used_blocks == 2 * 2
    cache.crop(0)
    assert cache.get_seq_length() == 17


def test_bad_update_leaves_the_cache_unchanged(model):
    cache = paged(model)
    cache.update(torch.randn(2, 2, 20, 16), torch.randn(2, 2, 20, 16), 0)
    before = snapshot(cache.kv_cache)
    bad_calls = [
        (torch.randn(2, 2, 1, 16, dtype=torch.float64), 0, TypeError),  # dtype
        (torch.randn(3, 2, 1, 16), 0, ValueError),   # batch size differs from the rows
        (torch.randn(2, 4, 1, 16), 0, ValueError),   # query heads, not kv heads
        (torch.randn(2, 2, 1, 16), 2, ValueError),   # layer out of range
    ]
    for states, layer, error in bad_calls:
        with pytest.raises(error):
            cache.update(states, states, layer)
        assert_same_snapshot(before, snapshot(cache.kv_cache), f"{tuple(states.shape)}")


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_layers_match_dynamic_cache(family):
    """Window, chunked and sink layers (window 16): the model masks them itself over the
    K/V `PagedCache` returns (every layer's whole past, from position 0), so greedy tokens,
    one row or a left-padded batch, equal `DynamicCache`'s. The pool keeps each layer's
    kind, a chunk of 16 as a window of 16: a left-padded row's chunks start at its first
    real token, not at slot 0 where the pool's chunks would, so a chunked pool would give
    back keys the row still reads (the 3-row llama4 case failed so)."""
    config, kinds = hybrid_configs()[family]
    kinds = tuple(LayerKind.sliding(k.chunk) if k.chunk else k for k in kinds)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    for input_ids, attention_mask in [(prompt(40), None), left_padded_batch()]:
        want = model.generate(input_ids, attention_mask=attention_mask, cache=dynamic(model),
                              **GREEDY)
        cache = PagedCache(model.config, num_blocks=128, block_size=6, dtype=torch.float32)
        assert cache.kv_cache.config.layer_kinds == kinds
        got = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **GREEDY)
        assert torch.equal(got, want), f"{family}, {input_ids.shape[0]} rows"
        cache.kv_cache.check()


@pytest.mark.parametrize("family", ["mistral", "llama4"])
@pytest.mark.parametrize("extra", [dict(num_beams=3), dict(prompt_lookup_num_tokens=3)],
                         ids=["beams", "prompt-lookup"])
def test_beams_and_rolled_back_drafts_on_hybrid_layers_match_dynamic_cache(family, extra):
    """Forked rows (beam search) and `crop` (rejected drafts) on window and chunked layers:
    a 48-token prompt, past the window, then 20 tokens."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hybrid_configs()[family][0]).eval().float()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10] * 8])  # repetitive: drafts come from it
    want = model.generate(input_ids, cache=dynamic(model), **GREEDY, **extra)
    cache = PagedCache(model.config, num_blocks=256, block_size=6, dtype=torch.float32)
    assert torch.equal(model.generate(input_ids, cache=cache, **GREEDY, **extra), want)
    cache.kv_cache.check()


def test_refuses_models_with_linear_layers():
    config = transformers.Qwen3NextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=128)
    with pytest.raises(ValueError, match=r"'qwen3_next'.*3 'linear_attention' layers"):
        PagedCache(config, num_blocks=8)


@pytest.mark.parametrize("family", ["gemma2 softcap", "gpt-oss sinks"])
def test_softcap_and_sinks_on_full_layers_match_dynamic_cache(family):
    """`PagedCache` hands the model its K/V and the model's own attention applies the
    soft-cap or the sinks: greedy tokens equal `DynamicCache`'s."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  layer_types=["full_attention"] * 2, initializer_range=0.3)
    if family == "gemma2 softcap":
        config = transformers.Gemma2Config(query_pre_attn_scalar=16, **common)
    else:
        config = transformers.GptOssConfig(num_local_experts=4, num_experts_per_tok=2,
                                           **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    model.config._attn_implementation = "eager"
    ids = prompt(33)
    want = model.generate(ids, cache=dynamic(model), **GREEDY)
    cache = paged(model)
    got = model.generate(ids, cache=cache, **GREEDY)
    assert torch.equal(got, want)
    assert cache.num_used_blocks == expected_blocks(got)
