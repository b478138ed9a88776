"""One helper for tensor argument checks, so every message has the same shape."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def check_tensor(name: str, tensor: object, shape: Sequence[int | None], *,
                 dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None) -> None:
    """Raise TypeError / ValueError naming `name` unless `tensor` has this shape, dtype, device.

    ``None`` in `shape` matches any size.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    if tensor.dim() != len(shape) or any(
        s is not None and s != t for s, t in zip(shape, tensor.shape, strict=True)
    ):
        raise ValueError(f"{name}: expected shape {want}, got {tuple(tensor.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if tensor.dtype not in allowed:
            names = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name}: expected dtype {names}, got {tensor.dtype}")
    if device is not None and tensor.device != device:
        same_type = tensor.device.type == device.type
        if not (same_type and device.index is None):
            raise ValueError(f"{name}: expected device {device}, got {tensor.device}")


def read_only(array: np.ndarray) -> np.ndarray:
    """A view of `array` that raises on writes: owners hand these out instead of their state."""
    view = array.view()
    view.flags.writeable = False
    return view
