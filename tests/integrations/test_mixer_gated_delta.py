"""paged_kv.integrations.mixers.gated_delta against transformers' own gated delta nets.

For each family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid) one GatedDeltaNet module of a
tiny random model is the reference: its forward on one sequence alone (batch 1, no cache: the
torch chunked path from zero states). The mixer runs several sequences packed in one call,
split across calls with the states carried, restarted from emitted states, in float32 and in
bfloat16, and its states must be the tensors transformers' own cache holds.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.integrations.mixers import MixerOutput, mixer_of  # noqa: E402
from paged_kv.integrations.mixers.gated_delta import run_gated_delta_net  # noqa: E402
from paged_kv.integrations.recurrent import recurrent_layers  # noqa: E402

HIDDEN = 64
TINY = dict(vocab_size=64, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# two key heads serving four value heads (the GQA repeat), Dk != Dv, kernel 4: a wrong head
# order, repeat or split changes the numbers or the shapes
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
           linear_num_key_heads=2, linear_num_value_heads=4, head_dim=8)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2, num_experts=4,
           shared_expert_intermediate_size=16)
LAYERS = dict(num_hidden_layers=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention",
                           "full_attention"])
CONFIGS = {
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**TINY, **GDN, **MOE, **LAYERS),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**TINY, **GDN, **LAYERS),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**TINY, **GDN, **MOE, **LAYERS),
    "olmo_hybrid": lambda: transformers.OlmoHybridConfig(**TINY, **GDN, **LAYERS),
}
FAMILIES = sorted(CONFIGS)
LENGTHS = [17, 1, 33, 5]  # mixed prefill lengths and a lone token, not sorted
FP32 = dict(atol=2e-5, rtol=2e-5)  # the chunked and per-token sums differ by ~1e-6
# bf16: the module rounds its conv and norm in bf16 where the kernels keep float32
BF16 = dict(atol=3e-2, rtol=3e-2)


@functools.cache
def _model(family: str, dtype: torch.dtype = torch.float32):
    """(config, the first GatedDeltaNet of a tiny seeded model) with parameters re-drawn at
    scales that make every part count: O(1) projections, a norm weight far from 1 and decays
    of 0.6-0.97 per token so a state carries across calls."""
    config = CONFIGS[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    module = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name == "A_log":
                parameter.copy_(torch.empty(parameter.shape).uniform_(0.05, 0.5,
                                                                      generator=generator).log())
            elif name == "dt_bias":
                parameter.copy_(0.5 * noise)
            elif name.endswith("norm.weight"):
                parameter.copy_(1 + 0.5 * noise)
            elif name == "conv1d.weight":
                parameter.copy_(0.5 * noise)
            else:  # a linear projection [out, in]
                parameter.copy_(noise / parameter.shape[-1] ** 0.5)
    return config, module.to(dtype)


def _reference(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's forward on one sequence alone: ``[L, hidden] -> [L, hidden]``."""
    with torch.no_grad():
        return module(x[None])[0]


def _zeros(config, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    (specs,) = {specs for specs in recurrent_layers(config, dtype).values()}
    return tuple(torch.zeros((batch, *spec.shape), dtype=spec.dtype) for spec in specs)


def _run(module, parts: list[torch.Tensor], states, emit_at=()) -> MixerOutput:
    """The mixer over `parts` packed back to back (one per sequence, possibly empty)."""
    cu = torch.tensor([0, *torch.tensor([len(p) for p in parts]).cumsum(0).tolist()])
    with torch.no_grad():
        return run_gated_delta_net(module, torch.cat(parts), states, cu,
                                   torch.tensor(emit_at, dtype=torch.int64))


def _sequences(lengths: list[int], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randn(n, HIDDEN, generator=generator).to(dtype) for n in lengths]


def _unpack(out: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(out.split(lengths))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_runs_each_family_with_this_mixer(family):
    _, module = _model(family)
    assert mixer_of(module) is run_gated_delta_net


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_from_zero_states_match_each_forward_alone(family):
    config, module = _model(family)
    xs = _sequences(LENGTHS)
    result = _run(module, xs, _zeros(config, len(xs), torch.float32))
    assert result.out.shape == (sum(LENGTHS), HIDDEN) and result.out.dtype == torch.float32
    for x, got in zip(xs, _unpack(result.out, LENGTHS), strict=True):
        torch.testing.assert_close(got, _reference(module, x), **FP32)
    specs = _zeros(config, len(xs), torch.float32)
    assert [(s.shape, s.dtype) for s in result.final] == [(s.shape, s.dtype) for s in specs]
    assert [s.shape[0] for s in result.emitted] == [0, 0]


def _split_then_decode(family: str, dtype: torch.dtype, tolerance: dict) -> None:
    """Each sequence in two chunks over two calls (the 1-token one: nothing, then its token),
    then a one-token decode of all, states carried; the outputs are the forward's on the
    whole sequence."""
    config, module = _model(family, dtype)
    full = _sequences([n + 1 for n in LENGTHS], dtype)  # + the decoded token
    cuts = [7, 0, 20, 2]
    heads = [x[:c] for x, c in zip(full, cuts, strict=True)]
    tails = [x[c:-1] for x, c in zip(full, cuts, strict=True)]
    first = _run(module, heads, _zeros(config, len(full), dtype))
    second = _run(module, tails, first.final)
    decode = _run(module, [x[-1:] for x in full], second.final)
    assert decode.final[0].dtype == dtype and decode.final[1].dtype == torch.float32
    pieces = zip(_unpack(first.out, cuts), _unpack(second.out, [len(t) for t in tails]),
                 _unpack(decode.out, [1] * len(full)), strict=True)
    for x, parts in zip(full, pieces, strict=True):
        got = torch.cat(parts)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), _reference(module, x).float(), **tolerance)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_across_calls_and_a_decode_match_the_whole_sequence(family):
    _split_then_decode(family, torch.float32, FP32)


def test_bfloat16_model_chunks_and_decode_match_the_module_in_bfloat16():
    _split_then_decode("qwen3_5", torch.bfloat16, BF16)


@pytest.mark.parametrize("family", FAMILIES)
def test_emitted_states_restart_the_rest_of_each_sequence(family):
    config, module = _model(family)
    xs = _sequences(LENGTHS)
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()[:-1]]
    # (sequence, position in it): a first token, middle ones, a sequence's last token
    marks = [(0, 0), (0, 9), (2, 4), (2, 31), (3, 3), (2, 32), (1, 0)]
    result = _run(module, xs, _zeros(config, len(xs), torch.float32),
                  emit_at=[starts[s] + p for s, p in marks])
    conv, recurrent = result.emitted
    assert conv.shape[0] == recurrent.shape[0] == len(marks)
    # a sequence's last token's state is its final one
    for index, (s, p) in enumerate(marks):
        if p == LENGTHS[s] - 1:
            torch.testing.assert_close(conv[index], result.final[0][s], atol=0, rtol=0)
            torch.testing.assert_close(recurrent[index], result.final[1][s], atol=0, rtol=0)
    # every emission restarts its sequence after the marked token (empty rest: a 0-token row)
    rests = [xs[s][p + 1:] for s, p in marks]
    restarted = _run(module, rests, result.emitted)
    for (s, p), got in zip(marks, _unpack(restarted.out, [len(r) for r in rests]), strict=True):
        torch.testing.assert_close(got, _reference(module, xs[s])[p + 1:], **FP32)


@pytest.mark.parametrize("family", ["qwen3_next", "olmo_hybrid"])
def test_states_are_what_transformers_cache_holds(family):
    """A prefill then a decode through the module with transformers' own cache: its conv
    window and recurrent state are the mixer's final states (same layout, oldest first)."""
    config, module = _model(family)
    (x,) = _sequences([12])
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        module(x[None, :-1], cache=cache)
        module(x[None, -1:], cache=cache)
    layer = cache.layers[module.layer_idx]
    final = _run(module, [x], _zeros(config, 1, torch.float32)).final
    torch.testing.assert_close(final[0], layer.conv_states[0], **FP32)
    torch.testing.assert_close(final[1], layer.recurrent_states[0], **FP32)


def test_a_module_of_no_known_family_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="Linear"):
        run_gated_delta_net(torch.nn.Linear(HIDDEN, HIDDEN), torch.zeros(1, HIDDEN),
                            (torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1)),
                            torch.tensor([0, 1]), torch.zeros(0, dtype=torch.int64))
