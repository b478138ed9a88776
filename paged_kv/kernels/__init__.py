"""Kernels over the paged pool: each op has a plain-torch reference (the CPU fast path).

Dispatch: CUDA tensors use Triton when it is installed, CPU tensors the torch reference;
``PAGED_KV_BACKEND=triton|torch`` forces one (with ``TRITON_INTERPRET=1`` the Triton
kernels run on CPU tensors, which is how CI tests them).
"""

from __future__ import annotations

from .attention import paged_attention, paged_attention_reference
from .backend import use_triton
from .copy import copy_blocks, copy_blocks_reference, swap_blocks
from .gather import gather_kv, gather_kv_reference
from .gather_packed import gather_kv_packed, gather_kv_packed_reference
from .write import write_kv, write_kv_reference

__all__ = [
    "copy_blocks",
    "copy_blocks_reference",
    "gather_kv",
    "gather_kv_packed",
    "gather_kv_packed_reference",
    "gather_kv_reference",
    "paged_attention",
    "paged_attention_reference",
    "swap_blocks",
    "use_triton",
    "write_kv",
    "write_kv_reference",
]
