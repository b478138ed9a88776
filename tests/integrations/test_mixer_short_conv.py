"""paged_kv.integrations.mixers.short_conv against transformers' LFM2 short convolutions
(``Lfm2ShortConv``, ``Lfm2MoeShortConv``), tiny random models on the CPU: the packed, mixed
batch must give each sequence's forward alone; chunks across calls, one-token decodes and
resumes from emitted windows must give the whole sequence's forward; the window must be the
one transformers' cache holds."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from .mixer_cases import (  # noqa: E402
    HIDDEN,
    LENGTHS,
    cached,
    close,
    differs,
    forward,
    random_sequences,
    randomized,
    run,
    specs_of,
    zero_states,
)

L_CACHE = 3
# layer 0 is the short convolution, layer 1 attention
SHARED = dict(vocab_size=32, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, conv_L_cache=L_CACHE,
              conv_bias=True, layer_types=["conv", "full_attention"])


def _lfm2() -> torch.nn.Module:
    return transformers.Lfm2Model(transformers.Lfm2Config(**SHARED)).layers[0].conv


def _lfm2_moe() -> torch.nn.Module:
    config = transformers.Lfm2MoeConfig(**SHARED, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2, num_dense_layers=1)
    return transformers.Lfm2MoeModel(config).layers[0].conv


FAMILIES = {"lfm2": _lfm2, "lfm2_moe": _lfm2_moe}


@pytest.fixture(params=sorted(FAMILIES))
def module(request: pytest.FixtureRequest) -> torch.nn.Module:
    return randomized(FAMILIES[request.param])


def _sequences(lengths: tuple[int, ...] = LENGTHS, dtype: torch.dtype = torch.float32,
               seed: int = 1) -> list[torch.Tensor]:
    return random_sequences(lengths, HIDDEN, dtype, seed)


def test_state_is_the_modules() -> None:
    """Both classes are the ones the engine maps, with one ``[hidden, L_cache]`` window."""
    for name, build in FAMILIES.items():
        mixer = build()
        assert type(mixer).__name__ == {"lfm2": "Lfm2ShortConv",
                                        "lfm2_moe": "Lfm2MoeShortConv"}[name]
        (conv,) = specs_of(mixer, torch.float32)
        assert conv.shape == (HIDDEN, L_CACHE)


def test_packed_batch_is_each_sequence_alone(module: torch.nn.Module) -> None:
    """Mixed lengths packed in one call from zero windows: each sequence's outputs are the
    module's forward on it alone; its final window is what transformers' cache holds (the
    one-token sequence's too: zeros then its gated input)."""
    sequences = _sequences()
    outs, result = run(module, sequences, zero_states(specs_of(module, torch.float32), 4))
    for b, (sequence, out) in enumerate(zip(sequences, outs, strict=True)):
        close(out, forward(module, sequence))
        _, (held,) = cached(module, [sequence])
        close(result.final[0][b], held[0])
    # control: a sequence run after another in one row (no packing) is not itself alone
    joined = forward(module, torch.cat(sequences[1:3]))[len(sequences[1]):]
    assert differs(joined, outs[2])


def test_chunks_across_calls_then_decode(module: torch.nn.Module) -> None:
    """Each sequence split in two chunks over two calls (windows carried; chunks shorter
    than the window, one empty), then a one-token decode: the whole sequence's forward, and
    the prompt-then-decode of transformers' cache path (which, for this mixer, also carries
    the window into a multi-token chunk)."""
    lengths = (2, 6, 18, 34)
    cuts = (1, 5, 1, 20)  # an empty second chunk; a one-token first chunk before a long one
    sequences = _sequences(lengths)
    specs = specs_of(module, torch.float32)
    first, result = run(module, [s[:c] for s, c in zip(sequences, cuts, strict=True)],
                        zero_states(specs, len(lengths)))
    carried = result.final
    second, result = run(module, [s[c:-1] for s, c in zip(sequences, cuts, strict=True)], carried)
    decode, result = run(module, [s[-1:] for s in sequences], result.final)

    for b, (sequence, cut) in enumerate(zip(sequences, cuts, strict=True)):
        whole = torch.cat([first[b], second[b], decode[b]])
        close(whole, forward(module, sequence))
        chunks = [sequence[:cut], sequence[cut:-1], sequence[-1:]]
        outputs, (held,) = cached(module, [c for c in chunks if len(c)])
        close(decode[b], outputs[-1])
        close(whole, torch.cat(outputs))
        close(result.final[0][b], held[0])

    # control: the second chunks from zero windows differ (the window matters)
    restarted, _ = run(module, [s[c:-1] for s, c in zip(sequences, cuts, strict=True)],
                       (torch.zeros_like(carried[0]),))
    assert differs(restarted[3], second[3])


def test_emitted_windows_resume(module: torch.nn.Module) -> None:
    """Windows emitted after given tokens, used as initial windows for the rest of each
    sequence, give the rest of the whole run's outputs; an emission at a sequence's last
    token is its final window."""
    sequences = _sequences()
    specs = specs_of(module, torch.float32)
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)[:-1].tolist()
    positions = [(1, 2), (2, 10), (3, 20), (0, 0)]
    outs, result = run(module, sequences, zero_states(specs, len(sequences)),
                       emit_at=[starts[b] + p for b, p in positions])
    resumed, _ = run(module, [sequences[b][p + 1:] for b, p in positions[:3]],
                     (result.emitted[0][:3],))
    for (b, p), out in zip(positions[:3], resumed, strict=True):
        close(out, outs[b][p + 1:])
    assert torch.equal(result.emitted[0][3], result.final[0][0])
    # control: the rest from a zero window is another output
    fresh, _ = run(module, [sequences[3][21:]], zero_states(specs, 1))
    assert differs(fresh[0], outs[3][21:])


def test_bfloat16(module: torch.nn.Module) -> None:
    """A bfloat16 model (the window in bfloat16): packed chunks over two calls give the
    module's bfloat16 forward, within bfloat16's rounding."""
    module = module.to(torch.bfloat16)
    sequences = _sequences((5, 33), dtype=torch.bfloat16)
    specs = specs_of(module, torch.bfloat16)
    first, result = run(module, [s[:3] for s in sequences], zero_states(specs, 2))
    second, result = run(module, [s[3:] for s in sequences], result.final)
    assert result.final[0].dtype == torch.bfloat16
    for b, sequence in enumerate(sequences):
        close(torch.cat([first[b], second[b]]), forward(module, sequence), loose=True)
