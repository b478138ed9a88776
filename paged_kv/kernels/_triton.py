"""Optional Triton: ``triton`` and ``tl`` are None when it is not installed.

Kernel modules define their ``@triton.jit`` kernels under ``if triton is not None:`` so that
``import paged_kv`` never needs Triton; `backend.use_triton` keeps launchers from being called
without it.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["tl", "triton"]
