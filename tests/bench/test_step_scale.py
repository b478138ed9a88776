"""The ``step_cost`` workload's second part (`step_scale`) at tiny size: every layout and step
kind is measured at every size, the growth rows name each doubling, and the six steppers
of one size do the same work (the same sequences, tokens and leading blocks). No timing
is asserted."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paged_kv.bench.workloads.step_scale import (
    KINDS,
    LAYOUTS,
    DecodeStepper,
    TurnoverSteps,
    growth_rows,
    measure,
    trace_prompts,
)

SIZES = (4, 8)


@pytest.fixture(scope="module")
def stats():
    return measure(SIZES, decode_steps=2, repeats=1)


def test_every_layout_kind_and_size_is_measured(stats):
    assert set(stats) == {(g, k, n) for g in LAYOUTS for k in KINDS for n in SIZES}
    assert all(len(s.values) == 1 and math.isfinite(s.median) and s.median > 0
               for s in stats.values())


def test_growth_rows_name_each_doubling_and_three_groups_against_one(stats):
    figures, info, plot = growth_rows(stats)
    # a doubling per line (2 layouts x 3 kinds), then 3 groups against 1 per kind and size
    lines = len(LAYOUTS) * len(KINDS)
    assert lines == 6 and len(figures) == lines + len(KINDS) * len(SIZES)
    assert all(f.value.unit == "ms" and f.ratio > 0 for f in figures)
    assert sum("growth per doubling" in key for key in info) == lines
    assert all("4->8: " in value for key, value in info.items() if "growth" in key)
    assert len(plot.series) == lines and all(s.x == (4.0, 8.0) for s in plot.series)


def _state(stepper: DecodeStepper) -> dict:
    """Each sequence's tokens and leading-group blocks."""
    tables = stepper.cache.tables
    return {seq_id: (tables.num_tokens_of(seq_id), tables.blocks(seq_id).size)
            for seq_id in tables.seq_ids}


def test_the_steppers_of_one_size_do_the_same_work():
    prompts = trace_prompts(6)
    steppers = [DecodeStepper(kind, groups, prompts, 8) for groups in LAYOUTS for kind in KINDS]
    for stepper in steppers:
        assert stepper.rows.size == len(prompts)  # every sequence admitted and decoding
        for _ in range(3):
            stepper.step()
    states = [_state(stepper) for stepper in steppers]
    assert all(state == states[0] for state in states[1:])
    assert {len(s.cache.groups) for s in steppers} == {1, 3}
    assert {s.kind for s in steppers} == {"cache", "scheduler", "engine"}
    # the scheduler decodes every running sequence, one token each
    scheduler = steppers[1].scheduler
    assert all(n == 1 for n in scheduler.schedule().values())
    assert np.array_equal(np.sort(steppers[0].rows), np.sort(steppers[1].rows))


@pytest.mark.parametrize("groups", sorted(LAYOUTS))
def test_the_turnover_driver_finishes_and_admits_inside_its_steps(groups):
    """`TurnoverSteps` (``step_instructions.py --kind turnover``): after its warm-up, steps
    finish requests inside them and the refills keep the engine full, each step carried
    past the departures and arrivals."""
    turnover = TurnoverSteps(groups, 16)
    engine, finished, carried = turnover.engine, 0, 0
    for _ in range(40):
        turnover.refill()
        assert len(engine.scheduler.running) + len(engine.scheduler.waiting) == 16
        before = len(engine.unfinished_request_ids())
        assert turnover.step() > 0
        finished += before - len(engine.unfinished_request_ids())
        carried += engine.scheduler.steady.carried
    assert finished >= 3 and carried >= 30, (finished, carried)
