"""The recurrent references (paged_kv.kernels.recurrent) against transformers' own torch paths
on the same inputs and weights, and against themselves: packed = alone, two chunks = one,
emitted checkpoints = the state of the prefix they close.

Tolerances: against transformers, ``atol=1e-5, rtol=1e-4`` in float32 — its prefill paths sum
in another order (Mamba-2's SSD and the gated delta rule run in chunks, the latter through a
triangular solve), so the results differ by float32 noise grown over a few dozen tokens. Among
our own runs, ``1e-6``: the same per-token arithmetic, batched differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import Lfm2Config, Mamba2Config, MambaConfig, Qwen3NextConfig
from transformers.models.lfm2 import modeling_lfm2 as lfm2
from transformers.models.mamba import modeling_mamba as mamba
from transformers.models.mamba2 import modeling_mamba2 as mamba2
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from paged_kv.kernels import recurrent

HF = {"atol": 1e-5, "rtol": 1e-4}
OWN = {"atol": 1e-6, "rtol": 1e-6}
LENGTHS = (1, 3, 17, 40)  # a decode, a short chunk, two longer prefill chunks


def cu_of(lengths) -> torch.Tensor:
    return F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0))


# -- the families, each with random (never zero) inputs -------------------------------------

@dataclass(frozen=True)
class Family:
    """A recurrence's function, the name of its state argument, and random inputs."""

    fn: Callable
    state_arg: str
    state_shape: tuple[int, ...]
    tokens: Callable[[int], dict[str, torch.Tensor]]  # per-token inputs ``[T, ...]``
    params: Callable[[], dict]                         # the layer's weights and options

    def inputs(self, num_tokens: int, batch: int, seed: int = 0):
        torch.manual_seed(seed)
        params = self.params()
        return self.tokens(num_tokens), params, torch.randn(batch, *self.state_shape)

    def run(self, tokens, params, cu_seqlens, state, emit_at=None):
        return self.fn(**tokens, **params, cu_seqlens=cu_seqlens, emit_at=emit_at,
                       **{self.state_arg: state})


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape) * scale


FAMILIES = {
    "conv": Family(
        recurrent.causal_conv1d, "conv_state", (6, 3),
        lambda t: {"x": _randn(t, 6)},
        lambda: {"weight": _randn(6, 4, scale=0.5), "bias": _randn(6), "activation": "silu"}),
    # transformers' cache layout (K columns, the oldest unread) and LFM2's activation (none)
    "conv_wide": Family(
        recurrent.causal_conv1d, "conv_state", (6, 4),
        lambda t: {"x": _randn(t, 6)},
        lambda: {"weight": _randn(6, 4, scale=0.5), "bias": None, "activation": None}),
    "delta": Family(
        recurrent.gated_delta_rule, "state", (4, 8, 6),
        lambda t: {"q": _randn(t, 2, 8), "k": _randn(t, 2, 8), "v": _randn(t, 4, 6),
                   "g": -F.softplus(_randn(t, 4)), "beta": torch.sigmoid(_randn(t, 4))},
        dict),
    "ssd": Family(
        recurrent.ssd, "state", (4, 3, 5),
        lambda t: {"x": _randn(t, 4, 3), "dt": _randn(t, 4), "B": _randn(t, 2, 5),
                   "C": _randn(t, 2, 5)},
        lambda: {"A": -torch.exp(_randn(4, scale=0.5)), "D": _randn(4),
                 "dt_bias": _randn(4)}),
    "mamba1": Family(
        recurrent.selective_scan, "state", (6, 4),
        lambda t: {"u": _randn(t, 6), "delta": _randn(t, 6), "B": _randn(t, 4),
                   "C": _randn(t, 4), "z": _randn(t, 6)},
        lambda: {"A": -torch.exp(_randn(6, 4, scale=0.5)), "D": _randn(6),
                 "delta_bias": _randn(6)}),
}
families = pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))


def _slice(tokens: dict, start: int, stop: int) -> dict:
    return {name: t[start:stop] for name, t in tokens.items()}


def _alone(family: Family, tokens, params, state, start: int, stop: int):
    """One sequence's tokens ``start:stop`` run on their own from `state` ``[1, ...]``."""
    return family.run(_slice(tokens, start, stop), params, cu_of([stop - start]), state)


# -- (b) packing, (c) continuation, (d) emitted states: each family against itself ------------

@families
@pytest.mark.parametrize("order", [LENGTHS, (40, 1, 17, 1, 3)], ids=["ascending", "mixed"])
def test_packed_batch_equals_each_sequence_alone(family, order):
    tokens, params, state = family.inputs(sum(order), len(order))
    state[1].zero_()  # a fresh sequence beside ones continuing from a state
    cu = cu_of(order)
    out, final, emitted = family.run(tokens, params, cu, state)
    assert out.shape[0] == cu[-1] and final.shape == state.shape and emitted.shape[0] == 0
    for b in range(len(order)):
        start, stop = int(cu[b]), int(cu[b + 1])
        want_out, want_final, _ = _alone(family, tokens, params, state[b:b + 1], start, stop)
        torch.testing.assert_close(out[start:stop], want_out, **OWN)
        torch.testing.assert_close(final[b:b + 1], want_final, **OWN)


@families
@pytest.mark.parametrize("splits", [(13, 27), (1, 1, 38), (39, 1), (16, 16, 8)])
def test_chunks_carrying_the_state_equal_one_run(family, splits):
    tokens, params, state = family.inputs(sum(splits), 1, seed=1)
    whole_out, whole_final, _ = family.run(tokens, params, cu_of([sum(splits)]), state)
    outs, start = [], 0
    for size in splits:
        out, state, _ = _alone(family, tokens, params, state, start, start + size)
        outs.append(out)
        start += size
    torch.testing.assert_close(torch.cat(outs), whole_out, **OWN)
    torch.testing.assert_close(state, whole_final, **OWN)


@families
def test_emitted_states_are_the_states_after_those_tokens(family):
    tokens, params, state = family.inputs(sum(LENGTHS), len(LENGTHS), seed=2)
    cu = cu_of(LENGTHS)
    # block ends inside chunks, a decode's only token, a chunk's last token, one twice, unsorted
    emit_at = torch.tensor([4 + 15, 0, 3, 21 + 15, 21 + 31, int(cu[-1]) - 1, 3, 21])
    out, final, emitted = family.run(tokens, params, cu, state, emit_at)
    assert emitted.shape == (len(emit_at), *family.state_shape)
    for e, token in enumerate(emit_at.tolist()):
        b = int(torch.searchsorted(cu, token, right=True)) - 1
        _, want, _ = _alone(family, tokens, params, state[b:b + 1], int(cu[b]), token + 1)
        torch.testing.assert_close(emitted[e:e + 1], want, **OWN)
    # emitting changes nothing else
    plain_out, plain_final, _ = family.run(tokens, params, cu, state)
    assert torch.equal(out, plain_out) and torch.equal(final, plain_final)


@families
def test_an_empty_sequence_passes_its_state_through(family):
    tokens, params, state = family.inputs(5, 3, seed=3)
    _, final, _ = family.run(tokens, params, cu_of([2, 0, 3]), state)
    torch.testing.assert_close(final[1], state[1], atol=0, rtol=0)


@families
def test_half_precision_inputs_are_computed_in_float32(family):
    """bf16 inputs, float32 states: outputs in bf16 and states in float32, within bf16's
    rounding of the float32 run of the same (rounded) inputs. Not exactly it: the SSMs take
    the time step's softplus in the inputs' dtype, as transformers does."""
    tokens, params, state = family.inputs(21, 2, seed=4)
    tokens = {name: t.bfloat16() for name, t in tokens.items()}
    out, final, _ = family.run(tokens, params, cu_of([4, 17]), state)
    want_out, want_final, _ = family.run({name: t.float() for name, t in tokens.items()},
                                         params, cu_of([4, 17]), state)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    bf16 = {"atol": 1e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(out.float(), want_out, **bf16)
    torch.testing.assert_close(final, want_final, **bf16)


@pytest.mark.parametrize("cu, emit_at", [([0, 2, 1, 5], None), ([1, 3, 5], None),
                                         ([0, 2, 4], None), ([0, 2, 5], [5])])
def test_bad_offsets_and_emissions_are_refused(cu, emit_at):
    tokens, params, state = FAMILIES["conv"].inputs(5, len(cu) - 1)
    emit = None if emit_at is None else torch.tensor(emit_at)
    with pytest.raises(ValueError, match=r"cu_seqlens|emit_at"):
        FAMILIES["conv"].run(tokens, params, torch.tensor(cu), state, emit)


# -- (a) and (e): transformers' functions and layers on the same inputs ----------------------

@pytest.mark.parametrize("length", [1, 5, 23])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_equals_transformers(length, bias):
    torch.manual_seed(length)
    x, weight = torch.randn(length, 6), torch.randn(6, 4)
    b = torch.randn(6) if bias else None
    fresh = torch.zeros(1, 6, 3)
    out, final, _ = recurrent.causal_conv1d(x, weight, b, cu_of([length]), fresh)
    want = qwen3_next.causal_conv1d_fn(x.T[None], weight, b, activation="silu")
    torch.testing.assert_close(out, want[0].T, **HF)
    # from a state (a decode when length == 1): transformers' update shifts its window in place;
    # K - 1 columns are all an output reads, its cache keeps K (the oldest one unread)
    for columns in (3, 4):
        state = torch.randn(1, 6, columns)
        out, final, _ = recurrent.causal_conv1d(x, weight, b, cu_of([length]), state)
        window = state.clone()
        want = qwen3_next.causal_conv1d_update(x.T[None], window, weight, b, activation="silu")
        torch.testing.assert_close(out, want[0].T, **HF)
        torch.testing.assert_close(final, window, **HF)


def test_lfm2_short_conv_is_the_conv_between_two_gates():
    torch.manual_seed(0)
    config = Lfm2Config(hidden_size=16, conv_L_cache=3, conv_bias=True, num_hidden_layers=1,
                        vocab_size=32, layer_types=["conv"])
    layer = lfm2.Lfm2ShortConv(config, 0).eval()
    hidden = torch.randn(1, 19, 16)
    with torch.no_grad():
        want = layer(hidden)
        gate_in, gate_out, h = layer.in_proj(hidden[0]).chunk(3, dim=-1)
        conv, _, _ = recurrent.causal_conv1d(gate_in * h, layer.conv.weight.squeeze(1),
                                             layer.conv.bias, cu_of([19]), torch.zeros(1, 16, 2),
                                             activation=None)
        got = layer.out_proj(gate_out * conv)
    torch.testing.assert_close(got, want[0], **HF)


def _delta_inputs(length: int, key_heads: int, seed: int):
    torch.manual_seed(seed)
    return (torch.randn(length, key_heads, 8), torch.randn(length, key_heads, 8),
            torch.randn(length, 4, 6), -F.softplus(torch.randn(length, 4)),
            torch.sigmoid(torch.randn(length, 4)), torch.randn(1, 4, 8, 6))


@pytest.mark.parametrize("length", [1, 7, 40])
@pytest.mark.parametrize("key_heads", [4, 2])
def test_gated_delta_rule_equals_transformers_chunked(length, key_heads):
    q, k, v, g, beta, state = _delta_inputs(length, key_heads, length)
    for initial in (torch.zeros_like(state), state):
        out, final, _ = recurrent.gated_delta_rule(q, k, v, g, beta, cu_of([length]), initial)
        want, want_final = qwen3_next.torch_chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None], chunk_size=16,
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out, want[0], **HF)
        torch.testing.assert_close(final, want_final, **HF)


@pytest.mark.parametrize("key_heads", [4, 2])
def test_gated_delta_rule_decode_equals_transformers_step(key_heads):
    q, k, v, g, beta, state = _delta_inputs(1, key_heads, 5)
    out, final, _ = recurrent.gated_delta_rule(q, k, v, g, beta, cu_of([1]), state)
    want, want_final = qwen3_next.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want[0], **HF)
    torch.testing.assert_close(final, want_final, **HF)


def test_gated_delta_net_layer_equals_transformers():
    torch.manual_seed(0)
    config = Qwen3NextConfig(hidden_size=16, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=6,
                             linear_conv_kernel_dim=4, num_hidden_layers=1, vocab_size=32,
                             layer_types=["linear_attention"])
    layer = qwen3_next.Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        layer.norm.weight.normal_()
        hidden = torch.randn(1, 21, 16)
        want = layer(hidden)
        got = _gated_delta_net(layer, hidden[0])
    torch.testing.assert_close(got, want[0], **HF)


def _gated_delta_net(layer, hidden: torch.Tensor) -> torch.Tensor:
    """`Qwen3NextGatedDeltaNet.forward` of one fresh sequence, on the references."""
    length, cu = hidden.shape[0], cu_of([hidden.shape[0]])
    q, k, v, z, b, a = (t[0] for t in layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(hidden[None]), layer.in_proj_ba(hidden[None])))
    mixed = torch.cat([t.reshape(length, -1) for t in (q, k, v)], dim=-1)
    mixed, _, _ = recurrent.causal_conv1d(mixed, layer.conv1d.weight.squeeze(1), None, cu,
                                          torch.zeros(1, mixed.shape[1], 3))
    q, k, v = mixed.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    state = torch.zeros(1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    out, _, _ = recurrent.gated_delta_rule(
        q.reshape(length, -1, layer.head_k_dim), k.reshape(length, -1, layer.head_k_dim),
        v.reshape(length, -1, layer.head_v_dim), g, b.sigmoid(), cu, state)
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(length, -1))


def _ssd_inputs(length: int, seed: int):
    torch.manual_seed(seed)
    return (torch.randn(length, 4, 3), torch.randn(length, 4), -torch.exp(torch.randn(4) / 2),
            torch.randn(length, 2, 5), torch.randn(length, 2, 5), torch.randn(4),
            torch.randn(4), torch.randn(1, 4, 3, 5))


@pytest.mark.parametrize("length", [1, 6, 29])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.8)])
def test_ssd_equals_transformers_chunk_scan(length, dt_limit):
    x, dt, A, B, C, D, dt_bias, state = _ssd_inputs(length, length)
    for initial in (torch.zeros_like(state), state):
        y, final, _ = recurrent.ssd(x, dt, A, B, C, D, cu_of([length]), initial, dt_bias,
                                    dt_limit=dt_limit)
        want, want_final = mamba2.mamba2_chunk_scan(
            x[None], dt[None], A, B[None], C[None], chunk_size=8, D=D, dt_bias=dt_bias,
            initial_states=initial, dt_softplus=True, dt_limit=dt_limit,
            return_final_states=True)
        torch.testing.assert_close(y, want[0], **HF)
        torch.testing.assert_close(final, want_final, **HF)


def test_ssd_decode_equals_transformers_step():
    x, dt, A, B, C, D, dt_bias, state = _ssd_inputs(1, 7)
    y, final, _ = recurrent.ssd(x, dt, A, B, C, D, cu_of([1]), state, dt_bias)
    # the per-head parameters expanded over the head dimension, as mamba2_scan_forward does
    window = state.clone()
    want = mamba2.mamba2_selective_state_update(
        window, x, dt[..., None].expand(-1, -1, 3), A[:, None, None].expand(-1, 3, 5), B, C,
        D[:, None].expand(-1, 3), dt_bias=dt_bias[:, None].expand(-1, 3), dt_softplus=True)
    torch.testing.assert_close(y, want, **HF)
    torch.testing.assert_close(final, window, **HF)


def test_mamba2_mixer_equals_transformers():
    torch.manual_seed(0)
    config = Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2,
                          state_size=8, conv_kernel=4, chunk_size=8, num_hidden_layers=1,
                          vocab_size=32)
    layer = mamba2.Mamba2Mixer(config, 0).eval()
    with torch.no_grad():
        for p in (layer.A_log, layer.D, layer.dt_bias, layer.norm.weight):
            p.normal_()
        hidden = torch.randn(1, 27, 16)
        want = layer(hidden)
        got = _mamba2_mixer(layer, hidden[0])
    torch.testing.assert_close(got, want[0], **HF)


def _mamba2_mixer(layer, hidden: torch.Tensor) -> torch.Tensor:
    """`Mamba2Mixer.forward` of one fresh sequence: in_proj split, conv, SSD, gated norm."""
    length, cu = hidden.shape[0], cu_of([hidden.shape[0]])
    gate, xbc, dt = layer.in_proj(hidden).split(
        [layer.intermediate_size, layer.conv_dim, layer.num_heads], dim=-1)
    xbc, _, _ = recurrent.causal_conv1d(xbc, layer.conv1d.weight.squeeze(1), layer.conv1d.bias,
                                        cu, torch.zeros(1, layer.conv_dim, 3))
    groups = layer.n_groups * layer.ssm_state_size
    x, B, C = xbc.split([layer.intermediate_size, groups, groups], dim=-1)
    state = torch.zeros(1, layer.num_heads, layer.head_dim, layer.ssm_state_size)
    y, _, _ = recurrent.ssd(
        x.reshape(length, -1, layer.head_dim), dt, -torch.exp(layer.A_log.float()),
        B.reshape(length, layer.n_groups, -1), C.reshape(length, layer.n_groups, -1), layer.D,
        cu, state, layer.dt_bias, dt_limit=layer.time_step_limit)
    return layer.out_proj(layer.norm(y.reshape(length, -1), gate))


def _scan_inputs(length: int, seed: int):
    torch.manual_seed(seed)
    return (torch.randn(length, 6), torch.randn(length, 6), -torch.exp(torch.randn(6, 4) / 2),
            torch.randn(length, 4), torch.randn(length, 4), torch.randn(6),
            torch.randn(length, 6), torch.randn(6), torch.randn(1, 6, 4))


@pytest.mark.parametrize("length", [2, 30])
def test_selective_scan_equals_transformers(length):
    u, delta, A, B, C, D, z, bias, _ = _scan_inputs(length, length)
    fresh = torch.zeros(1, 6, 4)  # transformers' sequence path always starts from zeros
    y, final, _ = recurrent.selective_scan(u, delta, A, B, C, D, z, cu_of([length]), fresh, bias)
    want, want_final = mamba.mamba_selective_scan(
        u.T[None], delta.T[None], A, B.T[None], C.T[None], D=D, z=z.T[None], delta_bias=bias,
        delta_softplus=True, return_last_state=True)
    torch.testing.assert_close(y, want[0].T, **HF)
    torch.testing.assert_close(final, want_final, **HF)


def test_selective_scan_decode_equals_transformers_step():
    u, delta, A, B, C, D, z, bias, state = _scan_inputs(1, 4)
    y, final, _ = recurrent.selective_scan(u, delta, A, B, C, D, z, cu_of([1]), state, bias)
    window = state.clone()
    want = mamba.mamba_selective_state_update(window, u, delta, A, B, C, D, z=z, dt_bias=bias,
                                              dt_softplus=True)
    torch.testing.assert_close(y, want, **HF)
    torch.testing.assert_close(final, window, **HF)


def test_mamba_mixer_equals_transformers():
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=16, state_size=4, intermediate_size=32, conv_kernel=4,
                         time_step_rank=4, num_hidden_layers=1, vocab_size=32)
    layer = mamba.MambaMixer(config, 0).eval()
    with torch.no_grad():
        layer.A_log.normal_()
        layer.D.normal_()
        hidden = torch.randn(1, 25, 16)
        want = layer(hidden)
        length, cu = 25, cu_of([25])
        u, gate = layer.in_proj(hidden[0]).chunk(2, dim=-1)
        u, _, _ = recurrent.causal_conv1d(u, layer.conv1d.weight.squeeze(1), layer.conv1d.bias,
                                          cu, torch.zeros(1, 32, 3))
        step, B, C = layer.x_proj(u).split([4, 4, 4], dim=-1)
        y, _, _ = recurrent.selective_scan(
            u, step @ layer.dt_proj.weight.T, -torch.exp(layer.A_log.float()), B, C, layer.D,
            gate, cu, torch.zeros(1, 32, 4), layer.dt_proj.bias)
        got = layer.out_proj(y)
    assert length == got.shape[0]
    torch.testing.assert_close(got, want[0], **HF)
