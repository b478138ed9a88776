"""Where each sequence's tokens are in a packed batch of the recurrent layers' mixers, and
where each emission falls: the checks and offsets the torch references
(`paged_kv.kernels.recurrent`) and the Triton kernels (`recurrent_triton`,
`recurrent_triton_scan`) share, in a module of their own so that neither imports the other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# (outputs, final states, emitted states) of a mixer's recurrence
Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Packing(NamedTuple):
    """Where each sequence's tokens are in a packed batch, and where each emission falls."""

    starts: torch.Tensor     # [B] first token of each sequence
    lengths: torch.Tensor    # [B] its number of tokens
    emit_seq: torch.Tensor   # [E] the sequence of each emitted token
    emit_pos: torch.Tensor   # [E] the token's position inside its sequence
    longest: int             # max(lengths), the number of scan steps


def packing(cu_seqlens: torch.Tensor, num_tokens: int, batch: int,
            emit_at: torch.Tensor | None = None) -> Packing:
    """Check `cu_seqlens` and `emit_at` against ``num_tokens`` tokens and ``batch`` states.

    Parameters
    ----------
    cu_seqlens : torch.Tensor
        int64 ``[B + 1]``: sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``.
    num_tokens : int
        ``T``, the packed tokens' count.
    batch : int
        ``B``, the number of states passed in.
    emit_at : torch.Tensor, optional
        int64 ``[E]`` token indices whose following state is wanted (any order, repeats ok).

    Returns
    -------
    Packing
        Starts and lengths ``[B]``; the sequence and position ``[E]`` of each emission.

    Raises
    ------
    ValueError
        When the offsets do not tile ``[0, T)`` in order for ``B`` sequences, or an emission
        falls outside it.
    """
    cu = cu_seqlens.to(torch.int64)
    if cu.dim() != 1 or cu.numel() != batch + 1:
        raise ValueError(f"cu_seqlens: expected shape [{batch + 1}], got {list(cu.shape)}")
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens: expected 0 ... {num_tokens} non-decreasing, "
                         f"got {cu.tolist()}")
    emit = cu.new_zeros(0) if emit_at is None else emit_at.to(device=cu.device,
                                                              dtype=torch.int64)
    if emit.dim() != 1 or bool(((emit < 0) | (emit >= num_tokens)).any()):
        raise ValueError(f"emit_at: expected token indices in [0, {num_tokens}), "
                         f"got {emit.tolist()}")
    # a token's sequence is the last one starting at or before it (empty ones start there too)
    emit_seq = torch.searchsorted(cu, emit, right=True) - 1
    longest = int(lengths.max()) if batch else 0
    return Packing(cu[:-1], lengths, emit_seq, emit - cu[emit_seq], longest)
