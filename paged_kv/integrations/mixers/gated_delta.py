"""The gated delta net of Qwen3-Next, Qwen3.5 (dense and MoE) and OLMo-Hybrid, over the
engine's packed batch.

transformers' ``*GatedDeltaNet.forward`` takes one padded batch ``[batch, seq, hidden]`` and a
cache of its own. Here the same computation runs over the packed tokens of many sequences,
each continuing from its states in the paged cache, with the module's own projections, norm
and parameters and our packed torch kernels for the two recurrences
(`paged_kv.kernels.recurrent.causal_conv1d`, `paged_kv.kernels.recurrent.gated_delta_rule`)::

    q, k, v, z, b, a = projections(x)            # per family, see `_project`
    q, k, v = split(silu(conv1d([q | k | v])))   # causal depthwise conv, window in the state
    beta = sigmoid(b)                            # (x 2 for OLMo-Hybrid's negative eigenvalues)
    g = -exp(A_log) * softplus(a + dt_bias)      # log decay, float32
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)  # q, k repeated over value heads
    out = out_proj(norm(o, z))                   # RMS norm per value head, gated by silu(z)

The families differ only in their projections (`_project`) and the names of their output
norm / projection; the states are the same: the convolution window ``[C, K]`` over the
concatenated q, k, v inputs (``C = 2 * Hk * Dk + Hv * Dv``), in transformers' cache layout
(the last ``K`` inputs, oldest first, zeros before the first token), and the delta-rule memory
``[Hv, Dk, Dv]`` in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.recurrent import causal_conv1d, gated_delta_rule
from . import MixerOutput

__all__ = ["run_gated_delta_net"]

# q, k, v, z flat, each [T, heads * head_dim]; b, a [T, Hv]
Projections = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                    torch.Tensor]


def _project(module: torch.nn.Module, x: torch.Tensor) -> Projections:
    """The module's input projections of the packed tokens, in the order its convolution reads.

    Parameters
    ----------
    module : torch.nn.Module
        A transformers gated delta net.
    x : torch.Tensor
        ``[T, hidden]`` packed tokens.

    Returns
    -------
    tuple of torch.Tensor
        ``q [T, Hk * Dk]``, ``k [T, Hk * Dk]``, ``v [T, Hv * Dv]`` (the convolution's inputs,
        heads in the order the convolution's channels hold them), the gate
        ``z [T, Hv * Dv]``, ``b [T, Hv]`` and ``a [T, Hv]``, in the module's dtype.

    Raises
    ------
    NotImplementedError
        For a module with none of the three families' projections.
    """
    tokens = x.shape[0]
    if hasattr(module, "in_proj_qkvz"):
        # Qwen3-Next fuses q, k, v, z (and b, a) interleaved per key head group: [q_g k_g v_g
        # z_g] for each group g. Its own reordering undoes that; it reads a batch dim, so
        # the packed tokens are handed over as one batch row of T tokens.
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(x)[None], module.in_proj_ba(x)[None])
        q, k, v, z = (t.reshape(tokens, -1) for t in (q, k, v, z))
        return q, k, v, z, b[0], a[0]
    if hasattr(module, "in_proj_qkv"):
        # Qwen3.5 / Qwen3.5-MoE: q, k, v fused head-major in that order, the rest separate
        q, k, v = module.in_proj_qkv(x).split([module.key_dim, module.key_dim,
                                               module.value_dim], dim=-1)
        return q, k, v, module.in_proj_z(x), module.in_proj_b(x), module.in_proj_a(x)
    if hasattr(module, "q_proj") and hasattr(module, "g_proj"):
        # OLMo-Hybrid: every projection separate; its gate is g_proj (not the decay "g")
        return (module.q_proj(x), module.k_proj(x), module.v_proj(x), module.g_proj(x),
                module.b_proj(x), module.a_proj(x))
    raise NotImplementedError(
        f"{type(module).__name__}: no gated delta net projections this mixer knows "
        "(in_proj_qkvz / in_proj_ba, in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, or "
        "q_proj / k_proj / v_proj / g_proj / a_proj / b_proj)")


def _output_layers(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The gated RMS norm and the output projection: ``norm`` / ``out_proj`` in Qwen's
    modules, ``o_norm`` / ``o_proj`` in OLMo-Hybrid's."""
    if hasattr(module, "out_proj"):
        return module.norm, module.out_proj
    return module.o_norm, module.o_proj


def run_gated_delta_net(module: torch.nn.Module, hidden_states: torch.Tensor,
                        states: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor,
                        emit_at: torch.Tensor) -> MixerOutput:
    """Run a transformers gated delta net over the packed tokens of ``B`` sequences.

    Parameters
    ----------
    module : torch.nn.Module
        ``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``, ``Qwen3_5MoeGatedDeltaNet`` or
        ``OlmoHybridGatedDeltaNet`` (its weights and submodules are used, its forward is not).
    hidden_states : torch.Tensor
        ``[T, hidden]`` the packed tokens (after the decoder layer's input norm: what the layer
        hands the module), in the module's dtype.
    states : tuple of torch.Tensor
        The initial states: ``conv [B, C, K]`` in the model's dtype (the last ``K`` inputs of
        the convolution over ``[q | k | v]``, oldest first; zeros for a fresh sequence) and
        ``recurrent [B, Hv, Dk, Dv]`` float32, with ``C = 2 * Hk * Dk + Hv * Dv``.
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]`` sequence offsets into `hidden_states`.
    emit_at : torch.Tensor
        int64 ``[E]`` packed token indices after which both states are wanted.

    Returns
    -------
    MixerOutput
        ``out [T, hidden]`` (the module forward's output for those tokens); ``final``
        ``(conv [B, C, K], recurrent [B, Hv, Dk, Dv])`` in the dtypes given; ``emitted``
        ``(conv [E, C, K], recurrent [E, Hv, Dk, Dv])``.

    Raises
    ------
    NotImplementedError
        For a module of no family this mixer knows (named in the message).
    ValueError
        From the kernels, for states or offsets of the wrong shape, or a convolution
        activation other than silu.
    """
    conv_state, recurrent_state = states
    tokens = hidden_states.shape[0]
    q, k, v, z, b, a = _project(module, hidden_states)

    # The convolution runs over q, k, v concatenated; its window is what the cache keeps.
    conv = module.conv1d
    mixed, conv_final, conv_emitted = causal_conv1d(
        torch.cat([q, k, v], dim=-1), conv.weight.squeeze(1), conv.bias, cu_seqlens,
        conv_state, activation=module.activation, emit_at=emit_at)
    q, k, v = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(tokens, module.num_k_heads, module.head_k_dim)
    k = k.reshape(tokens, module.num_k_heads, module.head_k_dim)
    v = v.reshape(tokens, module.num_v_heads, module.head_v_dim)

    # beta in the model's dtype, as the module rounds it (sigmoid, then the x2, in bf16 in a
    # bf16 model); the decay in float32, else exp(A_log) can overflow in fp16
    beta = b.sigmoid()
    if getattr(module, "allow_neg_eigval", False):
        beta = beta * 2.0  # OLMo-Hybrid: beta in [0, 2], the state's eigenvalues may go < 0
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)

    core, recurrent_final, recurrent_emitted = gated_delta_rule(
        q, k, v, g, beta, cu_seqlens, recurrent_state, emit_at=emit_at, use_qk_l2norm=True)

    # the gated norm normalises each value head on its own: rows of Dv
    norm, out_proj = _output_layers(module)
    core = norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    out = out_proj(core.reshape(tokens, module.value_dim))
    return MixerOutput(out, (conv_final, recurrent_final), (conv_emitted, recurrent_emitted))
