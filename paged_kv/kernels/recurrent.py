"""Torch references of the recurrent layers' sequence mixers over a packed, mixed batch.

Every function takes the tokens of ``B`` sequences back to back (``T`` tokens in all),
``cu_seqlens`` (int64 ``[B + 1]``, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``) marking
each sequence's tokens, and one initial state per sequence (``[B, ...]``, zeros for a fresh
one). A sequence may have one token (a decode), many (a prefill chunk) or none (its state
passes through), all mixed in one call. Each returns

- the outputs, ``[T, ...]``;
- the final states, ``[B, ...]``, in the dtype of the states passed in;
- the states after the tokens at ``emit_at`` (int64 ``[E]``, indices into the packed tokens)
  were consumed, ``[E, ...]``: what a prefix cache keeps as a checkpoint at a block boundary.

The families, each equal to transformers' own torch path on the same weights:

- `causal_conv1d`: the depthwise causal convolution run before every recurrence below (and,
  with no activation, LFM2's short convolution: ``C * causal_conv1d(B * x)``, see
  `causal_conv1d`);
- `gated_delta_rule`: Qwen3-Next / Qwen3.5's gated delta net;
- `ssd`: Mamba-2's state space duality (Mamba-2, Nemotron-H, Falcon-H1, Granite 4 hybrids);
- `selective_scan`: Mamba-1's selective scan (Mamba, Jamba, Falcon-Mamba).

The reference is a sequential scan (`scan`): one step per position of the longest sequence,
over every sequence still running at once. Prefill takes faster forms of the same sums
(`recurrent_chunked`): a sequence of at least ``CHUNKED_FROM[name]`` tokens runs the gated
delta rule or SSD in chunks of 64 tokens, and the convolution reads every token's window in
one gather (`VECTORISED_CONV`); decodes stay on the scan. `selective_scan` (Mamba-1) is scan
only. Recurrent states are computed in float32 whatever the
inputs' dtype, as transformers' torch paths compute them (pass float32 states to keep them
exact; other dtypes are rounded once, on the way out).

On CUDA tensors (or with ``PAGED_KV_BACKEND=triton``, `backend.use_triton`) each function runs
its Triton kernel after its checks (`recurrent_triton`, `recurrent_triton_scan`: the same
results, one program per sequence and block of state rows); the torch code here is the
reference and the CPU path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .backend import use_triton
from .recurrent_chunked import (
    SequenceFn,
    conv_all,
    delta_sequence,
    long_sequences,
    over_sequences,
    short_packing,
    ssd_sequence,
)
from .recurrent_packing import Packing, Result, packing

# (outputs of the tokens stepped, new states of their sequences), from (token indices, states)
Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# The fast torch paths (`recurrent_chunked`). A sequence of at least this many tokens runs in
# chunks, the shorter ones (decodes) through `scan`; None sends every sequence to `scan`,
# the reference. The CPU crossover is 4-8 tokens for both (one chunk's fixed cost against the
# scan's steps: `python benchmarks/recurrent_chunked.py`). SSD waits for a full chunk: its
# chunked sums, in another order, differ from the scan's by ~1e-5 relative on unnormalised
# inputs, and test_recurrent.py holds split and packed runs of up to 40 tokens to 1e-6 (the
# gated delta rule's normalised keys stay within it).
CHUNKED_FROM: dict[str, int | None] = {"gated_delta_rule": 8, "ssd": 64}
# `causal_conv1d` by one gather of every token's window (False: `scan`, the reference)
VECTORISED_CONV = True

_ACTIVATIONS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda x: x, "silu": F.silu, "swish": F.silu,
}


def scan(pack: Packing, state: torch.Tensor, out: torch.Tensor, step: Step) -> Result:
    """Run `step` over every sequence of `pack` at once, one position at a time.

    Parameters
    ----------
    pack : Packing
        From `packing`.
    state : torch.Tensor
        ``[B, ...]`` initial states (not modified).
    out : torch.Tensor
        ``[T, ...]`` where each step's outputs are written (cast to its dtype).
    step : Step
        ``step(tokens [n], states [n, ...] float32) -> (outputs [n, ...], states [n, ...])``
        for ``n`` sequences advancing by their tokens `tokens`.

    Returns
    -------
    tuple of torch.Tensor
        `out`; the final states ``[B, ...]`` and the emitted ones ``[E, ...]``, in
        ``state.dtype``.
    """
    work = state.to(torch.float32, copy=True)  # ours to update in place
    emitted = work.new_empty((pack.emit_seq.numel(), *state.shape[1:]))
    for position in range(pack.longest):
        active = (pack.lengths > position).nonzero().squeeze(1)
        tokens = pack.starts[active] + position
        outputs, work[active] = step(tokens, work[active])
        out[tokens] = outputs.to(out.dtype)
        here = (pack.emit_pos == position).nonzero().squeeze(1)
        emitted[here] = work[pack.emit_seq[here]]
    return out, work.to(state.dtype), emitted.to(state.dtype)


def scan_or_chunks(pack: Packing, state: torch.Tensor, out: torch.Tensor, step: Step,
                   chunked: SequenceFn, tokens: list[torch.Tensor],
                   shortest: int | None) -> Result:
    """`scan` the sequences shorter than `shortest` tokens, run `chunked` on the others.

    Parameters
    ----------
    pack, state, out, step
        As `scan`'s.
    chunked : SequenceFn
        One sequence's recurrence in chunks (`recurrent_chunked`).
    tokens : list of torch.Tensor
        ``[T, ...]`` per-token float32 inputs of `chunked`.
    shortest : int or None
        The fewest tokens a chunked sequence has; None: `scan` only.

    Returns
    -------
    tuple of torch.Tensor
        As `scan`'s.
    """
    long = long_sequences(pack, shortest)
    if not long:
        return scan(pack, state, out, step)
    result = scan(short_packing(pack, long), state, out, step)  # their states pass through
    over_sequences(pack, long, chunked, tokens, state, result)
    return result


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                  activation: str | None = "silu",
                  emit_at: torch.Tensor | None = None) -> Result:
    """Depthwise causal convolution, each sequence continuing from its convolution window.

    Token ``t`` of a sequence sees its ``K - 1`` predecessors, the earliest of them from the
    sequence's window (the inputs before this call, oldest first):
    ``out[t, c] = act(bias[c] + sum_k weight[c, k] * window_t[c, k])``. transformers'
    ``causal_conv1d_fn`` / ``causal_conv1d_update`` (Mamba, Mamba-2, gated delta net, LFM2).

    LFM2's short convolution (``Lfm2ShortConv``) is this with ``activation=None`` between two
    gate products, so it has no function of its own: ``B, C, h = in_proj(x).chunk(3, -1)``,
    then ``out_proj(C * causal_conv1d(B * h, ...)[0])``; its window holds ``B * h``.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, C]`` packed inputs.
    weight : torch.Tensor
        ``[C, K]`` taps (``nn.Conv1d.weight`` ``[C, 1, K]`` squeezed), ``weight[:, -1]`` on the
        current token.
    bias : torch.Tensor or None
        ``[C]``.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]`` sequence offsets into `x`.
    conv_state : torch.Tensor
        ``[B, C, W]`` each sequence's last ``W >= K - 1`` inputs, oldest first (zeros: fresh).
        ``W = K - 1`` is all an output reads; transformers' cache keeps ``W = K`` (its oldest
        column never reaches an output), which works here unchanged.
    activation : {"silu", "swish", None}
        Applied to the convolution's output.
    emit_at : torch.Tensor, optional
        int64 ``[E]`` token indices whose window is wanted.

    Returns
    -------
    out : torch.Tensor
        ``[T, C]`` in ``x.dtype``.
    final : torch.Tensor
        ``[B, C, W]`` windows after each sequence's tokens, in ``conv_state.dtype``.
    emitted : torch.Tensor
        ``[E, C, W]`` windows after each token of `emit_at`.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got {activation!r}")
    channels, width = weight.shape
    if conv_state.shape[1] != channels or conv_state.shape[2] < width - 1 \
            or x.shape[1:] != (channels,):
        raise ValueError(f"x [T, {channels}] and conv_state [B, {channels}, >= {width - 1}] "
                         f"expected, got {list(x.shape)} and {list(conv_state.shape)}")
    if use_triton(x):  # imported late: the Triton module imports this one
        from .recurrent_triton import triton_causal_conv1d
        return triton_causal_conv1d(x, weight, bias, cu_seqlens, conv_state, activation,
                                    emit_at)
    act, taps = _ACTIVATIONS[activation], weight.float()
    shift = bias.float() if bias is not None else taps.new_zeros(channels)
    inputs = x.float()

    def step(tokens: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.cat([window, inputs[tokens, :, None]], dim=-1)  # [n, C, W + 1]
        return act((full[..., -width:] * taps).sum(-1) + shift), full[..., 1:]

    pack = packing(cu_seqlens, x.shape[0], conv_state.shape[0], emit_at)
    if not VECTORISED_CONV:
        return scan(pack, conv_state, torch.empty_like(x), step)
    sums, final, emitted = conv_all(inputs, taps, pack, conv_state.float())
    return (act(sums + shift).to(x.dtype), final.to(conv_state.dtype),
            emitted.to(conv_state.dtype))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                     emit_at: torch.Tensor | None = None, use_qk_l2norm: bool = True,
                     scale: float | None = None) -> Result:
    """Gated delta rule (Qwen3-Next, Qwen3.5): scanned, or in chunks for a long sequence.

    Per token and value head, with ``S`` the ``[Dk, Dv]`` state::

        S = exp(g) * S
        S = S + k ⊗ (beta * (v - kᵀS))
        o = qᵀS

    with ``q`` and ``k`` L2-normalised (``eps=1e-6``) if `use_qk_l2norm`, then ``q`` times
    `scale`. transformers' ``torch_recurrent_gated_delta_rule``; its
    ``torch_chunk_gated_delta_rule`` (prefill) is the same sum in another order.

    Parameters
    ----------
    q, k : torch.Tensor
        ``[T, Hk, Dk]`` queries and keys after the convolution; ``Hk`` divides ``H`` and each
        of them serves ``H // Hk`` consecutive value heads.
    v : torch.Tensor
        ``[T, H, Dv]`` values.
    g : torch.Tensor
        ``[T, H]`` log decay (``<= 0``): ``-exp(A_log) * softplus(a + dt_bias)``.
    beta : torch.Tensor
        ``[T, H]`` write strength: ``sigmoid(b)``.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]`` sequence offsets.
    state : torch.Tensor
        ``[B, H, Dk, Dv]`` initial states (transformers keeps them in float32).
    emit_at : torch.Tensor, optional
        int64 ``[E]`` token indices whose following state is wanted.
    use_qk_l2norm : bool
        L2-normalise queries and keys first (the models all do).
    scale : float, optional
        Query scale; ``Dk ** -0.5`` by default.

    Returns
    -------
    out : torch.Tensor
        ``[T, H, Dv]`` in ``q.dtype``.
    final : torch.Tensor
        ``[B, H, Dk, Dv]`` in ``state.dtype``.
    emitted : torch.Tensor
        ``[E, H, Dk, Dv]``.
    """
    heads, key_heads, key_dim = v.shape[1], k.shape[1], k.shape[2]
    if heads % key_heads or state.shape[1:] != (heads, key_dim, v.shape[2]):
        raise ValueError(f"heads: q/k {key_heads} must divide v's {heads}, state "
                         f"[B, {heads}, {key_dim}, {v.shape[2]}]; got {list(state.shape)}")
    if use_triton(v):
        from .recurrent_triton import triton_gated_delta_rule
        return triton_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, emit_at,
                                       use_qk_l2norm, scale)
    out = torch.empty_like(v, dtype=q.dtype)
    # everything in float32, as transformers casts before normalising
    q, k = (t.float().repeat_interleave(heads // key_heads, dim=1) for t in (q, k))
    if use_qk_l2norm:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (key_dim ** -0.5 if scale is None else scale)
    values, decay, strength = v.float(), g.float().exp(), beta.float()

    def step(tokens: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = s * decay[tokens, :, None, None]
        key = k[tokens]
        delta = (values[tokens] - torch.einsum("nhkv,nhk->nhv", s, key)) \
            * strength[tokens, :, None]
        s = s + key[..., None] * delta[:, :, None, :]
        return torch.einsum("nhkv,nhk->nhv", s, q[tokens]), s

    pack = packing(cu_seqlens, v.shape[0], state.shape[0], emit_at)
    return scan_or_chunks(pack, state, out, step, delta_sequence,
                          [q, k, values, g.float(), strength],
                          CHUNKED_FROM["gated_delta_rule"])



def _time_step(dt: torch.Tensor, bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    """``softplus(dt + bias)`` in float32, rounded as transformers rounds it: the bias is added
    and the softplus taken in `dt`'s own dtype (bf16 in a bf16 model), then cast."""
    if bias is not None:
        dt = dt + bias.to(dt.dtype)
    return (F.softplus(dt) if softplus else dt).float()


def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        D: torch.Tensor | None, cu_seqlens: torch.Tensor, state: torch.Tensor,
        dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        emit_at: torch.Tensor | None = None) -> Result:
    """Mamba-2's selective state space (SSD): scanned, or in chunks for a long sequence.

    Per token and head ``h`` (in group ``g = h // (H // G)``), with ``S`` the ``[P, N]``
    state and ``d = clamp(softplus(dt + dt_bias), *dt_limit)``::

        S = exp(d * A[h]) * S + d * x ⊗ B[g]
        y = S C[g] + D[h] * x

    transformers' ``mamba2_selective_state_update``; its ``mamba2_chunk_scan`` (prefill) is
    the same sum in chunks. The gate (``z``) is left to the caller's gated RMS norm, which
    transformers applies after the scan (Mamba-2 / Nemotron-H gate then normalise per group;
    Falcon-H1 has either order, or no norm).

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H, P]`` inputs after the convolution, ``P`` the head dimension.
    dt : torch.Tensor
        ``[T, H]`` time steps before the bias and softplus.
    A : torch.Tensor
        ``[H]`` decay rates, ``-exp(A_log)``.
    B, C : torch.Tensor
        ``[T, G, N]`` input and output projections; ``G`` divides ``H``.
    D : torch.Tensor or None
        ``[H]`` skip connection.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]`` sequence offsets.
    state : torch.Tensor
        ``[B, H, P, N]`` initial states.
    dt_bias : torch.Tensor, optional
        ``[H]`` added to `dt` first.
    dt_softplus : bool
        Take the softplus of ``dt + dt_bias``.
    dt_limit : tuple of float
        Clamp of the time step (transformers' chunked path clamps; its one-token step does
        not, which only matters for a limit other than ``(0, inf)``).
    emit_at : torch.Tensor, optional
        int64 ``[E]`` token indices whose following state is wanted.

    Returns
    -------
    y : torch.Tensor
        ``[T, H, P]`` in ``x.dtype``, ``D`` skip included.
    final : torch.Tensor
        ``[B, H, P, N]`` in ``state.dtype``.
    emitted : torch.Tensor
        ``[E, H, P, N]``.
    """
    heads, groups = x.shape[1], B.shape[1]
    if heads % groups or state.shape[1:] != (*x.shape[1:], B.shape[2]):
        raise ValueError(f"groups {groups} must divide heads {heads}, state "
                         f"[B, {heads}, {x.shape[2]}, {B.shape[2]}]; got {list(state.shape)}")
    if use_triton(x):
        from .recurrent_triton_scan import triton_ssd
        return triton_ssd(x, dt, A, B, C, D, cu_seqlens, state, dt_bias, dt_softplus, dt_limit,
                          emit_at)
    step_size = _time_step(dt, dt_bias, dt_softplus).clamp(*dt_limit)  # [T, H]
    decay = torch.exp(step_size * A.float())
    inputs = x.float()
    written = inputs * step_size[..., None]  # d * x
    skip = inputs * D.float()[:, None] if D is not None else torch.zeros_like(inputs)
    # each group's B and C serve H // G consecutive heads
    B, C = (t.float().repeat_interleave(heads // groups, dim=1) for t in (B, C))

    def step(tokens: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = s * decay[tokens, :, None, None] + written[tokens, ..., None] * B[tokens, :, None]
        return torch.einsum("nhpm,nhm->nhp", s, C[tokens]) + skip[tokens], s

    def chunked(tokens: list[torch.Tensor], s: torch.Tensor, emit_pos: torch.Tensor) -> Result:
        y, last, emitted = ssd_sequence(tokens[:4], s, emit_pos)
        return y + tokens[4], last, emitted

    pack = packing(cu_seqlens, x.shape[0], state.shape[0], emit_at)
    return scan_or_chunks(pack, state, torch.empty_like(x), step, chunked,
                          [written, step_size * A.float(), B, C, skip], CHUNKED_FROM["ssd"])


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                   cu_seqlens: torch.Tensor, state: torch.Tensor,
                   delta_bias: torch.Tensor | None = None, delta_softplus: bool = True,
                   emit_at: torch.Tensor | None = None) -> Result:
    """Mamba-1's selective scan (Mamba, Jamba, Falcon-Mamba), one token at a time.

    Per token and channel ``d``, with ``S`` the ``[N]`` state and
    ``t = softplus(delta + delta_bias)``::

        S = exp(t * A[d]) * S + t * u * B
        y = (S · C + D[d] * u) * silu(z)

    transformers' ``mamba_selective_state_update`` and ``mamba_selective_scan``.

    Parameters
    ----------
    u : torch.Tensor
        ``[T, D]`` inputs after the convolution.
    delta : torch.Tensor
        ``[T, D]`` time steps (``dt_proj.weight @ dt``, no bias yet).
    A : torch.Tensor
        ``[D, N]`` decay rates, ``-exp(A_log)``.
    B, C : torch.Tensor
        ``[T, N]`` input and output projections (shared by every channel).
    D : torch.Tensor or None
        ``[D]`` skip connection.
    z : torch.Tensor or None
        ``[T, D]`` gate, ``silu(z)`` multiplies the output.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]`` sequence offsets.
    state : torch.Tensor
        ``[B, D, N]`` initial states.
    delta_bias : torch.Tensor, optional
        ``[D]`` (``dt_proj.bias``) added to `delta` first.
    delta_softplus : bool
        Take the softplus of ``delta + delta_bias``.
    emit_at : torch.Tensor, optional
        int64 ``[E]`` token indices whose following state is wanted.

    Returns
    -------
    y : torch.Tensor
        ``[T, D]`` in ``u.dtype``.
    final : torch.Tensor
        ``[B, D, N]`` in ``state.dtype``.
    emitted : torch.Tensor
        ``[E, D, N]``.
    """
    if state.shape[1:] != A.shape or A.shape != (u.shape[1], B.shape[1]):
        raise ValueError(f"A [{u.shape[1]}, {B.shape[1]}] and state [B, {u.shape[1]}, "
                         f"{B.shape[1]}] expected, got {list(A.shape)}, {list(state.shape)}")
    if use_triton(u):
        from .recurrent_triton_scan import triton_selective_scan
        return triton_selective_scan(u, delta, A, B, C, D, z, cu_seqlens, state, delta_bias,
                                     delta_softplus, emit_at)
    step_size = _time_step(delta, delta_bias, delta_softplus)  # [T, D]
    inputs = u.float()
    written, rates = step_size * inputs, A.float()
    outside = inputs * D.float() if D is not None else torch.zeros_like(inputs)
    gate = F.silu(z.float()) if z is not None else torch.ones_like(inputs)
    B, C = B.float(), C.float()

    def step(tokens: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [n, D, N] per step: the whole [T, D, N] discretisation would be a prefill's T x state
        decay = torch.exp(step_size[tokens, :, None] * rates)
        s = s * decay + written[tokens, :, None] * B[tokens, None, :]
        y = torch.einsum("ndm,nm->nd", s, C[tokens]) + outside[tokens]
        return y * gate[tokens], s

    pack = packing(cu_seqlens, u.shape[0], state.shape[0], emit_at)
    return scan(pack, state, torch.empty_like(u), step)
