"""Mamba-1's mixer (``MambaMixer``, ``FalconMambaMixer``, ``JambaMambaMixer``) over a packed batch.

The three transformers modules compute the same thing, up to optional RMS norms on the time
step and on B / C (Falcon-Mamba: weightless ones; Jamba: weighted ones), per token::

    x, z = in_proj(h).chunk(2)                 # [I] each
    x = act(conv1d(x))                         # depthwise causal conv, window of K inputs
    dt, B, C = x_proj(x).split([R, N, N])      # then dt, B, C = norms(dt, B, C) if any
    dt = dt_proj.weight @ dt                   # [I], the bias is added inside the scan
    y = selective_scan(x, dt, -exp(A_log), B, C, D, z, dt_bias=dt_proj.bias, softplus)
    out = out_proj(y)

Here ``in_proj``, ``x_proj``, the norms, ``dt_proj`` and ``out_proj`` run as the module's own
submodules over all ``T`` packed tokens at once; only the convolution and the scan, which
carry state along a sequence, run through `paged_kv.kernels.recurrent`, each sequence from
its own states.

transformers' cache path differs from this in one case: a chunk of several tokens run on a
cache that already holds a state continues the convolution window but restarts the SSM
state from zero (``mamba_selective_scan`` takes no initial state; transformers marks it as a
known bug). ``generate`` never hits it (one prompt pass from a fresh cache, then one-token
steps, which do read the state), and neither does a forward over the whole sequence; this
mixer continues both states, so a prompt split into chunks gives what the whole prompt
gives.
"""

from __future__ import annotations

import torch

from ...kernels.recurrent import causal_conv1d, selective_scan
from . import MixerOutput

__all__ = ["run_mamba1"]

# the activations the convolution kernel applies itself; any other runs after it
_KERNEL_ACTIVATIONS = frozenset({"silu", "swish"})
# the optional per-token norms, in the order transformers applies them (dt, B, C)
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def run_mamba1(module: torch.nn.Module, hidden_states: torch.Tensor,
               states: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor,
               emit_at: torch.Tensor) -> MixerOutput:
    """Run a Mamba-1 mixer over the packed tokens of ``B`` sequences, each from its states.

    Parameters
    ----------
    module : torch.nn.Module
        A transformers ``MambaMixer``, ``FalconMambaMixer`` or ``JambaMambaMixer``; its
        submodules and parameters are used, its ``forward`` is not.
    hidden_states : torch.Tensor
        ``[T, hidden]`` the mixer's input (after the decoder layer's norm), the tokens of
        every sequence back to back.
    states : tuple of torch.Tensor
        ``(conv [B, I, K], ssm [B, I, N])``: each sequence's last ``K`` convolution inputs,
        oldest first, in the model's dtype (transformers' cache layout), and its SSM state in
        float32; zeros for a sequence that starts.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``, sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``
        (it may own none: its states pass through).
    emit_at : torch.Tensor
        int64 ``[E]`` packed token indices after which the states are wanted.

    Returns
    -------
    MixerOutput
        ``out`` ``[T, hidden]`` in `hidden_states`' dtype (the module's forward on those
        tokens); ``final`` ``(conv [B, I, K], ssm [B, I, N])`` and ``emitted``
        ``(conv [E, I, K], ssm [E, I, N])``, in the dtypes of `states`.

    Raises
    ------
    ValueError
        When `states` is not two tensors, or a shape disagrees with the module
        (from the kernels).
    """
    if len(states) != 2:
        raise ValueError(f"Mamba-1 keeps two states (conv, ssm), got {len(states)}")
    conv_state, ssm_state = states
    dtype = hidden_states.dtype
    rank, size = int(module.time_step_rank), int(module.ssm_state_size)

    # the gate z is the second half (transformers chunks the [2I] projection in x, z)
    x, gate = module.in_proj(hidden_states).chunk(2, dim=-1)
    x, conv_final, conv_emitted = _convolve(module, x, conv_state, cu_seqlens, emit_at)

    time_step, B, C = module.x_proj(x).split([rank, size, size], dim=-1)
    # Falcon-Mamba and Jamba normalise dt (before dt_proj), B and C; Mamba has no such norm
    time_step, B, C = (_norm(module, name, t)
                       for name, t in zip(_NORMS, (time_step, B, C), strict=True))
    time_step = _time_step_projection(module, time_step)

    bias = module.dt_proj.bias
    y, ssm_final, ssm_emitted = selective_scan(
        x, time_step, -torch.exp(module.A_log.float()), B, C, module.D.float(), gate,
        cu_seqlens, ssm_state, delta_bias=None if bias is None else bias.float(),
        delta_softplus=True, emit_at=emit_at)
    # transformers casts the scan's output back to the input's dtype before out_proj
    out = module.out_proj(y.to(dtype))
    return MixerOutput(out, (conv_final, ssm_final), (conv_emitted, ssm_emitted))


def _convolve(module: torch.nn.Module, x: torch.Tensor, conv_state: torch.Tensor,
              cu_seqlens: torch.Tensor, emit_at: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's activated depthwise convolution over ``x [T, I]``, each sequence from its
    window ``[B, I, K]``: (outputs ``[T, I]``, final windows, emitted windows)."""
    conv = module.conv1d
    activation = module.activation
    fused = activation in _KERNEL_ACTIVATIONS
    out, final, emitted = causal_conv1d(
        x, conv.weight.squeeze(1), conv.bias, cu_seqlens, conv_state,
        activation=activation if fused else None, emit_at=emit_at)
    # an activation the kernel lacks is the module's own (ACT2FN[hidden_act]), applied after
    return (out if fused else module.act(out)), final, emitted


def _norm(module: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """``module.<name>(t)`` where the module has that norm, else `t` unchanged."""
    norm = getattr(module, name, None)
    return t if norm is None else norm(t)


def _time_step_projection(module: torch.nn.Module, time_step: torch.Tensor) -> torch.Tensor:
    """``dt_proj.weight @ dt`` per token, ``[T, R] -> [T, I]``: the bias is left to the scan,
    which adds it in float32 before the softplus, as transformers does."""
    proj = module.dt_proj
    if hasattr(getattr(module, "config", None), "_is_quantized"):
        # a quantized weight cannot be multiplied directly; transformers calls the layer and
        # takes its bias back off, and so do we
        return proj(time_step) - proj.bias
    return time_step @ proj.weight.t()
