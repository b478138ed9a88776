"""LFM2's gated short convolution (``Lfm2ShortConv``, ``Lfm2MoeShortConv``) over a packed batch.

Per token, with ``h`` the mixer's input (after the decoder layer's operator norm)::

    B, C, x = in_proj(h).chunk(3)     # [hidden] each, in that order
    y = conv(B * x)                   # depthwise causal conv over the last L_cache inputs,
                                      # no activation
    out = out_proj(C * y)

``in_proj`` and ``out_proj`` run as the module's own submodules over all ``T`` packed tokens
at once; the convolution, the only part that carries state along a sequence, runs through
`paged_kv.kernels.recurrent.causal_conv1d` from each sequence's window, which holds the
gated inputs ``B * x`` (transformers' cache keeps the same ``[hidden, L_cache]`` window).
transformers' prefill and one-token decode compute the same thing here: its cache path
prepends the cached window to a multi-token chunk too, so nothing restarts.
"""

from __future__ import annotations

import torch

from ...kernels.recurrent import causal_conv1d
from . import MixerOutput

__all__ = ["run_short_conv"]


def run_short_conv(module: torch.nn.Module, hidden_states: torch.Tensor,
                   states: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor,
                   emit_at: torch.Tensor) -> MixerOutput:
    """Run LFM2's short convolution over the packed tokens of ``B`` sequences.

    Parameters
    ----------
    module : torch.nn.Module
        A transformers ``Lfm2ShortConv`` or ``Lfm2MoeShortConv``; its ``in_proj``, ``conv``
        and ``out_proj`` are used, its ``forward`` is not.
    hidden_states : torch.Tensor
        ``[T, hidden]`` the mixer's input, the tokens of every sequence back to back.
    states : tuple of torch.Tensor
        ``(conv [B, hidden, L_cache],)``: each sequence's last ``L_cache`` gated inputs
        ``B * x``, oldest first, in the model's dtype; zeros for a sequence that starts.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``, sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``.
    emit_at : torch.Tensor
        int64 ``[E]`` packed token indices after which the window is wanted.

    Returns
    -------
    MixerOutput
        ``out`` ``[T, hidden]`` in `hidden_states`' dtype; ``final`` ``(conv [B, hidden,
        L_cache],)`` and ``emitted`` ``(conv [E, hidden, L_cache],)`` in the dtype of
        `states`.

    Raises
    ------
    ValueError
        When `states` is not one tensor, or a shape disagrees with the module (from the
        kernel).
    """
    if len(states) != 1:
        raise ValueError(f"LFM2's short convolution keeps one state (conv), got {len(states)}")
    B, C, x = module.in_proj(hidden_states).chunk(3, dim=-1)
    # the window holds the gated input, so the gate is applied before the convolution
    y, final, emitted = causal_conv1d(B * x, module.conv.weight.squeeze(1), module.conv.bias,
                                      cu_seqlens, states[0], activation=None, emit_at=emit_at)
    return MixerOutput(module.out_proj(C * y), (final,), (emitted,))
