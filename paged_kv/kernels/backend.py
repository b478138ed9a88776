"""Which implementation an op runs: Triton kernels or the torch reference."""

from __future__ import annotations

import functools
import logging
import os

import torch

from ._triton import triton

logger = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """True when Triton imports; logs one line the first time it does not."""
    if triton is None:
        logger.info("paged_kv: triton is not installed; using the torch kernels")
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether ops on `tensor` should run the Triton kernel."""
    forced = os.environ.get("PAGED_KV_BACKEND", "").lower()
    if forced == "torch":
        return False
    if forced == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("PAGED_KV_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                           "(Triton compiles for GPUs only); unset it to use the torch kernels")
    if forced == "triton" or tensor.is_cuda:
        return triton_available()
    return False
