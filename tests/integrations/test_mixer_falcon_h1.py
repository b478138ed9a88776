"""paged_kv.integrations.mixers.falcon_h1 against transformers' own ``FalconH1Mixer`` (torch path).

Each case is a one-layer tiny random Falcon-H1 with µP multipliers off one (``ssm_multipliers``
per part of ``in_proj``'s output, ``ssm_in_multiplier``) and one gate setting: no norm
(``y * silu(gate)``), or the gated RMS norm normalising before or after the gate, over 1 or 2
groups. Its mixer runs the packed batch; the reference is the same module's forward on each
sequence alone, without a cache (a prefill) or with transformers' ``DynamicCache`` over the
same chunks (what ``generate`` computes, its one-token cached step included). The time step
limit binds, so transformers' prefill (clamped) and one-token step (not clamped) differ.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.integrations.mixers import mixer_of  # noqa: E402
from paged_kv.integrations.mixers.falcon_h1 import run_falcon_h1  # noqa: E402

from .test_mixer_mamba2 import (  # noqa: E402
    _forward,
    _generate,
    _inputs,
    _zeros,
    assert_emitted_states_resume,
    redraw,
)
from .test_mixer_mamba2 import _packed as packed  # noqa: E402

HIDDEN, INNER, HEADS, STATE, KERNEL, CHUNK = 64, 96, 4, 8, 4, 8  # mamba_d_ssm 96 != 2 * 64
LIMIT = (0.3, 1.2)  # softplus(dt + dt_bias) spreads over ~(0.05, 3): the clamp binds
TOL = dict(atol=2e-4, rtol=1e-4)
# (mamba_rms_norm, mamba_norm_before_gate, mamba_n_groups)
CASES = [(False, True, 1), (True, True, 2), (True, False, 2), (True, True, 1)]


def _mixer(rms_norm: bool, before_gate: bool, groups: int, dtype: torch.dtype = torch.float32,
           limit: tuple[float, float] = LIMIT) -> tuple[torch.nn.Module, object]:
    """The one layer's mixer, every parameter random (A_log, D, dt_bias and the norm weight
    included: their inits are constants a wrong formula could hide behind)."""
    config = transformers.FalconH1Config(
        hidden_size=HIDDEN, mamba_d_ssm=INNER, mamba_n_heads=HEADS, mamba_d_state=STATE,
        mamba_n_groups=groups, mamba_d_conv=KERNEL, mamba_chunk_size=CHUNK,
        mamba_rms_norm=rms_norm, mamba_norm_before_gate=before_gate, time_step_limit=limit,
        ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], ssm_in_multiplier=0.8, vocab_size=32,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64)
    torch.manual_seed(0)
    module = transformers.FalconH1Model(config).eval().layers[0].mamba
    return redraw(module).to(dtype), config


def _packed(module: torch.nn.Module, seqs: list[torch.Tensor], states: tuple[torch.Tensor, ...],
            emit_at: list[int] = ()) -> tuple[list[torch.Tensor], tuple, tuple]:
    """run_falcon_h1 over `seqs` packed in one call: per-sequence outputs, final, emitted."""
    return packed(module, seqs, states, emit_at, run_falcon_h1)


def test_registered_and_multipliers_set() -> None:
    """The module class is routed to run_falcon_h1, and the cases' µP vector is not all ones
    (else a dropped multiplier would pass)."""
    module, _ = _mixer(True, True, 1)
    assert mixer_of(module) is run_falcon_h1
    assert sorted(set(module.mup_vector.flatten().tolist())) == pytest.approx(
        [0.5, 0.7, 0.9, 1.2, 1.5])


@pytest.mark.parametrize(("rms_norm", "before_gate", "groups"), CASES)
def test_packed_prefill_matches_forward(rms_norm: bool, before_gate: bool, groups: int) -> None:
    """Sequences of 1, 5, 17, 33 tokens in one call from zero states: each one's outputs are
    the module's forward on it alone, and its final states are what transformers' cache
    holds after that prefill."""
    module, config = _mixer(rms_norm, before_gate, groups)
    seqs = _inputs([1, 5, 17, 33])
    outs, final, _ = _packed(module, seqs, _zeros(config, len(seqs), torch.float32))
    for b, (seq, out) in enumerate(zip(seqs, outs, strict=True)):
        torch.testing.assert_close(out, _forward(module, seq), **TOL)
        _, (conv, ssm) = _generate(module, config, [seq])
        torch.testing.assert_close(final[0][b], conv, **TOL)
        torch.testing.assert_close(final[1][b], ssm, **TOL)


@pytest.mark.parametrize(("rms_norm", "before_gate", "groups"), CASES)
def test_chunks_then_decode_match_generate(rms_norm: bool, before_gate: bool,
                                           groups: int) -> None:
    """Each sequence in two chunks over two calls (call 1's final states start call 2; one
    second chunk has a single token), then a one-token decode: outputs and states equal
    transformers' cached forwards over the same chunks, and the one-token steps differ from
    the prefill (unclamped time step)."""
    module, config = _mixer(rms_norm, before_gate, groups)
    lengths, splits = [5, 17, 33, 3], [2, 9, 20, 2]
    seqs = _inputs([n + 1 for n in lengths])  # the last token of each is its decode
    calls = [[s[:k] for s, k in zip(seqs, splits, strict=True)],
             [s[k:n] for s, k, n in zip(seqs, splits, lengths, strict=True)],
             [s[n:] for s, n in zip(seqs, lengths, strict=True)]]
    states = _zeros(config, len(seqs), torch.float32)
    ours = []
    for chunks in calls:
        outs, states, _ = _packed(module, chunks, states)
        ours.append(outs)
    stepped_differs = False
    for b, seq in enumerate(seqs):
        ref, (conv, ssm) = _generate(module, config, [call[b] for call in calls])
        for out, expected in zip((call[b] for call in ours), ref, strict=True):
            torch.testing.assert_close(out, expected, **TOL)
        torch.testing.assert_close(states[0][b], conv, **TOL)
        torch.testing.assert_close(states[1][b], ssm, **TOL)
        stepped_differs |= not torch.allclose(ours[2][b], _forward(module, seq)[-1:], **TOL)
    # the limit binds somewhere: had every step been clamped, this test could not tell
    assert stepped_differs


@pytest.mark.parametrize(("rms_norm", "before_gate", "groups"), CASES[:3])
def test_emitted_states_resume(rms_norm: bool, before_gate: bool, groups: int) -> None:
    """States emitted after given tokens, used as the initial states of the tokens that
    follow, give the outputs the single call gave them; one emitted at a sequence's last
    token is its final state."""
    module, config = _mixer(rms_norm, before_gate, groups)
    assert_emitted_states_resume(module, config, _packed)


def test_bfloat16() -> None:
    """A bfloat16 mixer (bf16 conv window, float32 SSM state): a packed prefill and a chunk
    + one-token decode against transformers' bf16 forwards, to bf16 rounding."""
    module, config = _mixer(True, True, 2, dtype=torch.bfloat16)
    seqs = _inputs([5, 17, 33], torch.bfloat16)
    states = _zeros(config, len(seqs), torch.bfloat16)
    outs, final, _ = _packed(module, seqs, states)
    assert final[0].dtype == torch.bfloat16 and final[1].dtype == torch.float32
    loose = dict(atol=0.06, rtol=0.02)
    for seq, out in zip(seqs, outs, strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), _forward(module, seq).float(), **loose)
    steps, _, _ = _packed(module, [s[-1:] for s in seqs], final)
    for seq, step in zip(seqs, steps, strict=True):
        ref, _ = _generate(module, config, [seq, seq[-1:]])
        torch.testing.assert_close(step.float(), ref[1].float(), **loose)


def test_wrong_state_shape_is_refused() -> None:
    module, config = _mixer(True, True, 2)
    conv, ssm = _zeros(config, 1, torch.float32)
    with pytest.raises(ValueError, match="states"):
        _packed(module, _inputs([3]), (conv, ssm.transpose(2, 3).contiguous()))
