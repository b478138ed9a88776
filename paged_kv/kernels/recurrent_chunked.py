"""Chunked torch forms of the recurrences in `paged_kv.kernels.recurrent`, for prefill.

The sequential scan there costs one Python step per token of the longest sequence; here a
long sequence is cut into chunks of `CHUNK` tokens, each chunk's tokens are mixed at once by
matrix products, and only the ``[H, X, Y]`` state is carried from chunk to chunk (one or two
products a chunk). Both recurrences are linear in the state with a per-token scalar decay::

    S_t = exp(a_t) * S_{t-1} + l_t ⊗ r_t

so inside a chunk, with ``G_t`` the chunk's cumulative log decay up to ``t`` (inclusive),
``S_t = exp(G_t) S_0 + sum_{i <= t} exp(G_t - G_i) l_i ⊗ r_i``: the state after *any*
token is a closed form of the chunk's start state, which is how emitted states are had
without cutting the chunk grid at them (outputs do not depend on what is emitted).

- `delta_sequence`: the gated delta rule, ``l = k``, ``r = delta``, where the deltas are the
  solution of a unit lower-triangular system (the WY / UT transform), ``U - W S_0``;
- `ssd_sequence`: Mamba-2's SSD, ``l = dt * x``, ``r = B``, whose chunk needs no solve;
- `conv_all`: the causal convolution of every token at once, read from each sequence's window
  followed by its tokens (a gather, no per-token loop).

Everything is float32 (the callers cast). `over_sequences` runs a family's function over the
sequences long enough to gain and writes their outputs, final and emitted states; the scan
keeps the rest (decodes), see `short_packing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .recurrent_packing import Packing

CHUNK = 64  # tokens mixed at once: the cost of a chunk's [C, C] products against its steps

# (one sequence's per-token inputs [L, ...], its state [H, X, Y] float32, emit positions [E])
# -> (outputs [L, ...], final state [H, X, Y], emitted states [E, H, X, Y])
SequenceFn = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _size(t: torch.Tensor) -> int:
    """The chunk for a sequence of ``len(t)`` tokens: `CHUNK`, or all of a shorter one (no
    padding to compute)."""
    return max(min(CHUNK, t.shape[0]), 1)


def _grid(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[L, H, ...]`` -> ``[n, H, C, ...]``, zero-padded to ``n = ceil(L / C)`` chunks.

    Zero padding is a no-op token for both recurrences: no decay (``a = 0``) and no write
    (a zero key, value, strength or time step), so the last chunk's end state is the final.
    """
    pad = -t.shape[0] % chunk
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    # contiguous once here, not again inside each product that reads it
    return t.reshape(-1, chunk, *t.shape[1:]).transpose(1, 2).contiguous()


def _decays(cum: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` cumulative log decays -> ``[..., C, C]``: ``exp(G_t - G_i)`` for
    ``i <= t``, zero above the diagonal (filled before the exp: ``G_t - G_i > 0`` there and
    could overflow to inf, and inf * 0 is nan)."""
    size = cum.shape[-1]
    upper = torch.ones(size, size, dtype=torch.bool, device=cum.device).triu(1)
    return (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()


def _states_at(positions: torch.Tensor, cum: torch.Tensor, left: torch.Tensor,
               right: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The states after the tokens at `positions`, from their chunk's start state.

    Parameters
    ----------
    positions : torch.Tensor
        int64 ``[E]`` token positions in the sequence.
    cum : torch.Tensor
        ``[n, H, C]`` cumulative log decays, each chunk from its start.
    left, right : torch.Tensor
        ``[n, H, C, X]`` and ``[n, H, C, Y]``: token ``i`` writes ``left_i ⊗ right_i``.
    starts : torch.Tensor
        ``[n, H, X, Y]`` the state before each chunk.

    Returns
    -------
    torch.Tensor
        ``[E, H, X, Y]``.
    """
    size = cum.shape[-1]
    chunk, offset = positions // size, positions % size
    here = cum[chunk, :, offset]  # [E, H]
    later = torch.arange(size, device=cum.device) > offset[:, None, None]  # [E, 1, C]
    weight = (here[..., None] - cum[chunk]).masked_fill(later, float("-inf")).exp()
    written = (weight[..., None] * left[chunk]).transpose(-1, -2) @ right[chunk]
    return here.exp()[..., None, None] * starts[chunk] + written


def delta_sequence(tokens: Sequence[torch.Tensor], state: torch.Tensor,
                   emit_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's gated delta rule in chunks of `CHUNK` tokens.

    Inside a chunk the deltas ``delta_t = beta_t (v_t - (exp(g_t) S_{t-1})ᵀ k_t)`` satisfy
    ``(I + A) Δ = beta V - beta exp(G) K S_0`` with ``A`` strictly lower triangular,
    ``A[t, i] = beta_t exp(G_t - G_i) k_t·k_i``; one triangular solve of every chunk at once
    gives ``Δ = U - W S_0``, and only ``W S_0`` waits for the previous chunk's state.

    Parameters
    ----------
    tokens : sequence of torch.Tensor
        ``q [L, H, Dk]`` (normalised and scaled), ``k [L, H, Dk]`` (normalised),
        ``v [L, H, Dv]``, ``g [L, H]`` log decays, ``beta [L, H]``; all float32, ``q`` and
        ``k`` already repeated to the value heads.
    state : torch.Tensor
        ``[H, Dk, Dv]`` float32 initial state.
    emit_pos : torch.Tensor
        int64 ``[E]`` positions whose following state is wanted.

    Returns
    -------
    tuple of torch.Tensor
        Outputs ``[L, H, Dv]``, the final state ``[H, Dk, Dv]``, the emitted ``[E, H, Dk, Dv]``.
    """
    q, k, v, g, beta = (_grid(t, _size(tokens[0])) for t in tokens)  # [n, H, C, ...]
    cum = g.cumsum(-1)
    decays = _decays(cum)
    mixing = (k @ k.transpose(-1, -2)) * decays * beta[..., None]
    solved = torch.linalg.solve_triangular(
        mixing, torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], -1),
        upper=False, left=True, unitriangular=True)  # the diagonal is read as ones
    fresh, through = solved.split([v.shape[-1], k.shape[-1]], -1)  # U, W
    to_end = (cum[..., -1:] - cum).exp()[..., None] * k  # [n, H, C, Dk]
    deltas, starts = torch.empty_like(fresh), state.new_empty(k.shape[0], *state.shape)
    for c in range(k.shape[0]):  # the one sequential part: a chunk's state
        starts[c] = state
        deltas[c] = fresh[c] - through[c] @ state
        state = cum[c, :, -1, None, None].exp() * state + to_end[c].transpose(-1, -2) \
            @ deltas[c]
    out = cum.exp()[..., None] * (q @ starts) + ((q @ k.transpose(-1, -2)) * decays) @ deltas
    emitted = _states_at(emit_pos, cum, k, deltas, starts)
    return _ungrid(out, tokens[0].shape[0]), state, emitted


def ssd_sequence(tokens: Sequence[torch.Tensor], state: torch.Tensor,
                 emit_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's SSD (Mamba-2) in chunks of `CHUNK` tokens: the state space duality.

    A chunk's outputs are its start state read through ``C`` and decayed, plus a masked
    ``(C Bᵀ ∘ decays) (dt x)`` product among its own tokens; its end state is the start
    decayed plus what its tokens wrote, summed at once.

    Parameters
    ----------
    tokens : sequence of torch.Tensor
        ``written [L, H, P]`` (``dt * x``), ``a [L, H]`` log decays (``dt * A``),
        ``B [L, H, N]`` and ``C [L, H, N]`` (repeated to the heads); float32.
    state : torch.Tensor
        ``[H, P, N]`` float32 initial state.
    emit_pos : torch.Tensor
        int64 ``[E]`` positions whose following state is wanted.

    Returns
    -------
    tuple of torch.Tensor
        Outputs ``[L, H, P]`` (no ``D`` skip), the final state ``[H, P, N]``, the emitted
        ``[E, H, P, N]``.
    """
    written, a, B, C = (_grid(t, _size(tokens[0])) for t in tokens)
    cum = a.cumsum(-1)
    # what each chunk writes by its end, [n, H, P, N], before its start state is known
    ends = ((cum[..., -1:] - cum).exp()[..., None] * written).transpose(-1, -2) @ B
    starts = state.new_empty(written.shape[0], *state.shape)
    for c in range(written.shape[0]):
        starts[c] = state
        state = cum[c, :, -1, None, None].exp() * state + ends[c]
    out = cum.exp()[..., None] * (C @ starts.transpose(-1, -2)) \
        + ((C @ B.transpose(-1, -2)) * _decays(cum)) @ written
    emitted = _states_at(emit_pos, cum, written, B, starts)
    return _ungrid(out, tokens[0].shape[0]), state, emitted


def _ungrid(out: torch.Tensor, length: int) -> torch.Tensor:
    """``[n, H, C, ...]`` -> ``[L, H, ...]``, the padding dropped."""
    return out.transpose(1, 2).reshape(-1, *out.shape[1:2], *out.shape[3:])[:length]


def long_sequences(pack: Packing, shortest: int | None) -> list[int]:
    """The sequences with at least `shortest` tokens (none when `shortest` is None)."""
    if shortest is None:
        return []
    return (pack.lengths >= max(shortest, 1)).nonzero().squeeze(1).tolist()


def short_packing(pack: Packing, long: list[int]) -> Packing:
    """`pack` with the `long` sequences given no tokens and no emissions, for the scan.

    Their states then pass through the scan unchanged, and `over_sequences` overwrites them.
    """
    lengths = pack.lengths.clone()
    lengths[long] = 0
    emit_pos = pack.emit_pos.clone()
    emit_pos[torch.isin(pack.emit_seq, pack.emit_seq.new_tensor(long))] = -1  # never reached
    return pack._replace(lengths=lengths, emit_pos=emit_pos, longest=int(lengths.max()))


def over_sequences(pack: Packing, long: list[int], fn: SequenceFn,
                   tokens: Sequence[torch.Tensor], state: torch.Tensor,
                   result: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Run `fn` over each of the `long` sequences of `pack`, writing into `result`.

    Parameters
    ----------
    pack : Packing
        The whole batch's.
    long : list of int
        The sequences to run.
    fn : SequenceFn
        `delta_sequence`, `ssd_sequence` or a wrapper.
    tokens : sequence of torch.Tensor
        ``[T, ...]`` per-token inputs of the whole batch (float32).
    state : torch.Tensor
        ``[B, H, X, Y]`` initial states.
    result : tuple of torch.Tensor
        ``out [T, ...]``, ``final [B, ...]``, ``emitted [E, ...]``, written in place (cast).
    """
    out, final, emitted = result
    for b in long:
        start, stop = int(pack.starts[b]), int(pack.starts[b] + pack.lengths[b])
        mine = (pack.emit_seq == b).nonzero().squeeze(1)
        outputs, last, states = fn([t[start:stop] for t in tokens],
                                   state[b].to(torch.float32), pack.emit_pos[mine])
        out[start:stop] = outputs.to(out.dtype)
        final[b] = last.to(final.dtype)
        emitted[mine] = states.to(emitted.dtype)


def conv_all(inputs: torch.Tensor, taps: torch.Tensor, pack: Packing,
             window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal convolution of every token at once (before bias and activation).

    Each sequence's window (``W`` columns) and tokens are laid back to back in one
    ``[B W + T, C]`` tensor; token ``t`` of sequence ``b`` sits at row ``t + (b + 1) W`` and
    reads the ``K`` rows ending there, one product per tap. Windows after a token are the
    ``W`` rows ending at it.

    Parameters
    ----------
    inputs : torch.Tensor
        ``[T, C]`` float32.
    taps : torch.Tensor
        ``[C, K]`` float32.
    pack : Packing
        From `packing`.
    window : torch.Tensor
        ``[B, C, W]`` float32 windows, oldest first.

    Returns
    -------
    tuple of torch.Tensor
        Sums ``[T, C]``; windows after each sequence ``[B, C, W]`` and after each emitted
        token ``[E, C, W]``.
    """
    batch, channels, width = window.shape
    count = torch.arange(max(batch, width, inputs.shape[0]), device=inputs.device)
    seq = torch.repeat_interleave(count[:batch], pack.lengths)  # [T]
    rows = count[:inputs.shape[0]] + (seq + 1) * width  # each token's row
    first = pack.starts + count[:batch] * width  # each window's first row
    laid = inputs.new_empty(batch * width + inputs.shape[0], channels)
    laid[rows] = inputs
    laid[(first[:, None] + count[:width]).reshape(-1)] = \
        window.transpose(1, 2).reshape(-1, channels)
    size = taps.shape[1]
    # oldest tap first, as the scan's sum adds them; tap j reads K - 1 - j rows back
    sums = laid[rows - (size - 1)] * taps[:, 0]
    for tap in range(1, size):
        sums = sums + laid[rows - (size - 1 - tap)] * taps[:, tap]
    ends = first + width + pack.lengths  # one past each sequence's last row
    emit_rows = pack.starts[pack.emit_seq] + (pack.emit_seq + 1) * width + pack.emit_pos + 1
    final, emitted = (laid[stop[:, None] - width + count[:width]].transpose(1, 2)
                      for stop in (ends, emit_rows))
    return sums, final, emitted
