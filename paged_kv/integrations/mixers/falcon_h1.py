"""Falcon-H1's Mamba-2 mixer (``FalconH1Mixer``) over the engine's packed batch.

Every Falcon-H1 decoder layer runs this mixer beside its attention, on the same normed
input. The mixer is Mamba-2 (`paged_kv.integrations.mixers.mamba2` describes the recurrence,
its convolution window and where transformers clamps the time step), with Falcon-H1's own
steps around it, read from transformers' ``FalconH1Mixer.forward``:

1. the input is scaled by ``ssm_in_multiplier`` before ``in_proj``, and ``in_proj``'s output
   by ``mup_vector`` (µP: one multiplier per part of ``gate, x, B, C, dt``; a buffer the
   model fills from ``ssm_multipliers``);
2. the inner size is ``mamba_d_ssm`` (else ``mamba_expand * hidden_size``);
3. the gate: with ``mamba_rms_norm`` the module's ``FalconH1RMSNormGated`` (norm then gate,
   or gate then norm, as ``mamba_norm_before_gate`` says: the module's norm decides),
   without it ``y * silu(gate)`` and no norm.

The decoder layer's multipliers (``attention_in_multiplier``, ``attention_out_multiplier``,
``ssm_out_multiplier``) stay the decoder layer's: only the mixer's forward is replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import MixerOutput
from .mamba2 import scan_projected

__all__ = ["run_falcon_h1"]


def run_falcon_h1(module: torch.nn.Module, hidden_states: torch.Tensor,
                  states: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor,
                  emit_at: torch.Tensor) -> MixerOutput:
    """Run a transformers ``FalconH1Mixer`` over the packed tokens of ``B`` sequences.

    Parameters
    ----------
    module : torch.nn.Module
        ``FalconH1Mixer``; its submodules (``in_proj``, ``conv1d``, ``act``, ``norm``,
        ``out_proj``), parameters (``dt_bias``, ``A_log``, ``D``), ``mup_vector`` buffer
        ``[1, 1, 2 I + 2 G N + H]`` and ``ssm_in_multiplier`` are used as they are.
    hidden_states : torch.Tensor
        ``[T, hidden]`` what the decoder layer passes the mixer (after its input norm),
        sequences back to back.
    states : tuple of torch.Tensor
        ``(conv [B, C, K]`` in the model dtype, ``ssm [B, H, P, N]`` float32``)``: each
        sequence's initial states, zeros for a sequence that starts; ``C = I + 2 G N``, the
        window of the last ``K`` convolution inputs, oldest first (transformers' layout).
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]`` sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``.
    emit_at : torch.Tensor
        int64 ``[E]`` packed token indices after which the states are wanted.

    Returns
    -------
    MixerOutput
        ``out [T, hidden]`` (the mixer's forward output, before the decoder layer's
        ``ssm_out_multiplier``); ``final``: ``(conv [B, C, K], ssm [B, H, P, N])`` after each
        sequence's tokens; ``emitted``: ``(conv [E, C, K], ssm [E, H, P, N])`` after each token
        of `emit_at`.

    Raises
    ------
    ValueError
        When the states' shapes do not fit the module, or (from the kernels) `cu_seqlens`
        does not tile the tokens or `emit_at` falls outside them.
    """
    # µP: the multipliers as transformers applies them (the buffer's dtype promotes as there)
    projected = module.in_proj(hidden_states * module.ssm_in_multiplier) \
        * module.mup_vector.reshape(-1)
    y, gate, final, emitted = scan_projected(module, projected, states, cu_seqlens, emit_at)
    gated = module.norm(y, gate) if module.mamba_rms_norm else y * F.silu(gate)
    return MixerOutput(module.out_proj(gated.to(hidden_states.dtype)), final, emitted)
