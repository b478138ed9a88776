"""One decode step's bookkeeping against running sequences, and its growth per doubling.

    python benchmarks/step_growth.py [--seqs 256,512,1024] [--steps 40] [--repeats 3]
    python benchmarks/step_growth.py --parts [--seqs 1024] [--steps 40] [--repeats 3]

The ``step_cost`` workload's second part on its own (`paged_kv.bench.workloads.step_scale`):
1 layer group (full attention) and 3 (full, sliding window, recurrent state), each as the
cache's array step (`prepare_decode`) and as the engine's scheduler step, every size and
layout interleaved in each repeat. Prints ms per step (median of the repeats' medians, min
in brackets), the growth per doubling, and three groups against one. Issue 42's targets:
<= 0.6 ms at 1,024 sequences with three groups (scheduler included), <= 1.1x per doubling.

``--parts`` times the three-group scheduler step by part instead, at each size: the
scheduler's `schedule`, `prepare` (the cache's step and the token array), `advance`, the
harness's list of sampled tokens (the model and sampler's stand-in, shown but not part of
the step: see `step_scale`) and `update_from_output` (medians of the steps, ms; the best
of the repeats).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from paged_kv.bench.workloads.step_scale import (
    KINDS,
    LAYOUTS,
    DecodeStepper,
    growth,
    label,
    measure,
    model_samples,
    trace_prompts,
)

PARTS = ("schedule", "prepare", "advance", "samples", "update", "step")


def time_parts(num_seqs: int, num_steps: int) -> dict[str, float]:
    """Median seconds of each part of `num_steps` three-group scheduler steps of
    `num_seqs` sequences (after one untimed), as `DecodeStepper` runs them (its step:
    all but the samples)."""
    scheduler = DecodeStepper("scheduler", 3, trace_prompts(num_seqs), num_steps + 1).scheduler
    clock, times = time.perf_counter, {part: [] for part in PARTS}
    for step in range(num_steps + 1):
        t0 = clock()
        plan = scheduler.schedule()
        t1 = clock()
        scheduler.prepare(plan)
        t2 = clock()
        scheduler.advance(plan)
        t3 = clock()
        samples = model_samples(plan)
        t4 = clock()
        scheduler.update_from_output(samples, frozenset())
        t5 = clock()
        parts = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t4 + t3 - t0)
        for part, seconds in zip(PARTS, parts, strict=True):
            times[part] += [seconds] if step else []
    return {part: statistics.median(values) for part, values in times.items()}


def print_parts(sizes: tuple[int, ...], num_steps: int, repeats: int) -> None:
    """`time_parts` of each size, the best of `repeats`, in ms."""
    print(f"{'3 groups, scheduler, by part (ms)':36} " + " ".join(f"{p:>9}" for p in PARTS))
    for n in sizes:
        runs = [time_parts(n, num_steps) for _ in range(repeats)]
        print(f"{n:>36} " + " ".join(f"{1e3 * min(r[p] for r in runs):9.3f}" for p in PARTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="256,512,1024", help="running sequences, doubling")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps a repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", action="store_true",
                        help="time the three-group scheduler step by part instead")
    parser.add_argument("--no-gc", action="store_true",
                        help="disable the cyclic GC for the whole run: its passes over the "
                             "running sequences' objects are a cost of their own, and "
                             "land on whichever step allocates when they fall due")
    args = parser.parse_args()
    sizes = tuple(int(n) for n in args.seqs.split(","))
    if args.no_gc:
        gc.disable()
    if args.parts:
        print_parts(sizes, args.steps, args.repeats)
        return
    stats = measure(sizes, args.steps, args.repeats)
    print(f"{'layout, step':52} " + " ".join(f"{n:>16}" for n in sizes)
          + "   growth per doubling")
    for groups in LAYOUTS:
        for kind in KINDS:
            times = [stats[(groups, kind, n)] for n in sizes]
            cells = " ".join(f"{1e3 * t.median:7.3f} ({1e3 * t.min:6.3f})" for t in times)
            rates = ", ".join(f"{ratio:.2f}x" for _, ratio in growth(stats, groups, kind))
            print(f"{label(groups, kind):52} {cells}   {rates}")
    for kind in KINDS:
        print(f"3 groups / 1 group, {kind}: " + ", ".join(
            f"{n}: {stats[(3, kind, n)].median / stats[(1, kind, n)].median:.2f}x"
            for n in sizes))


if __name__ == "__main__":
    main()
