"""paged_kv.integrations.mixers.mamba1 against transformers' own Mamba-1 mixers (Mamba,
Falcon-Mamba, Jamba), tiny random models on the CPU (the torch path): the packed, mixed batch
must give each sequence's forward alone; chunks across calls (states carried), one-token
decodes and resumes from emitted states must give the whole sequence's forward; the states
must be the ones transformers' cache holds."""

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
    randomize,
    randomized,
    run,
    specs_of,
    zero_states,
)

STATE, KERNEL, RANK, INNER = 6, 4, 8, 96


def _mamba() -> torch.nn.Module:
    config = transformers.MambaConfig(
        vocab_size=32, hidden_size=HIDDEN, state_size=STATE, intermediate_size=INNER,
        conv_kernel=KERNEL, time_step_rank=RANK, num_hidden_layers=1, use_bias=True)
    return transformers.MambaModel(config).layers[0].mixer


def _falcon_mamba() -> torch.nn.Module:
    config = transformers.FalconMambaConfig(
        vocab_size=32, hidden_size=HIDDEN, state_size=STATE, intermediate_size=INNER,
        conv_kernel=KERNEL, time_step_rank=RANK, num_hidden_layers=1, use_bias=True)
    return transformers.FalconMambaModel(config).layers[0].mixer


def _jamba() -> torch.nn.Module:
    # layer 0 is Mamba, layer 1 attention; inner 2 * 64 = 128
    config = transformers.JambaConfig(
        vocab_size=32, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
        num_experts=1, mamba_d_state=STATE, mamba_d_conv=KERNEL, mamba_expand=2,
        mamba_dt_rank=RANK, mamba_proj_bias=True)
    return transformers.JambaModel(config).layers[0].mamba


FAMILIES = {"mamba": _mamba, "falcon_mamba": _falcon_mamba, "jamba": _jamba}


@pytest.fixture(params=sorted(FAMILIES))
def module(request: pytest.FixtureRequest) -> torch.nn.Module:
    return randomized(FAMILIES[request.param])


def _sequences(lengths: tuple[int, ...] = LENGTHS, dtype: torch.dtype = torch.float32,
               seed: int = 1) -> list[torch.Tensor]:
    return random_sequences(lengths, HIDDEN, dtype, seed)


def test_states_are_the_modules() -> None:
    """The mixer runs the classes the engine maps, with the specs' shapes (a guard: the
    other tests would read them wrong together otherwise)."""
    for build in FAMILIES.values():
        mixer = build()
        conv, ssm = specs_of(mixer, torch.float32)
        assert conv.shape == (mixer.intermediate_size, KERNEL)
        assert ssm.shape == (mixer.intermediate_size, STATE)


def test_packed_batch_is_each_sequence_alone(module: torch.nn.Module) -> None:
    """Mixed lengths packed in one call from zero states: each sequence's outputs are the
    module's forward on it alone, and its final states are what transformers' cache holds
    after that sequence as a prompt."""
    sequences = _sequences()
    specs = specs_of(module, torch.float32)
    outs, result = run(module, sequences, zero_states(specs, len(sequences)))
    for b, (sequence, out) in enumerate(zip(sequences, outs, strict=True)):
        close(out, forward(module, sequence))
        _, states = cached(module, [sequence])
        for final, held in zip(result.final, states, strict=True):
            close(final[b], held[0])
    # control: a sequence run after another in one row (no packing) is not itself alone
    joined = forward(module, torch.cat(sequences[1:3]))[len(sequences[1]):]
    assert differs(joined, outs[2])


def test_chunks_across_calls_then_decode(module: torch.nn.Module) -> None:
    """Each sequence split in two chunks over two calls (states carried; one sequence has
    nothing in the second call), then a one-token decode: the whole sequence's forward.
    The prompt-then-decode is also what transformers' cache path computes."""
    lengths = (2, 6, 18, 34)
    cuts = (1, 5, 7, 20)  # the second sequence's second chunk is empty
    sequences = _sequences(lengths)
    specs = specs_of(module, torch.float32)
    first, result = run(module, [s[:c] for s, c in zip(sequences, cuts, strict=True)],
                        zero_states(specs, len(lengths)))
    carried = result.final
    second, result = run(module, [s[c:-1] for s, c in zip(sequences, cuts, strict=True)], carried)
    decode, result = run(module, [s[-1:] for s in sequences], result.final)

    for b, sequence in enumerate(sequences):
        close(torch.cat([first[b], second[b], decode[b]]), forward(module, sequence))
        outputs, states = cached(module, [sequence[:-1], sequence[-1:]])
        close(decode[b], outputs[1])
        for final, held in zip(result.final, states, strict=True):
            close(final[b], held[0])

    # the SSM state matters: the second chunks from a zeroed one differ (and that is what
    # transformers' cache path computes for a multi-token chunk on a cached state: it keeps
    # the convolution window but restarts the scan from zero; see mamba1's docstring)
    restarted, _ = run(module, [s[c:-1] for s, c in zip(sequences, cuts, strict=True)],
                       (carried[0], torch.zeros_like(carried[1])))
    assert differs(restarted[3], second[3])
    chunked, _ = cached(module, [sequences[3][:cuts[3]], sequences[3][cuts[3]:-1]])
    close(chunked[1], restarted[3])


def test_emitted_states_resume(module: torch.nn.Module) -> None:
    """States emitted after given tokens, used as initial states for the rest of each
    sequence, give the rest of the whole run's outputs; an emission at a sequence's last
    token is its final state."""
    sequences = _sequences()
    specs = specs_of(module, torch.float32)
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)[:-1].tolist()
    # after token 2, 10, 20 of the last three sequences; then the last token of the first
    positions = [(1, 2), (2, 10), (3, 20), (0, 0)]
    outs, result = run(module, sequences, zero_states(specs, len(sequences)),
                       emit_at=[starts[b] + p for b, p in positions])
    resumed, _ = run(module, [sequences[b][p + 1:] for b, p in positions[:3]],
                     tuple(e[:3] for e in result.emitted))
    for (b, p), out in zip(positions[:3], resumed, strict=True):
        close(out, outs[b][p + 1:])
    for emitted, final in zip(result.emitted, result.final, strict=True):
        assert torch.equal(emitted[3], final[0])
    # control: the rest from zero states is another output
    fresh, _ = run(module, [sequences[3][21:]], zero_states(specs, 1))
    assert differs(fresh[0], outs[3][21:])


def test_bfloat16(module: torch.nn.Module) -> None:
    """A bfloat16 model (the conv window in bfloat16, the SSM state in float32): packed
    chunks over two calls give the module's bfloat16 forward, within bfloat16's rounding."""
    module = module.to(torch.bfloat16)
    sequences = _sequences((5, 33), dtype=torch.bfloat16)
    specs = specs_of(module, torch.bfloat16)
    assert [s.dtype for s in specs] == [torch.bfloat16, torch.float32]
    first, result = run(module, [s[:3] for s in sequences], zero_states(specs, 2))
    second, result = run(module, [s[3:] for s in sequences], result.final)
    assert result.final[0].dtype == torch.bfloat16 and result.final[1].dtype == torch.float32
    for b, sequence in enumerate(sequences):
        close(torch.cat([first[b], second[b]]), forward(module, sequence), loose=True)


def test_activation_the_kernel_lacks() -> None:
    """A conv activation other than SiLU (``hidden_act``) is the module's own, applied after
    the kernel's plain convolution."""
    torch.manual_seed(0)
    config = transformers.MambaConfig(
        vocab_size=32, hidden_size=HIDDEN, state_size=STATE, intermediate_size=INNER,
        conv_kernel=KERNEL, time_step_rank=RANK, num_hidden_layers=1, hidden_act="gelu")
    mixer = transformers.MambaModel(config).layers[0].mixer.eval()
    randomize(mixer)
    sequences = _sequences((5, 17))
    outs, _ = run(mixer, sequences, zero_states(specs_of(mixer, torch.float32), 2))
    for sequence, out in zip(sequences, outs, strict=True):
        close(out, forward(mixer, sequence))
