"""Triton kernels of the packed-batch convolution and gated delta rule (`recurrent`'s torch
functions are the reference; Mamba's two scans are in `recurrent_triton_scan`).

Each is a "fused recurrent" kernel: one program per (sequence, head or channel block) walks
its sequence's tokens in order with the state in registers, in float32, so a decode is one
step and a prefill chunk a loop, all sequences of a mixed batch in one launch. The states
after the tokens of ``emit_at`` are written as the loop passes them: the host turns
``emit_at`` into a per-token slot array (``-1``, or the row of the emitted buffer), so the
kernel tests one int per token instead of searching the emissions.

Shape checks are the public functions' (`recurrent.causal_conv1d`, ...), which call these
when `backend.use_triton` says so; the offsets and emissions are checked here again
(`recurrent.packing`), so a direct call cannot read out of bounds.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .recurrent_packing import Result, packing

# cap on a program's block of value columns / channels: wider layers get more programs (the
# rows of the state are independent), which keeps the register tile small; tests lower it
MAX_BLOCK_V = 32
MAX_BLOCK_C = 256


class Emissions:
    """Where each token's post-token state goes, from `emit_at` (checked by `packing`).

    Attributes
    ----------
    cu : torch.Tensor
        int64 ``[B + 1]`` offsets on the kernels' device.
    slots : torch.Tensor
        int32 ``[max(T, 1)]``: ``-1``, or the row of ``buffer`` that token's state goes to.
    rows : int
        ``U``, the distinct tokens of `emit_at` (a repeated token is written once).
    """

    def __init__(self, cu_seqlens: torch.Tensor, num_tokens: int, batch: int,
                 emit_at: torch.Tensor | None, device: torch.device) -> None:
        pack = packing(cu_seqlens, num_tokens, batch, emit_at)
        emit = pack.starts[pack.emit_seq] + pack.emit_pos  # [E] token indices, checked
        tokens, self._inverse = torch.unique(emit, return_inverse=True)
        self.rows = tokens.numel()
        self.cu = cu_seqlens.to(device=device, dtype=torch.int64)
        # at least one element: a launcher never gets a zero-size tensor as a pointer
        self.slots = torch.full((max(num_tokens, 1),), -1, dtype=torch.int32, device=device)
        self.slots[tokens.to(device)] = torch.arange(self.rows, dtype=torch.int32,
                                                     device=device)

    def buffer(self, state: torch.Tensor) -> torch.Tensor:
        """``[max(U, 1), ...]`` contiguous rows in ``state``'s dtype for the kernel to fill."""
        return state.new_empty((max(self.rows, 1), *state.shape[1:]))

    def gather(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[E, ...]``: each emission's row of the filled `buffer`, repeats included."""
        return buffer[self._inverse.to(buffer.device)]


def strides(*tensors: torch.Tensor) -> list[int]:
    """Every stride of `tensors`, in order: inputs may be views of a projection's output."""
    return [stride for tensor in tensors for stride in tensor.stride()]


if triton is not None:

    @triton.jit
    def _stream(x_ptr, state_ptr, seq, start, channels, positions, valid,
                x_stride_t, x_stride_c, s_stride_b, s_stride_c, s_stride_w, window):
        """Float32 ``[BLOCK_C, n]`` of the sequence's input stream at `positions` ``[1, n]``:
        the ``window`` columns of its state, then its tokens (position ``window`` = token 0)."""
        old = positions < window
        from_state = tl.load(state_ptr + seq * s_stride_b + channels * s_stride_c
                             + positions * s_stride_w, mask=valid & old, other=0.0)
        from_x = tl.load(x_ptr + (start + positions - window) * x_stride_t
                         + channels * x_stride_c, mask=valid & ~old, other=0.0)
        return tl.where(old, from_state.to(tl.float32), from_x.to(tl.float32))

    @triton.jit
    def _causal_conv1d_kernel(
        x_ptr, weight_ptr, bias_ptr, state_ptr,   # [T, C], [C, K], [C], [B, C, W]
        out_ptr, final_ptr, emitted_ptr,          # [T, C], [B, C, W], [U, C, W] contiguous
        cu_ptr, slots_ptr,                        # int64 [B + 1], int32 [T]
        x_stride_t, x_stride_c, w_stride_c, w_stride_k,
        s_stride_b, s_stride_c, s_stride_w,
        num_channels, width, window,              # C, K, W
        BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):
        # the window is a slice of the stream (state columns, then the tokens), so each
        # token's taps and each emitted window are read where they lie instead of shifted
        # through registers (Triton has no register shift); the reads hit cache
        seq = tl.program_id(0).to(tl.int64)
        lanes = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        is_lane = lanes < num_channels
        channels, is_channel = lanes[:, None], is_lane[:, None]
        start = tl.load(cu_ptr + seq)
        length = tl.load(cu_ptr + seq + 1) - start
        taps_at = tl.arange(0, BLOCK_K)[None, :]
        columns = tl.arange(0, BLOCK_W)[None, :]
        is_tap, is_column = is_channel & (taps_at < width), is_channel & (columns < window)
        taps = tl.load(weight_ptr + channels * w_stride_c + taps_at * w_stride_k,
                       mask=is_tap, other=0.0).to(tl.float32)
        shift = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            shift = tl.load(bias_ptr + lanes, mask=is_lane, other=0.0).to(tl.float32)
        # the window after token i is the stream's positions i + 1 ... i + W
        state_out = channels * window + columns
        for i in range(0, length):
            full = _stream(x_ptr, state_ptr, seq, start, channels, i + 1 + window - width
                           + taps_at, is_tap, x_stride_t, x_stride_c, s_stride_b,
                           s_stride_c, s_stride_w, window)
            y = tl.sum(full * taps, axis=1) + shift
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            tl.store(out_ptr + (start + i) * num_channels + lanes,
                     y.to(out_ptr.dtype.element_ty), mask=is_lane)
            slot = tl.load(slots_ptr + start + i)
            if slot >= 0:
                emitted = _stream(x_ptr, state_ptr, seq, start, channels, i + 1 + columns,
                                  is_column, x_stride_t, x_stride_c, s_stride_b, s_stride_c,
                                  s_stride_w, window)
                tl.store(emitted_ptr + slot.to(tl.int64) * num_channels * window + state_out,
                         emitted.to(emitted_ptr.dtype.element_ty), mask=is_column)
        final = _stream(x_ptr, state_ptr, seq, start, channels, length + columns, is_column,
                        x_stride_t, x_stride_c, s_stride_b, s_stride_c, s_stride_w, window)
        tl.store(final_ptr + seq * num_channels * window + state_out,
                 final.to(final_ptr.dtype.element_ty), mask=is_column)

    @triton.jit
    def _gated_delta_rule_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,     # [T, Hk, Dk] x2, [T, H, Dv], [T, H] x2
        state_ptr,                                # [B, H, Dk, Dv]
        out_ptr, final_ptr, emitted_ptr,          # [T, H, Dv], [B | U, H, Dk, Dv] contiguous
        cu_ptr, slots_ptr,                        # int64 [B + 1], int32 [T]
        q_stride_t, q_stride_h, q_stride_d, k_stride_t, k_stride_h, k_stride_d,
        v_stride_t, v_stride_h, v_stride_d, g_stride_t, g_stride_h,
        beta_stride_t, beta_stride_h, s_stride_b, s_stride_h, s_stride_k, s_stride_v,
        num_heads, group, key_dim, value_dim, scale,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        key_head = head // group  # GQA: Hk query/key heads, each for `group` value heads
        keys = tl.arange(0, BLOCK_K)
        values = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        is_key, is_value = keys < key_dim, values < value_dim
        is_entry = is_key[:, None] & is_value[None, :]
        start = tl.load(cu_ptr + seq)
        end = tl.load(cu_ptr + seq + 1)
        s = tl.load(state_ptr + seq * s_stride_b + head * s_stride_h + keys[:, None] * s_stride_k
                    + values[None, :] * s_stride_v, mask=is_entry, other=0.0).to(tl.float32)
        entry = (head * key_dim + keys[:, None]) * value_dim + values[None, :]
        state_size = num_heads * key_dim * value_dim
        for t in range(start, end):
            q = tl.load(q_ptr + t * q_stride_t + key_head * q_stride_h + keys * q_stride_d,
                        mask=is_key, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * k_stride_t + key_head * k_stride_h + keys * k_stride_d,
                        mask=is_key, other=0.0).to(tl.float32)
            if L2NORM:  # padded lanes are 0, so the sums are the head's
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
                k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            q = q * scale
            v = tl.load(v_ptr + t * v_stride_t + head * v_stride_h + values * v_stride_d,
                        mask=is_value, other=0.0).to(tl.float32)
            decay = tl.exp(tl.load(g_ptr + t * g_stride_t + head * g_stride_h).to(tl.float32))
            beta = tl.load(beta_ptr + t * beta_stride_t + head * beta_stride_h).to(tl.float32)
            s = s * decay
            delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_V]
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(out_ptr + (t * num_heads + head) * value_dim + values,
                     o.to(out_ptr.dtype.element_ty), mask=is_value)
            slot = tl.load(slots_ptr + t)
            if slot >= 0:
                tl.store(emitted_ptr + slot.to(tl.int64) * state_size + entry,
                         s.to(emitted_ptr.dtype.element_ty), mask=is_entry)
        tl.store(final_ptr + seq * state_size + entry, s.to(final_ptr.dtype.element_ty),
                 mask=is_entry)


def triton_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                         activation: str | None = "silu",
                         emit_at: torch.Tensor | None = None) -> Result:
    """Triton `recurrent.causal_conv1d`: same arguments (shapes checked there), same results.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, C]``; weight ``[C, K]``; bias ``[C]`` or None.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``.
    conv_state : torch.Tensor
        ``[B, C, W]``, ``W >= K - 1``.
    activation : {"silu", "swish", None}
    emit_at : torch.Tensor, optional
        int64 ``[E]``.

    Returns
    -------
    tuple of torch.Tensor
        out ``[T, C]`` (``x.dtype``), final ``[B, C, W]`` and emitted ``[E, C, W]``
        (``conv_state.dtype``).
    """
    (num_tokens, channels), width = x.shape, weight.shape[1]
    batch, window = conv_state.shape[0], conv_state.shape[2]
    emissions = Emissions(cu_seqlens, num_tokens, batch, emit_at, x.device)
    out = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    final, emitted = torch.empty_like(conv_state, memory_format=torch.contiguous_format), \
        emissions.buffer(conv_state)
    if batch:
        block_c = min(triton.next_power_of_2(channels), MAX_BLOCK_C)
        _causal_conv1d_kernel[(batch, triton.cdiv(channels, block_c))](
            x, weight, weight if bias is None else bias, conv_state, out, final, emitted,
            emissions.cu, emissions.slots, *strides(x, weight, conv_state),
            channels, width, window, BLOCK_C=block_c,
            BLOCK_K=triton.next_power_of_2(width), BLOCK_W=triton.next_power_of_2(window),
            HAS_BIAS=bias is not None, SILU=activation is not None)
    return out, final, emissions.gather(emitted)


def triton_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                            emit_at: torch.Tensor | None = None, use_qk_l2norm: bool = True,
                            scale: float | None = None) -> Result:
    """Triton `recurrent.gated_delta_rule`: same arguments (shapes checked there), same results.

    Parameters
    ----------
    q, k : torch.Tensor
        ``[T, Hk, Dk]``, ``Hk`` dividing ``H``.
    v : torch.Tensor
        ``[T, H, Dv]``; g, beta ``[T, H]``.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``.
    state : torch.Tensor
        ``[B, H, Dk, Dv]``.
    emit_at : torch.Tensor, optional
        int64 ``[E]``.
    use_qk_l2norm : bool
    scale : float, optional
        ``Dk ** -0.5`` by default.

    Returns
    -------
    tuple of torch.Tensor
        out ``[T, H, Dv]`` (``q.dtype``), final ``[B, H, Dk, Dv]`` and emitted
        ``[E, H, Dk, Dv]`` (``state.dtype``).
    """
    (num_tokens, heads, value_dim), (key_heads, key_dim) = v.shape, k.shape[1:]
    batch = state.shape[0]
    emissions = Emissions(cu_seqlens, num_tokens, batch, emit_at, v.device)
    out = torch.empty((num_tokens, heads, value_dim), dtype=q.dtype, device=v.device)
    final, emitted = torch.empty_like(state, memory_format=torch.contiguous_format), \
        emissions.buffer(state)
    if batch:
        block_v = min(triton.next_power_of_2(value_dim), MAX_BLOCK_V)
        _gated_delta_rule_kernel[(batch, heads, triton.cdiv(value_dim, block_v))](
            q, k, v, g, beta, state, out, final, emitted, emissions.cu, emissions.slots,
            *strides(q, k, v, g, beta, state), heads, heads // key_heads, key_dim, value_dim,
            key_dim ** -0.5 if scale is None else float(scale),
            BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v, L2NORM=use_qk_l2norm)
    return out, final, emissions.gather(emitted)
