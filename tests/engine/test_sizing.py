"""Sizing the pool from the device's memory: what is free, not what is installed."""

from __future__ import annotations

import torch

from paged_kv.engine import sizing


def test_cuda_pool_is_sized_from_free_not_total_memory(monkeypatch):
    """Fault: the CUDA pool sized from ``mem_get_info``'s total instead of its free bytes."""
    free, total = 3 * 2**30, 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    assert sizing.free_memory_bytes("cuda") == free
    assert sizing.free_memory_bytes(torch.device("cuda", 0)) == free
