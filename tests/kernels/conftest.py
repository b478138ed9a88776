"""Shared by the kernel tests: the fixed-seed torch backend, ceil division, and the one
tolerance table every kernel is checked against its plain-torch reference with."""

from __future__ import annotations

import pytest
import torch

# both sides compute in float32 and cast, so outputs differ by float32 noise (summation
# order: Triton tiles, torch does not) plus one rounding to the output dtype
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def tolerances(dtype: torch.dtype, roundings: int = 1) -> dict[str, float]:
    """`TOLERANCES` of `dtype` for outputs rounded `roundings` times on the way: 8-bit pages
    are dequantized into `dtype` before the attention rounds its output, hence 2."""
    return {name: value * roundings for name, value in TOLERANCES[dtype].items()}


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b``."""
    return -(-a // b)


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the plain-torch kernels and a fixed seed."""
    monkeypatch.setenv("PAGED_KV_BACKEND", "torch")
    torch.manual_seed(0)
