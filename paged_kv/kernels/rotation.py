"""A fixed orthonormal Hadamard rotation of each head (`CacheConfig.kv_rotation`).

Rotating keys and queries by the same orthonormal ``R`` leaves every score ``q . k`` as it
was in exact arithmetic, while each rotated key spreads an outlier channel over all its
dims, so a group of 16 stored values no longer shares its scale with one huge channel
(QuaRot's and vLLM TurboQuant's remedy for 4-bit keys). The Sylvester Hadamard is symmetric
and orthonormal, so ``R`` is its own inverse: rotating a stored key again reads it back.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def hadamard(head_dim: int, device: torch.device) -> torch.Tensor:
    """``[head_dim, head_dim]`` float32: the normalised Sylvester Hadamard of the largest
    power of two dividing `head_dim`, repeated along the diagonal (orthonormal, symmetric).

    Examples
    --------
    >>> (hadamard(2, torch.device("cpu")) * 2 ** 0.5).round()  # 1/sqrt(2) times sqrt(2)
    tensor([[ 1.,  1.],
            [ 1., -1.]])
    >>> h = hadamard(48, torch.device("cpu"))  # 3 blocks of 16: orthonormal all the same
    >>> bool(torch.allclose(h @ h.T, torch.eye(48), atol=1e-6))
    True
    """
    size = head_dim & -head_dim  # a head of 48 rotates in 3 blocks of 16
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    matrix = matrix / size ** 0.5
    return torch.block_diag(*[matrix] * (head_dim // size)).to(device)


def rotate(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., D] @ R`` computed in float32, returned in `dtype` (default x's); applying
    it twice gives `x` back up to rounding."""
    matrix = hadamard(x.shape[-1], x.device)
    return (x.float() @ matrix).to(dtype or x.dtype)
