"""The decode step with one long sequence among the running ones, its block tables made
afresh every step against kept from step to step (`CacheConfig.reuse_block_tables`).

    python benchmarks/long_row.py [--seqs 1024] [--groups 1,3] [--long 4096,16384,32768]
                                  [--steps 40]

A batch's block tables are ``[B, longest row's blocks]``: made afresh, every step writes
that whole table per attention group, so one long conversation makes every row as wide
(1,024 rows beside one of 32K tokens: 8 MB a group a step); kept, a step writes the
entries that changed. For each size this runs the scheduler's step
(`DecodeStepper("scheduler", ...)`: the trace's first ``SEQS - 1`` prompts and one of
``LONG`` tokens, all decoding) in one process, the two ways alternated three steps at a
time with the first step after each switch left out (it makes a kept table afresh), GC
off; prints ms per step (medians) and kept over fresh.
"""

from __future__ import annotations

import argparse
import gc
import statistics

from paged_kv.bench.workloads.step_scale import DecodeStepper, trace_prompts

BLOCK = 3  # steps each way in turn


def time_both(num_groups: int, num_seqs: int, long: int, num_steps: int,
              ) -> dict[bool, float]:
    """Median seconds of `num_steps` steps with fresh (False) and kept (True) tables."""
    prompts = [*trace_prompts(num_seqs - 1), tuple(range(7, 7 + long))]
    stepper = DecodeStepper("scheduler", num_groups, prompts, 4 * num_steps + 8)
    for _ in range(3):
        stepper.step()
    gc.collect()
    gc.disable()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    try:
        for i in range(2 * BLOCK * num_steps // (BLOCK - 1)):
            kept = (i // BLOCK) % 2 == 0
            if i % BLOCK == 0:
                for group in stepper.cache.groups:
                    group.tables.reuse_step_tables(kept)
                stepper.step()  # the switch's step: left out
                continue
            seconds[kept].append(stepper.step())
    finally:
        gc.enable()
    return {kept: statistics.median(values) for kept, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=1024, help="running sequences")
    parser.add_argument("--groups", default="1,3", help="layer groups: 1, 3 or both")
    parser.add_argument("--long", default="4096,16384,32768",
                        help="tokens of the long sequence (comma-separated)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps each way")
    args = parser.parse_args()
    print(f"{'groups':>6} {'longest':>8} {'fresh ms':>9} {'kept ms':>8} {'kept/fresh':>10}")
    for groups in (int(g) for g in args.groups.split(",")):
        for long in (int(n) for n in args.long.split(",")):
            times = time_both(groups, args.seqs, long, args.steps)
            print(f"{groups:>6} {long:>8} {1e3 * times[False]:>9.3f} {1e3 * times[True]:>8.3f}"
                  f" {times[True] / times[False]:>10.2f}")


if __name__ == "__main__":
    main()
