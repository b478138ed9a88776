"""The ``step_cost`` workload at small size: one decode step of 8 sequences against history
length, the paged cache against the seeds' list and contiguous caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_kv.bench import ContiguousKVCache, ListKVCache
from paged_kv.bench.scale import QUICK
from paged_kv.bench.workloads.step_cost import BATCH_SIZE, PagedStepper, SeedStepper

SCALE = dataclasses.replace(QUICK, step_layers=1, step_kv_heads=4, step_head_dim=64)
ROUNDS = 20


def _stepper(kind: str, length: int):
    prefill = torch.randn(BATCH_SIZE, length, SCALE.step_kv_heads, SCALE.step_head_dim).half()
    max_len = length + ROUNDS + 5
    if kind.startswith("paged"):
        return PagedStepper(SCALE, length, max_len, prefill, gather=kind == "paged+gather")
    cache = ListKVCache(1) if kind == "list" else ContiguousKVCache(1)
    return SeedStepper(cache, 1, length, prefill)


@pytest.mark.parametrize("length", [128, 512, 2048])
@pytest.mark.parametrize("kind", ["paged+gather", "paged in place", "list", "contiguous"])
def test_decode_step(benchmark, kind, length):
    benchmark.group = f"decode step, 8 seqs at {length} tokens"
    stepper = _stepper(kind, length)
    benchmark.pedantic(stepper.step, rounds=ROUNDS, iterations=1, warmup_rounds=2)
