"""One helper for tensor argument checks, so every message has the same shape."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from .tenants.policy import check_priority, check_retention


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


# sequence checks over `PageTables` (its ``row_of`` and ``swapped``), shared by the cache's
# lifecycle methods and its tensor methods
def require_known(tables, what: str, seq_id: object) -> None:
    """KeyError naming `what` unless `seq_id` has a row."""
    if seq_id not in tables:
        raise KeyError(f"{what}: unknown sequence {seq_id!r}")


def require_resident(tables, what: str, seq_id: object) -> None:
    """`require_known`, and ValueError when its blocks are swapped out."""
    require_known(tables, what, seq_id)
    if tables.swapped[tables.row_of[seq_id]]:
        raise ValueError(f"{what}: sequence {seq_id!r} is swapped out; swap_in() it first")


def require_new(tables, what: str, seq_id: object) -> None:
    """TypeError / ValueError naming `what` unless `seq_id` is hashable and has no row."""
    if not isinstance(seq_id, Hashable):
        raise TypeError(f"{what}: seq_id must be hashable, got {type(seq_id).__name__}")
    if seq_id in tables:
        raise ValueError(f"{what}: sequence {seq_id!r} already exists")


def require_layer(config, what: str, layer: object) -> None:
    """TypeError / ValueError naming `what` unless `layer` is an int layer of `config`."""
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
        raise TypeError(f"{what}: layer must be an int, got {type(layer).__name__}")
    if not 0 <= layer < config.num_layers:
        raise ValueError(f"{what}: layer {layer} out of range [0, {config.num_layers})")


def require_truncatable(tables, seq_id: object, num_tokens: object) -> None:
    """`truncate`'s checks: a resident sequence, and `num_tokens` an int in its length."""
    require_resident(tables, "truncate()", seq_id)
    current = tables.num_tokens_of(seq_id)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer):
        raise TypeError(f"truncate(): num_tokens must be an int, got {num_tokens!r}")
    if not 0 <= num_tokens <= current:
        raise ValueError(f"truncate(): num_tokens must be in [0, {current}] for "
                         f"{seq_id!r}, got {num_tokens}")


def check_retain(what: str, priority: object, retention_seconds: object) -> dict:
    """`priority` and `retention_seconds` as `BlockAllocator.free` takes them (None: the
    tenant's defaults); ValueError naming the argument of `what` that is out of range."""
    return {"priority": None if priority is None
            else check_priority(f"{what}: priority", priority),
            "retention_seconds": None if retention_seconds is None
            else check_retention(f"{what}: retention_seconds", retention_seconds)}
