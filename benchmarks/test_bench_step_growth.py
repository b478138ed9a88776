"""The ``step_cost`` workload's second part at small size: one decode step's bookkeeping
with 64 and 128 running sequences, one layer group against three, the cache's array step
against the engine's scheduler step (the growth per doubling: `step_growth.py`)."""

from __future__ import annotations

import pytest

from paged_kv.bench.workloads.step_scale import DecodeStepper, trace_prompts

ROUNDS = 20


@pytest.mark.parametrize("num_seqs", [64, 128])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("kind", ["cache", "scheduler"])
def test_decode_step(benchmark, kind, groups, num_seqs):
    benchmark.group = f"decode step bookkeeping, {num_seqs} sequences"
    stepper = DecodeStepper(kind, groups, trace_prompts(num_seqs), ROUNDS + 4)
    benchmark.pedantic(stepper.step, rounds=ROUNDS, iterations=1, warmup_rounds=2)
