"""Mamba-2 mixers (Mamba-2, Nemotron-H, Granite 4 hybrids, Bamba) over the engine's packed batch.

transformers 5.x runs the same computation in all four classes (``Mamba2Mixer``,
``NemotronHMamba2Mixer``, ``GraniteMoeHybridMambaLayer``, ``BambaMixer``; their forwards,
``mamba2_scan_forward``, ``mamba2_chunk_scan`` and ``mamba2_selective_state_update`` are one
generated code): for each token,

1. ``gate, xBC, dt = in_proj(h).split([I, I + 2 G N, H])`` (no extra MLP part);
2. ``xBC = act(conv1d(xBC))``, a depthwise causal convolution whose cached window holds the
   ``K`` last *inputs* (``[C, K]``, oldest first), then ``x, B, C = xBC.split([I, G N, G N])``;
3. ``d = softplus(dt + dt_bias)``, clamped to ``time_step_limit``, then the SSD recurrence with
   ``A = -exp(A_log)`` and the ``D`` skip (`paged_kv.kernels.recurrent.ssd`);
4. ``out_proj(norm(y, gate))`` with the gated RMS norm *gating first*:
   ``rmsnorm_per_group(y * silu(gate)) * weight``, groups of ``I // G`` channels.

Prefill and decode differ in transformers in one point that changes values: its one-token
cached step (``mamba2_selective_state_update``, taken when the cache already holds a state
and the forward has one token) never clamps the time step to ``time_step_limit``; its chunked
path (a prompt, a multi-token chunk, a one-token prompt on a fresh cache) does. Here a
sequence with one token in the call whose SSM state is not all zeros runs the step
unclamped, every other one clamped: what ``generate`` computes. The limit is ``(0, inf)`` by
default (no difference then). A ``time_step_limit`` of ``None`` (Granite / Bamba configs
accept it) is read as no limit; transformers' own prefill fails on it.

In bfloat16 / float16 transformers' one-token step also rounds intermediate products
(``dt * B * x``, the state before ``C``, its output) to the model dtype; the recurrence here
stays float32 throughout, as its chunked path does, so decode tokens match to that dtype's
rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.recurrent import causal_conv1d, ssd
from . import MixerOutput

__all__ = ["run_mamba2"]


def run_mamba2(module: torch.nn.Module, hidden_states: torch.Tensor,
               states: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor,
               emit_at: torch.Tensor) -> MixerOutput:
    """Run a transformers Mamba-2 mixer over the packed tokens of ``B`` sequences.

    Parameters
    ----------
    module : torch.nn.Module
        ``Mamba2Mixer``, ``NemotronHMamba2Mixer``, ``GraniteMoeHybridMambaLayer`` or
        ``BambaMixer``; its submodules (``in_proj``, ``conv1d``, ``act``, ``norm``,
        ``out_proj``) and parameters (``dt_bias``, ``A_log``, ``D``) are used as they are.
    hidden_states : torch.Tensor
        ``[T, hidden]`` what the decoder layer passes the module (after its input norm),
        sequences back to back.
    states : tuple of torch.Tensor
        ``(conv [B, C, K]`` in the model dtype, ``ssm [B, H, P, N]`` float32``)``: each
        sequence's initial states, zeros for a sequence that starts; ``C = I + 2 G N``, the
        window of the last ``K`` convolution inputs, oldest first (transformers' cache layout).
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]`` sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``.
    emit_at : torch.Tensor
        int64 ``[E]`` packed token indices after which the states are wanted.

    Returns
    -------
    MixerOutput
        ``out [T, hidden]`` (the module's forward output for those tokens, its dtype);
        ``final``: ``(conv [B, C, K], ssm [B, H, P, N])`` after each sequence's tokens, dtypes
        as given; ``emitted``: ``(conv [E, C, K], ssm [E, H, P, N])`` after each token of
        `emit_at`.

    Raises
    ------
    ValueError
        When the states' shapes do not fit the module, or (from the kernels) `cu_seqlens`
        does not tile the tokens or `emit_at` falls outside them.
    """
    y, gate, final, emitted = scan_projected(module, module.in_proj(hidden_states), states,
                                             cu_seqlens, emit_at)
    out = module.out_proj(module.norm(y, gate).to(hidden_states.dtype))
    return MixerOutput(out, final, emitted)


def scan_projected(module: torch.nn.Module, projected: torch.Tensor,
                   states: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor,
                   emit_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """A Mamba-2 mixer's part between its input projection and its gated output: the
    convolution, the time step and the scan (shared by every Mamba-2 family; Falcon-H1 scales
    the projection its own way first and gates the output its own way after).

    Parameters
    ----------
    module : torch.nn.Module
        The mixer (``conv1d``, ``act``, ``dt_bias``, ``A_log``, ``D``, its sizes).
    projected : torch.Tensor
        ``[T, inner + conv_dim + H]`` the input projection's output, model dtype.
    states, cu_seqlens, emit_at
        As `run_mamba2`'s.

    Returns
    -------
    y : torch.Tensor
        ``[T, inner]`` float32, the scan's output before the gate.
    gate : torch.Tensor
        ``[T, inner]`` the projection's gate part.
    final, emitted : tuple of torch.Tensor
        ``(conv, ssm)`` after each sequence's tokens, and after each token of `emit_at`.

    Raises
    ------
    ValueError
        When the states' shapes do not fit the module, or (from the kernels) `cu_seqlens`
        does not tile the tokens or `emit_at` falls outside them.
    """
    conv_state, ssm_state = states
    heads, head_dim, size = module.num_heads, module.head_dim, module.ssm_state_size
    groups, inner = module.n_groups, module.intermediate_size
    if ssm_state.shape[1:] != (heads, head_dim, size) \
            or conv_state.shape[1] != module.conv_dim:
        raise ValueError(f"states: expected conv [B, {module.conv_dim}, K] and ssm "
                         f"[B, {heads}, {head_dim}, {size}], got {list(conv_state.shape)} "
                         f"and {list(ssm_state.shape)}")
    tokens = projected.shape[0]
    gate, xbc, dt = projected.split([inner, module.conv_dim, heads], dim=-1)

    # The window keeps the convolution's raw inputs, as transformers' cache does. The
    # activation is the module's own, on the convolution rounded to the model dtype, as
    # transformers applies it (F.conv1d in the weights' dtype, then act).
    conv, conv_final, conv_emitted = causal_conv1d(
        xbc, module.conv1d.weight.squeeze(1), module.conv1d.bias, cu_seqlens, conv_state,
        activation=None, emit_at=emit_at)
    x, B, C = module.act(conv).split([inner, groups * size, groups * size], dim=-1)

    step = _time_step(module, dt, ssm_state, cu_seqlens, tokens)
    # x goes in as float32 so y comes out float32: transformers' chunked scan hands the
    # gated norm a float32 output too (its norm then multiplies the weight in float32)
    y, ssm_final, ssm_emitted = ssd(
        x.float().view(tokens, heads, head_dim), step, -torch.exp(module.A_log.float()),
        B.view(tokens, groups, size), C.view(tokens, groups, size), module.D, cu_seqlens,
        ssm_state, dt_softplus=False, dt_limit=(-float("inf"), float("inf")),
        emit_at=emit_at)
    return y.view(tokens, inner), gate, (conv_final, ssm_final), (conv_emitted, ssm_emitted)


def _time_step(module: torch.nn.Module, dt: torch.Tensor, ssm_state: torch.Tensor,
               cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``softplus(dt + dt_bias)`` per token and head, clamped where transformers clamps it.

    Parameters
    ----------
    module : torch.nn.Module
        The mixer (``dt_bias [H]``, ``time_step_limit``).
    dt : torch.Tensor
        ``[T, H]`` the time-step part of ``in_proj``'s output, model dtype.
    ssm_state : torch.Tensor
        ``[B, H, P, N]`` initial states: a non-zero one marks a sequence that already ran.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``.
    tokens : int
        ``T``.

    Returns
    -------
    torch.Tensor
        ``[T, H]`` float32 time steps.
    """
    # bias and softplus in the model dtype, then float32: both transformers paths round so
    step = F.softplus(dt + module.dt_bias.to(dt.dtype)).float()
    low, high = module.time_step_limit or (0.0, float("inf"))
    if low <= 0.0 and high == float("inf"):
        return step  # softplus >= 0: the clamp changes nothing
    clamped = step.clamp(low, high)
    # transformers' one-token cached step skips the clamp: one token, and a state from a
    # previous forward (a fresh sequence's is zeros, and it runs the clamped chunked path)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(step.device)
    stepping = (lengths == 1) & ssm_state.flatten(1).ne(0).any(1)
    per_token = torch.repeat_interleave(stepping, lengths, output_size=tokens)
    return torch.where(per_token[:, None], step, clamped)
