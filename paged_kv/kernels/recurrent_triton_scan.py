"""Triton kernels of Mamba's two recurrences over a packed batch: Mamba-2's SSD and Mamba-1's
selective scan (`recurrent.ssd`, `recurrent.selective_scan` are the references).

The same "fused recurrent" design as `recurrent_triton`: one program per (sequence, head and
block of head dims) or (sequence, block of channels) walks the sequence's tokens with its
``[rows, N]`` slice of the state in float32 registers, writing each token's output, the
states after the tokens of ``emit_at`` (per-token slots, `recurrent_triton.Emissions`) and the
final state. The time step is computed in the kernel as the reference computes it, bias and
softplus rounded to the time step's own dtype (transformers does both in the model's dtype).
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .recurrent_packing import Result
from .recurrent_triton import Emissions, strides

# cap on a program's rows of the state (head dims / channels): more programs and a smaller
# register tile for wide layers, since rows are independent; tests lower it
MAX_BLOCK_ROWS = 16


if triton is not None:

    @triton.jit
    def _rounded(x, like, BF16: tl.constexpr):
        """Float32 `x` rounded to `like`'s dtype (to nearest, ties to even), in float32.

        bfloat16 by hand: the interpreter's float32 -> bfloat16 cast truncates, and the time
        step's rounding is what a bfloat16 reference sees, so both paths must round as torch.
        """
        if BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        return x.to(like.dtype).to(tl.float32)

    @triton.jit
    def _time_step(dt, bias_ptr, index, mask, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   BF16: tl.constexpr):
        """Float32 ``softplus(dt + bias)`` with each op rounded to `dt`'s dtype (BF16: it is
        bfloat16), as `recurrent._time_step` (the bias arrives already in that dtype)."""
        x = dt.to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + index, mask=mask, other=0.0).to(tl.float32)
            x = _rounded(x + bias, dt, BF16)
        if SOFTPLUS:
            e = tl.exp(tl.minimum(x, 20.0))
            # log1p(e) exactly enough for tiny e (Goldberg): log(u) * e / (u - 1), u = 1 + e
            u = 1.0 + e
            log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
            # torch's softplus is linear above its threshold of 20
            x = _rounded(tl.where(x > 20.0, x, log1p), dt, BF16)
        return x

    @triton.jit
    def _ssd_kernel(
        x_ptr, dt_ptr, a_ptr,        # [T, H, P], [T, H], [H]
        b_ptr, c_ptr, d_ptr,         # [T, G, N] x2, [H] (read when HAS_D)
        dt_bias_ptr, state_ptr,      # [H] in dt's dtype (read when HAS_BIAS), [B, H, P, N]
        out_ptr, final_ptr,          # [T, H, P], [B, H, P, N], contiguous
        emitted_ptr,                 # [U, H, P, N] contiguous
        cu_ptr, slots_ptr,           # int64 [B + 1], int32 [T]
        x_stride_t, x_stride_h, x_stride_p, dt_stride_t, dt_stride_h,
        b_stride_t, b_stride_g, b_stride_n, c_stride_t, c_stride_g, c_stride_n,
        s_stride_b, s_stride_h, s_stride_p, s_stride_n,
        num_heads, group, head_dim, state_dim, dt_min, dt_max,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr,
        HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, BF16: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.arange(0, BLOCK_N)
        is_row, is_col = rows < head_dim, cols < state_dim
        is_entry = is_row[:, None] & is_col[None, :]
        bc_group = head // group  # each of B's and C's G groups serves `group` heads
        start = tl.load(cu_ptr + seq)
        end = tl.load(cu_ptr + seq + 1)
        s = tl.load(state_ptr + seq * s_stride_b + head * s_stride_h + rows[:, None] * s_stride_p
                    + cols[None, :] * s_stride_n, mask=is_entry, other=0.0).to(tl.float32)
        rate = tl.load(a_ptr + head).to(tl.float32)
        skip = 0.0
        if HAS_D:
            skip = tl.load(d_ptr + head).to(tl.float32)
        entry = (head * head_dim + rows[:, None]) * state_dim + cols[None, :]
        state_size = num_heads * head_dim * state_dim
        for t in range(start, end):
            step = _time_step(tl.load(dt_ptr + t * dt_stride_t + head * dt_stride_h),
                              dt_bias_ptr, head, head < num_heads, HAS_BIAS, SOFTPLUS, BF16)
            step = tl.minimum(tl.maximum(step, dt_min), dt_max)
            x = tl.load(x_ptr + t * x_stride_t + head * x_stride_h + rows * x_stride_p,
                        mask=is_row, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + t * b_stride_t + bc_group * b_stride_g + cols * b_stride_n,
                        mask=is_col, other=0.0).to(tl.float32)
            c = tl.load(c_ptr + t * c_stride_t + bc_group * c_stride_g + cols * c_stride_n,
                        mask=is_col, other=0.0).to(tl.float32)
            s = s * tl.exp(step * rate) + (x * step)[:, None] * b[None, :]
            y = tl.sum(s * c[None, :], axis=1) + skip * x
            tl.store(out_ptr + (t * num_heads + head) * head_dim + rows,
                     y.to(out_ptr.dtype.element_ty), mask=is_row)
            slot = tl.load(slots_ptr + t)
            if slot >= 0:
                tl.store(emitted_ptr + slot.to(tl.int64) * state_size + entry,
                         s.to(emitted_ptr.dtype.element_ty), mask=is_entry)
        tl.store(final_ptr + seq * state_size + entry, s.to(final_ptr.dtype.element_ty),
                 mask=is_entry)

    @triton.jit
    def _selective_scan_kernel(
        u_ptr, delta_ptr, a_ptr,     # [T, D] x2, [D, N]
        b_ptr, c_ptr, d_ptr, z_ptr,  # [T, N] x2, [D] (read when HAS_D), [T, D] (HAS_Z)
        delta_bias_ptr, state_ptr,   # [D] in delta's dtype (read when HAS_BIAS), [B, D, N]
        out_ptr, final_ptr,          # [T, D], [B, D, N], contiguous
        emitted_ptr,                 # [U, D, N] contiguous
        cu_ptr, slots_ptr,           # int64 [B + 1], int32 [T]
        u_stride_t, u_stride_d, delta_stride_t, delta_stride_d, a_stride_d, a_stride_n,
        b_stride_t, b_stride_n, c_stride_t, c_stride_n, z_stride_t, z_stride_d,
        s_stride_b, s_stride_d, s_stride_n,
        channels, state_dim,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr,
        HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
        BF16: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        cols = tl.arange(0, BLOCK_N)
        is_row, is_col = rows < channels, cols < state_dim
        is_entry = is_row[:, None] & is_col[None, :]
        start = tl.load(cu_ptr + seq)
        end = tl.load(cu_ptr + seq + 1)
        s = tl.load(state_ptr + seq * s_stride_b + rows[:, None] * s_stride_d
                    + cols[None, :] * s_stride_n, mask=is_entry, other=0.0).to(tl.float32)
        rates = tl.load(a_ptr + rows[:, None] * a_stride_d + cols[None, :] * a_stride_n,
                        mask=is_entry, other=0.0).to(tl.float32)
        skip = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_D:
            skip = tl.load(d_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
        entry = rows[:, None] * state_dim + cols[None, :]
        state_size = channels * state_dim
        for t in range(start, end):
            step = _time_step(tl.load(delta_ptr + t * delta_stride_t + rows * delta_stride_d,
                                      mask=is_row, other=0.0),
                              delta_bias_ptr, rows, is_row, HAS_BIAS, SOFTPLUS, BF16)
            u = tl.load(u_ptr + t * u_stride_t + rows * u_stride_d, mask=is_row,
                        other=0.0).to(tl.float32)
            b = tl.load(b_ptr + t * b_stride_t + cols * b_stride_n, mask=is_col,
                        other=0.0).to(tl.float32)
            c = tl.load(c_ptr + t * c_stride_t + cols * c_stride_n, mask=is_col,
                        other=0.0).to(tl.float32)
            s = s * tl.exp(step[:, None] * rates) + (step * u)[:, None] * b[None, :]
            y = tl.sum(s * c[None, :], axis=1) + skip * u
            if HAS_Z:  # times silu(z)
                z = tl.load(z_ptr + t * z_stride_t + rows * z_stride_d, mask=is_row,
                            other=0.0).to(tl.float32)
                y = y * (z / (1.0 + tl.exp(-z)))
            tl.store(out_ptr + t * channels + rows, y.to(out_ptr.dtype.element_ty), mask=is_row)
            slot = tl.load(slots_ptr + t)
            if slot >= 0:
                tl.store(emitted_ptr + slot.to(tl.int64) * state_size + entry,
                         s.to(emitted_ptr.dtype.element_ty), mask=is_entry)
        tl.store(final_ptr + seq * state_size + entry, s.to(final_ptr.dtype.element_ty),
                 mask=is_entry)


def _in_dtype(bias: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`bias` cast to `like`'s dtype (the reference adds it there), or any pointer if None."""
    return like if bias is None else bias.to(like.dtype).contiguous()


def triton_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None, cu_seqlens: torch.Tensor,
               state: torch.Tensor, dt_bias: torch.Tensor | None = None,
               dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")),
               emit_at: torch.Tensor | None = None) -> Result:
    """Triton `recurrent.ssd`: same arguments (shapes checked there), same results.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H, P]``; dt ``[T, H]``; A ``[H]``; B, C ``[T, G, N]`` (``G`` divides ``H``);
        D ``[H]`` or None.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``.
    state : torch.Tensor
        ``[B, H, P, N]``.
    dt_bias : torch.Tensor, optional
        ``[H]``.
    dt_softplus : bool
    dt_limit : tuple of float
    emit_at : torch.Tensor, optional
        int64 ``[E]``.

    Returns
    -------
    tuple of torch.Tensor
        y ``[T, H, P]`` (``x.dtype``), final ``[B, H, P, N]`` and emitted ``[E, H, P, N]``
        (``state.dtype``).
    """
    (num_tokens, heads, head_dim), (groups, state_dim) = x.shape, B.shape[1:]
    batch = state.shape[0]
    emissions = Emissions(cu_seqlens, num_tokens, batch, emit_at, x.device)
    out = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    final, emitted = torch.empty_like(state, memory_format=torch.contiguous_format), \
        emissions.buffer(state)
    if batch:
        block_p = min(triton.next_power_of_2(head_dim), MAX_BLOCK_ROWS)
        _ssd_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
            x, dt, A.contiguous(), B, C, A if D is None else D.contiguous(),
            _in_dtype(dt_bias, dt), state, out, final, emitted, emissions.cu, emissions.slots,
            *strides(x, dt, B, C, state), heads, heads // groups, head_dim, state_dim,
            float(dt_limit[0]), float(dt_limit[1]), BLOCK_P=block_p,
            BLOCK_N=triton.next_power_of_2(state_dim), HAS_D=D is not None,
            HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
            BF16=dt.dtype == torch.bfloat16)
    return out, final, emissions.gather(emitted)


def triton_selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                          z: torch.Tensor | None, cu_seqlens: torch.Tensor, state: torch.Tensor,
                          delta_bias: torch.Tensor | None = None, delta_softplus: bool = True,
                          emit_at: torch.Tensor | None = None) -> Result:
    """Triton `recurrent.selective_scan`: same arguments (shapes checked there), same results.

    Parameters
    ----------
    u, delta : torch.Tensor
        ``[T, D]``; A ``[D, N]``; B, C ``[T, N]``; D ``[D]`` or None; z ``[T, D]`` or None.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``.
    state : torch.Tensor
        ``[B, D, N]``.
    delta_bias : torch.Tensor, optional
        ``[D]``.
    delta_softplus : bool
    emit_at : torch.Tensor, optional
        int64 ``[E]``.

    Returns
    -------
    tuple of torch.Tensor
        y ``[T, D]`` (``u.dtype``), final ``[B, D, N]`` and emitted ``[E, D, N]``
        (``state.dtype``).
    """
    (num_tokens, channels), state_dim = u.shape, B.shape[1]
    batch = state.shape[0]
    emissions = Emissions(cu_seqlens, num_tokens, batch, emit_at, u.device)
    out = torch.empty((num_tokens, channels), dtype=u.dtype, device=u.device)
    final, emitted = torch.empty_like(state, memory_format=torch.contiguous_format), \
        emissions.buffer(state)
    if batch:
        block_d = min(triton.next_power_of_2(channels), MAX_BLOCK_ROWS)
        gate = u if z is None else z
        _selective_scan_kernel[(batch, triton.cdiv(channels, block_d))](
            u, delta, A, B, C, A if D is None else D.contiguous(), gate,
            _in_dtype(delta_bias, delta), state, out, final, emitted, emissions.cu,
            emissions.slots, *strides(u, delta, A, B, C, gate, state), channels, state_dim,
            BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(state_dim), HAS_D=D is not None,
            HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
            BF16=delta.dtype == torch.bfloat16)
    return out, final, emissions.gather(emitted)
